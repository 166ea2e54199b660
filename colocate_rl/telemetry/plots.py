"""The PNG plots of `colocate-rl report`: GPU memory over time per rank, the step's time by phase, the training reward
and the held-out evaluation reward. Two runs share each plot (their curves overlaid, their bars side by side per
step), so they read against one scale. matplotlib is imported only when plotting."""

from __future__ import annotations

from pathlib import Path

from colocate_rl.errors import UserError
from colocate_rl.telemetry.runs import COLORS, MAX_RANKS_SHOWN, PHASES, Run, phase_names, run_names
from colocate_rl.telemetry.timeline import finite, innermost_spans

RUN_COLORS = ("tab:blue", "tab:orange")  # the lines of the first and second run when two are compared
RUN_HATCHES = ("", "//")  # the second run's bars in the step breakdown


def _figure(rows: int = 1, height: float = 4.0):
    """A figure of `rows` panels, one above the other (shared x), Agg backend; two runs share every panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(rows, 1, sharex=True, squeeze=False, layout="constrained", figsize=(11, height))


def _run_label(names: list[str], i: int, what: str) -> str:
    return f"{names[i]}: {what}" if len(names) > 1 else what


def _save(fig, path: Path) -> Path:
    try:
        fig.savefig(path, dpi=110)
    except OSError as e:
        raise UserError(f"--out {path.parent}: cannot write {path.name} ({e.strerror or e}); pass a writable directory")
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
    return path


def plot_memory_timeline(runs: list[Run], path: Path) -> Path | None:
    """Memory over time, one panel per rank; one run: its innermost phases shaded and step ends marked; two runs: each
    run's line and step ends in its colour, each from its own start."""
    import numpy as np
    from matplotlib.collections import PolyCollection
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    if not any(r.timelines for r in runs):
        return None
    rows = min(MAX_RANKS_SHOWN, max(len(r.timelines) for r in runs))
    fig, axes = _figure(rows, height=1.9 * rows + 1.6)
    names, one = run_names(runs), len(runs) == 1
    seen: set[str] = set()
    for i, run in enumerate(runs):
        start = min((t.t0 for t in run.timelines), default=0.0)
        line, marker = ("black", "crimson") if one else (RUN_COLORS[i], RUN_COLORS[i])
        for row, tl in enumerate(run.timelines[:rows]):
            ax, shift = axes[row][0], tl.t0 - start
            spans = innermost_spans(tl.edges) if one else []
            for phase in dict.fromkeys(p for _, _, p in spans):
                verts = [
                    [(a + shift, 0), (a + shift, 1), (b + shift, 1), (b + shift, 0)] for a, b, p in spans if p == phase
                ]
                ax.add_collection(
                    PolyCollection(
                        verts,
                        transform=ax.get_xaxis_transform(),
                        alpha=0.3,
                        linewidth=0,
                        facecolor=COLORS.get(phase, "tab:cyan"),
                    ),
                    autolim=False,
                )
                seen.add(phase)
            t, mem = np.array(tl.points).T
            ax.plot(t + shift, mem, color=line, linewidth=1)
            ends = [(e + shift, m if m is not None else float(np.interp(e, t, mem))) for e, m in tl.step_ends]
            ax.plot([e for e, _ in ends], [m for _, m in ends], "v", color=marker, markersize=6)
            ax.set_ylabel(f"rank {tl.rank} ({tl.device})\n{'RSS' if tl.device == 'cpu' else 'GPU used'} (GiB)")
    axes[-1][0].set_xlabel("time since the run's start (s)")
    handles = [
        Patch(color=COLORS.get(p, "tab:cyan"), alpha=0.3, label=p)
        for p in dict.fromkeys([*PHASES, *sorted(seen)])
        if p in seen
    ]
    if one:
        handles += [
            Line2D([], [], color="black", label="memory"),
            Line2D([], [], marker="v", color="crimson", linestyle="", label="optimizer step end"),
        ]
    else:
        handles += [
            Line2D([], [], color=RUN_COLORS[i], marker="v", label=name + ("" if run.timelines else " (no timeline/)"))
            for i, (name, run) in enumerate(zip(names, runs))
        ]
    fig.legend(handles=handles, loc="outside right upper", fontsize="small")
    shown = max(len(r.timelines) for r in runs)
    ranks = f"; ranks 0–{rows - 1} of {shown}" if shown > rows else ""
    what = "shading: innermost phase; ▼ optimizer step end" if one else "▼ optimizer step end"
    fig.suptitle(f"Memory over time by rank ({what}{ranks})" + ("" if one else f": {names[0]} vs {names[1]}"))
    return _save(fig, path)


