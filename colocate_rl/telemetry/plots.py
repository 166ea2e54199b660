"""The PNG plots of `colocate-rl report` (one run, or two side by side): GPU memory over time per rank, the step's
time by phase, the training reward and the held-out evaluation reward. matplotlib is imported only when plotting."""

from __future__ import annotations

from pathlib import Path

from colocate_rl.errors import UserError
from colocate_rl.telemetry.runs import COLORS, MAX_RANKS_SHOWN, PHASES, Run, phase_names, run_names
from colocate_rl.telemetry.timeline import finite, innermost_spans


def _panels(runs: list[Run], rows: int = 1, height: float = 4.0, width: float = 7.0):
    """A figure with `rows` × one column per run (shared y), Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(
        rows,
        len(runs),
        sharex="col",
        sharey=True,
        squeeze=False,
        layout="constrained",
        figsize=(11 if len(runs) == 1 else width * len(runs), height),
    )


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
    """Memory over time per rank (rows) and run (columns), innermost phases shaded, step ends marked."""
    import numpy as np
    from matplotlib.collections import PolyCollection
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    if not any(r.timelines for r in runs):
        return None
    rows = min(MAX_RANKS_SHOWN, max(len(r.timelines) for r in runs))
    fig, axes = _panels(runs, rows, height=1.9 * rows + 1.6)
    seen: set[str] = set()
    for col, (run, name) in enumerate(zip(runs, run_names(runs))):
        start = min((t.t0 for t in run.timelines), default=0.0)
        shown = f"ranks 0–{rows - 1} of {len(run.timelines)}" if len(run.timelines) > rows else ""
        axes[0][col].set_title(f"{name} {shown}" if run.timelines else f"{name}: no timeline/ in the run dir")
        for row in range(rows):
            ax = axes[row][col]
            if row >= len(run.timelines):
                ax.set_axis_off()
                continue
            tl = run.timelines[row]
            shift = tl.t0 - start
            spans = innermost_spans(tl.edges)
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
            ax.plot(t + shift, mem, color="black", linewidth=1)
            ends = [(e + shift, m if m is not None else float(np.interp(e, t, mem))) for e, m in tl.step_ends]
            ax.plot([e for e, _ in ends], [m for _, m in ends], "v", color="crimson", markersize=6)
            ax.set_ylabel(f"rank {tl.rank} ({tl.device})\n{'RSS' if tl.device == 'cpu' else 'GPU used'} (GiB)")
        axes[max(min(rows, len(run.timelines)) - 1, 0)][col].set_xlabel("time since start (s)")
    handles = [
        Patch(color=COLORS.get(p, "tab:cyan"), alpha=0.3, label=p)
        for p in dict.fromkeys([*PHASES, *sorted(seen)])
        if p in seen
    ]
    handles += [
        Line2D([], [], color="black", label="memory"),
        Line2D([], [], marker="v", color="crimson", linestyle="", label="optimizer step end"),
    ]
    fig.legend(handles=handles, loc="outside right upper", fontsize="small")
    fig.suptitle("Memory over time by rank (shading: innermost phase)")
    return _save(fig, path)


def plot_step_breakdown(runs: list[Run], path: Path) -> Path | None:
    """Stacked bars of the phase seconds per step, one panel per run (shared y)."""
    if not any(phase_names(r.steps) for r in runs):
        return None
    fig, axes = _panels(runs, height=4.6)
    for ax, run, name in zip(axes[0], runs, run_names(runs)):
        steps = [r["step"] for r in run.steps]
        bottom = [0.0] * len(steps)
        for phase in phase_names(run.steps):
            secs = [finite(r, f"time/{phase}_s") or 0.0 for r in run.steps]
            ax.bar(steps, secs, bottom=bottom, color=COLORS.get(phase, "tab:cyan"), label=phase, width=0.8)
            bottom = [b + s for b, s in zip(bottom, secs)]
        if not any(bottom):
            ax.text(0.5, 0.5, "no phase timing in metrics.jsonl", ha="center", transform=ax.transAxes)
        ax.set_title(name)
        ax.set_xlabel("step")
    axes[0][0].set_ylabel("seconds")
    handles = {h.get_label(): h for ax in axes[0] for h in ax.get_legend_handles_labels()[0]}
    fig.legend(handles=list(handles.values())[::-1], loc="outside right upper", fontsize="small")
    fig.suptitle("Time per step by phase (exclusive seconds; step 1 includes warm-up)")
    return _save(fig, path)


def plot_reward(runs: list[Run], path: Path) -> Path:
    """Reward per step (and the held-out eval/reward where evaluated), one panel per run (shared y)."""
    fig, axes = _panels(runs, width=6.0)
    for ax, run, name in zip(axes[0], runs, run_names(runs)):
        ax.plot(
            [r["step"] for r in run.steps],
            [r["reward"] for r in run.steps],
            marker="o" if len(run.steps) <= 60 else None,
            markersize=3,
            label="training (reward)",
        )
        if run.evals:
            evals = [r["step"] for r in run.evals], [r["eval/reward"] for r in run.evals]
            ax.plot(*evals, marker="s", markersize=4, color="tab:red", label="held-out (eval/reward)")
            ax.legend(fontsize="small")
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("mean reward")
    fig.suptitle("Reward per step")
    return _save(fig, path)


def plot_eval(runs: list[Run], path: Path) -> Path | None:
    """Held-out evaluation per evaluated step: eval/reward and each eval/<reward>, one panel per run (shared y)."""
    if not any(run.evals for run in runs):
        return None
    fig, axes = _panels(runs, width=6.0)
    for ax, run, name in zip(axes[0], runs, run_names(runs)):
        keys = dict.fromkeys(k for r in run.evals for k in r if k.startswith("eval/") and k != "eval/completion_length")
        for key in sorted(keys, key=lambda k: k != "eval/reward"):  # the weighted sum first, bold
            points = [(r["step"], v) for r in run.evals if (v := finite(r, key)) is not None]
            ax.plot(*zip(*points), marker="s", markersize=4, label=key, linewidth=2.5 if key == "eval/reward" else 1)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    axes[0][0].set_ylabel("mean over held-out prompts")
    fig.suptitle("Held-out evaluation (eval/reward: weighted sum of the rewards)")
    return _save(fig, path)
