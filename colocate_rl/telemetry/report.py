"""`colocate-rl report`: tables and PNG plots from a run directory's telemetry.

Reads `metrics.jsonl` (rank 0, one record per logged step) and `timeline/rank<N>.jsonl` (memory samples, phase
edges and step ends of each rank). Every telemetry field is optional and malformed lines are skipped (a half
written last line is normal while a run is in progress). Raises UserError only for a RUN_DIR that is not a run
directory, a run with no logged steps, or an --out that cannot be written.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from colocate_rl.errors import UserError
from colocate_rl.rundir import RunDir, read_metrics, step_records
from colocate_rl.telemetry.timeline import TIMED_PHASES, Timeline, finite, innermost_spans, read_timelines

PHASES = (*TIMED_PHASES, "other")  # "other": the step's time outside every timed phase
COLORS = dict(
    zip(
        PHASES,
        (
            "tab:blue",
            "tab:orange",
            "gold",
            "tab:green",
            "tab:red",
            "teal",
            "navy",
            "tab:purple",
            "tab:brown",
            "tab:pink",
            "tab:olive",
            "tab:gray",
        ),
    )
)
MEMORY_ROWS = [(f"end of {p}", f"mem/{p}_end_gib") for p in PHASES] + [
    ("after optimizer step (driver)", "mem/gpu_used_gib"),
    ("peak during step (driver)", "mem/gpu_peak_gib"),
    ("torch allocated", "mem/torch_allocated_gib"),
    ("torch reserved", "mem/torch_reserved_gib"),
    ("RSS after optimizer step", "mem/rss_gib"),
    ("RSS peak during step", "mem/rss_peak_gib"),
]
MAX_RANKS_SHOWN = 8


@dataclass
class Run:
    path: Path
    steps: list[dict[str, Any]]  # metrics.jsonl records that carry a reward
    timelines: list[Timeline]
    evals: list[dict[str, Any]] = field(default_factory=list)  # metrics.jsonl records of held-out evaluations


def eval_records(run_dir: Path) -> list[dict[str, Any]]:
    """One record per evaluated step (those with `eval/reward`), in step order; a step redone after a resume: its
    last record."""
    by_step = {
        r["step"]: r
        for r in read_metrics(run_dir)
        if type(r.get("step")) is int and finite(r, "eval/reward") is not None
    }
    return [by_step[step] for step in sorted(by_step)]


def load_run(run_dir: Path | str) -> Run:
    """Read a run directory. Fails if it has no metrics.jsonl or no logged training step."""
    path = Path(run_dir)
    metrics = RunDir(path).metrics
    if not metrics.is_file():
        what = "does not exist" if not path.exists() else "is not a run directory (no metrics.jsonl)"
        raise UserError(f"{path}: {what}; pass a directory written by `colocate-rl train`")
    steps = [r for r in step_records(path) if finite(r, "reward") is not None]  # a redone step: its last record
    if not steps:
        raise UserError(f"{metrics}: no training step logged yet; run report again once the run has logged a step")
    return Run(path, steps, [t for t in read_timelines(path) if t.points], eval_records(path))


def _phases(steps: list[dict]) -> list[str]:
    found = {m.group(1) for r in steps for k in r if (m := re.fullmatch(r"time/(\w+)_s", k)) and m.group(1) != "step"}
    return [p for p in PHASES if p in found] + sorted(found - set(PHASES))


def time_shares(run: Run) -> dict[str, tuple[float, float]]:
    """phase → (mean s/step, % of step time) over the steps after the first; 'step' is the total."""
    timed = [r for r in (run.steps[1:] or run.steps) if finite(r, "time/step_s") is not None]
    if not timed:
        return {}
    step = sum(r["time/step_s"] for r in timed) / len(timed)
    shares = {}
    for phase in _phases(timed):
        mean = sum(finite(r, f"time/{phase}_s") or 0.0 for r in timed) / len(timed)
        shares[phase] = (mean, 100 * mean / step if step else 0.0)
    return {**shares, "step": (step, 100.0)}


def memory_stats(run: Run) -> dict[str, tuple[float, float]]:
    """label → (mean GiB, max GiB) over all logged steps, for the memory fields the run has."""
    stats = {}
    for label, key in MEMORY_ROWS:
        values = [v for r in run.steps if (v := finite(r, key)) is not None]
        if values:
            stats[label] = (sum(values) / len(values), max(values))
    return stats


def run_summary(run: Run) -> dict[str, float | str]:
    """Steps, reward first/last, median s/step, median tokens/s, telemetry overhead (% of step time)."""
    first, last = run.steps[0], run.steps[-1]
    out: dict[str, float | str] = {
        "steps": f"{int(last['step'])}/{last.get('max_steps', '?')}",
        "reward (first step)": first["reward"],
        "reward (last step)": last["reward"],
    }
    step_s = [v for r in run.steps if (v := finite(r, "time/step_s")) is not None]
    if not step_s:  # older runs: wall time between logged steps
        pairs = [
            (finite(a, "wall_s"), finite(b, "wall_s"), b["step"] - a["step"]) for a, b in zip(run.steps, run.steps[1:])
        ]
        step_s = [(wb - wa) / n for wa, wb, n in pairs if wa is not None and wb is not None and n > 0]
    if step_s:
        out["median s/step"] = statistics.median(step_s)
    tokens = [v for r in run.steps if (v := finite(r, "gen/tokens_per_s")) is not None]
    if tokens:
        out["generated tokens/s (median)"] = statistics.median(tokens)
    both = [
        (o, s)
        for r in run.steps
        if (o := finite(r, "telemetry/overhead_s")) is not None and (s := finite(r, "time/step_s"))
    ]
    if both:
        out["telemetry overhead (% of step time)"] = 100 * sum(o for o, _ in both) / sum(s for _, s in both)
    if (wall := finite(last, "wall_s")) is not None:
        out["wall time at last step (s)"] = wall
    if run.evals:
        out["eval reward (first eval)"] = run.evals[0]["eval/reward"]
        out["eval reward (last eval)"] = run.evals[-1]["eval/reward"]
    return out


SUMMARY_FORMATS = {"reward": ".3f", "s/step": ".2f", "tokens/s": ",.0f", "overhead": ".2f", "wall": ".1f"}


def _fmt(value: Any, spec: str, signed: bool = False) -> str:
    if value is None or isinstance(value, str):
        return "–" if value is None else value
    return format(value, ("+" if signed else "") + spec)


def _table(
    title: str,
    caption: str,
    first: str,
    cols: list[str],
    specs: list[str] | dict[str, str],
    per_run: list[dict],
    names: list[str],
    diff: int = 0,
) -> Table:
    """Rows = union of the runs' keys; `cols` per run (format `specs` per column, or per row label as
    {word in label: spec}); with two runs one more column, the difference of column `diff` (second − first)."""
    two = len(per_run) == 2
    table = Table(title=title, caption=caption, title_justify="left", caption_justify="left", min_width=len(caption))
    table.add_column(first)
    for n in names if two else [""]:
        for c in cols:
            table.add_column(f"{n}: {c}" if two and len(cols) > 1 else n or c, justify="right")
    if two:
        table.add_column(f"Δ{' ' + cols[diff] if len(cols) > 1 else ''} ({names[1]} − {names[0]})", justify="right")
    for label in dict.fromkeys(k for stats in per_run for k in stats):
        row = [s.get(label) or (None,) * len(cols) for s in per_run]
        spec = (
            (lambda i: specs[i])
            if isinstance(specs, list)
            else (lambda i, label=label: next((v for k, v in specs.items() if k in label), ".3g"))
        )
        cells = [_fmt(v, spec(i)) for values in row for i, v in enumerate(values)]
        if two:
            a, b = row[0][diff], row[1][diff]
            cells.append(_fmt(b - a, spec(diff), signed=True) if isinstance(a, float) and isinstance(b, float) else "")
        table.add_row(label, *cells)
    return table


def tables(runs: list[Run]) -> list[Table]:
    """The time-share, memory and summary tables (one column group per run, plus Δ with two runs)."""
    names = _names(runs)
    n = len(runs[0].steps)
    warm = f"mean of logged steps 2–{n}; step 1 (warm-up) left out" if n > 1 else "one step logged (incl. warm-up)"
    cpu = all(not any(k.startswith("mem/gpu") for r in run.steps for k in r) for run in runs)
    mem_caption = "over all logged steps; " + ("process RSS (CPU run)" if cpu else "GPU driver view")
    time, memory = [time_shares(r) for r in runs], [memory_stats(r) for r in runs]
    return [
        _table(
            "time per step by phase",
            warm if any(time) else "no phase timing (time/*) in metrics.jsonl",
            "phase",
            ["s/step", "% of step"],
            [".3f", ".1f"],
            time,
            names,
        ),
        _table(
            "memory (GiB)",
            mem_caption if any(memory) else "no memory fields in metrics.jsonl",
            "memory",
            ["mean", "max"],
            [".2f", ".2f"],
            memory,
            names,
            diff=1,
        ),
        _table(
            "run summary",
            "",
            "",
            ["value"],
            SUMMARY_FORMATS,
            [{k: (v,) for k, v in run_summary(r).items()} for r in runs],
            names,
        ),
    ]


def _names(runs: list[Run]) -> list[str]:
    names = [r.path.name or str(r.path) for r in runs]
    return names if len(set(names)) == len(names) else [str(r.path) for r in runs]


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
    for col, (run, name) in enumerate(zip(runs, _names(runs))):
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
    if not any(_phases(r.steps) for r in runs):
        return None
    fig, axes = _panels(runs, height=4.6)
    for ax, run, name in zip(axes[0], runs, _names(runs)):
        steps = [r["step"] for r in run.steps]
        bottom = [0.0] * len(steps)
        for phase in _phases(run.steps):
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
    for ax, run, name in zip(axes[0], runs, _names(runs)):
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
    for ax, run, name in zip(axes[0], runs, _names(runs)):
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


def report(run_dirs: list[Path | str], out: Path | str | None = None, console: Console | None = None) -> list[Path]:
    """Print the tables and write the PNGs (compare_*.png for two runs) into `out` (default the first run dir).
    Fails (UserError) on a bad run dir, a run with no logged step, or an --out that is not a writable directory."""
    console = console or Console()
    if not 1 <= len(run_dirs) <= 2:
        raise UserError(f"RUN_DIR: got {len(run_dirs)} run directories; pass one, or two to compare them")
    runs = [load_run(d) for d in run_dirs]
    target = Path(out) if out is not None else runs[0].path
    if target.exists() and not target.is_dir():
        raise UserError(f"--out {target}: is a file; pass a directory")
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {target}: cannot create it ({e.strerror or e}); pass a writable directory")
    for table in tables(runs):
        console.print(table)
    written = []
    for name, plot, why in (
        ("memory_timeline", plot_memory_timeline, "no timeline/rank*.jsonl with memory samples"),
        ("step_breakdown", plot_step_breakdown, "no phase timing (time/*_s) in metrics.jsonl"),
        ("reward", plot_reward, ""),
        ("eval", plot_eval, "no eval/reward in metrics.jsonl (the recipe's eval section is off)"),
    ):
        name = ("compare_" if len(runs) == 2 else "") + name + ".png"
        path = plot(runs, target / name)
        written += [path] if path else []
        console.print(f"wrote {path}" if path else f"note: {why}; {name} not written", highlight=False)
    return written