def plot_step_breakdown(runs: list[Run], path: Path) -> Path | None:
    """Stacked bars of the phase seconds per step; two runs side by side at each step (the second hatched)."""
    if not any(phase_names(r.steps) for r in runs):
        return None
    fig, axes = _figure(height=4.6)
    ax, names, width = axes[0][0], run_names(runs), 0.8 / len(runs)
    for i, run in enumerate(runs):
        steps = [r["step"] - 0.4 + width * (i + 0.5) for r in run.steps]
        bottom = [0.0] * len(steps)
        for phase in phase_names(run.steps):
            secs = [finite(r, f"time/{phase}_s") or 0.0 for r in run.steps]
            ax.bar(
                steps,
                secs,
                bottom=bottom,
                color=COLORS.get(phase, "tab:cyan"),
                label=phase,
                width=width,
                hatch=RUN_HATCHES[i],
                edgecolor="white" if i else None,  # the hatch's colour
                linewidth=0,
            )
            bottom = [b + s for b, s in zip(bottom, secs)]
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    handles: dict = {}
    for handle, label in zip(*ax.get_legend_handles_labels()):
        handles.setdefault(label, handle)  # the first run's (plain) bars
    legend = list(handles.values())[::-1]
    if len(runs) > 1:
        from matplotlib.patches import Patch

        legend += [
            Patch(
                facecolor="lightgray",
                hatch=RUN_HATCHES[i],
                label=name + ("" if phase_names(run.steps) else " (no phase timing)"),
            )
            for i, (name, run) in enumerate(zip(names, runs))
        ]
    fig.legend(handles=legend, loc="outside right upper", fontsize="small")
    fig.suptitle("Time per step by phase (exclusive seconds; step 1 includes warm-up)")
    return _save(fig, path)


def plot_reward(runs: list[Run], path: Path) -> Path:
    """Reward per step (and the held-out eval/reward where evaluated); two runs overlaid, each in its colour."""
    fig, axes = _figure()
    ax, names = axes[0][0], run_names(runs)
    for i, run in enumerate(runs):
        ax.plot(
            [r["step"] for r in run.steps],
            [r["reward"] for r in run.steps],
            marker="o" if len(run.steps) <= 60 else None,
            markersize=3,
            color=RUN_COLORS[i],
            label=_run_label(names, i, "training (reward)"),
        )
        if run.evals:
            evals = [r["step"] for r in run.evals], [r["eval/reward"] for r in run.evals]
            color = "tab:red" if len(runs) == 1 else RUN_COLORS[i]
            ax.plot(
                *evals,
                marker="s",
                markersize=4,
                linestyle="--",
                color=color,
                label=_run_label(names, i, "held-out (eval/reward)"),
            )
    if len(runs) > 1 or any(run.evals for run in runs):
        ax.legend(fontsize="small")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.grid(alpha=0.3)
    fig.suptitle("Reward per step" + ("" if len(runs) == 1 else f": {names[0]} vs {names[1]}"))
    return _save(fig, path)


def plot_eval(runs: list[Run], path: Path) -> Path | None:
    """Held-out evaluation per evaluated step: eval/reward (bold) and each eval/<reward>; two runs overlaid, the
    second dashed."""
    if not any(run.evals for run in runs):
        return None
    fig, axes = _figure()
    ax, names = axes[0][0], run_names(runs)
    keys = dict.fromkeys(
        k for run in runs for r in run.evals for k in r if k.startswith("eval/") and k != "eval/completion_length"
    )
    colors = {key: f"C{j}" for j, key in enumerate(sorted(keys, key=lambda k: k != "eval/reward"))}
    for i, run in enumerate(runs):
        for key, color in colors.items():  # the weighted sum first, bold
            points = [(r["step"], v) for r in run.evals if (v := finite(r, key)) is not None]
            if points:
                ax.plot(
                    *zip(*points),
                    marker="s",
                    markersize=4,
                    color=color,
                    linestyle="--" if i else "-",
                    label=_run_label(names, i, key),
                    linewidth=2.5 if key == "eval/reward" else 1,
                )
    ax.set_xlabel("step")
    ax.set_ylabel("mean over held-out prompts")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.suptitle(
        "Held-out evaluation (eval/reward: weighted sum of the rewards)"
        + ("" if len(runs) == 1 else f": {names[0]} (solid) vs {names[1]} (dashed)")
    )
    return _save(fig, path)
