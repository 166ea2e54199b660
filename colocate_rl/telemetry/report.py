"""`colocate-rl report`: tables and PNG plots from a run directory's telemetry.

Reads `metrics.jsonl` (rank 0, one record per logged step) and `timeline/rank<N>.jsonl` (memory samples, phase
edges and step ends of each rank). Every telemetry field is optional and malformed lines are skipped (a half
written last line is normal while a run is in progress). Raises UserError only for a RUN_DIR that is not a run
directory, a run with no logged steps, or an --out that cannot be written.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from colocate_rl.errors import UserError
from colocate_rl.rundir import RunDir
from colocate_rl.telemetry.runs import PHASES, Run, load_run, phase_names, run_names
from colocate_rl.telemetry.timeline import finite

MEMORY_ROWS = [(f"end of {p}", f"mem/{p}_end_gib") for p in PHASES] + [
    ("after optimizer step (driver)", "mem/gpu_used_gib"),
    ("peak during step (driver)", "mem/gpu_peak_gib"),
    ("torch allocated", "mem/torch_allocated_gib"),
    ("torch reserved", "mem/torch_reserved_gib"),
    ("torch peak during step", "mem/torch_peak_gib"),
    ("allocator retries (GPU full) per step", "mem/alloc_retries"),
    ("RSS after optimizer step", "mem/rss_gib"),
    ("RSS peak during step", "mem/rss_peak_gib"),
]


def time_shares(run: Run) -> dict[str, tuple[float, float]]:
    """phase → (mean s/step, % of step time) over the steps after the first; 'step' is the total."""
    timed = [r for r in (run.steps[1:] or run.steps) if finite(r, "time/step_s") is not None]
    if not timed:
        return {}
    step = sum(r["time/step_s"] for r in timed) / len(timed)
    shares = {}
    for phase in phase_names(timed):
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
    """Steps, reward first/last, median s/step, median tokens/s, telemetry overhead (% of step time), and the
    step-time forecast against the run (`forecast_vs_measured`)."""
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
    if (tokens := _median(run.steps, "gen/tokens_per_s")) is not None:
        out["generated tokens/s (median)"] = tokens
    both = [
        (o, s)
        for r in run.steps
        if (o := finite(r, "telemetry/overhead_s")) is not None and (s := finite(r, "time/step_s"))
    ]
    if both:
        out["telemetry overhead (% of step time)"] = 100 * sum(o for o, _ in both) / sum(s for _, s in both)
    if (wall := finite(last, "wall_s")) is not None:
        out["wall time at last step (s)"] = wall
    if (calls := finite(first, "tools/call_frequency")) is not None:  # a recipe with tools
        out["tool calls/episode (first step)"] = calls
        out["tool calls/episode (last step)"] = finite(last, "tools/call_frequency")
    if run.evals:
        out["eval reward (first eval)"] = run.evals[0]["eval/reward"]
        out["eval reward (last eval)"] = run.evals[-1]["eval/reward"]
    return {**out, **engine_summary(run), **forecast_vs_measured(run)}


def _median(steps: list[dict], key: str) -> float | None:
    values = [v for r in steps if (v := finite(r, key)) is not None]
    return statistics.median(values) if values else None


def engine_summary(run: Run) -> dict[str, float]:
    """Medians over the steps after the first: with the engine in its own process its generation seconds a batch;
    with overlap the share of batches generated a step ahead and how much of their generation the steps did not
    wait for; the share of TRL's padded tokens the length-grouped micro-batches trained; with vLLM TRL's
    importance-sampling ratio and absolute sampler-trainer logprob difference (step means). No row for a field the
    run lacks."""
    steps = run.steps[1:] or run.steps
    out: dict[str, float] = {}
    engine = _median(steps, "engine_process/generate_s")
    if engine is not None:
        out["engine generation s/batch (median)"] = engine
    ahead = [v for r in steps if (v := finite(r, "overlap/ahead")) is not None]
    if ahead:
        out["batches generated a step ahead (%)"] = 100 * sum(ahead) / len(ahead)
        overlapped = [r for r in steps if r.get("overlap/ahead") == 1]
        wait, made = _median(overlapped, "time/generate_s"), _median(overlapped, "engine_process/generate_s")
        if wait is not None and made:  # the steps' generate phase is only the wait for a batch made ahead
            out["generation hidden by overlap (%)"] = max(0.0, 100 * (1 - wait / made))
    for label, key in (
        ("trained tokens vs TRL's micro-batches (median)", "micro_batches/tokens_vs_trl"),
        ("importance-sampling ratio (median)", "sampling/importance_sampling_ratio/mean"),
        ("|sampler − trainer| logprob (median)", "sampling/sampling_logp_difference/mean"),
    ):
        if (value := _median(steps, key)) is not None:
            out[label] = value
    return out


def _versus(forecast: float, measured: float) -> str:
    off = f" ({100 * (forecast - measured) / measured:+.0f} %)" if measured > 0 else ""
    return f"{forecast:.2f} vs {measured:.2f}{off}"


def forecast_vs_measured(run: Run) -> dict[str, str]:
    """The plan's step-time forecast (forecast.json, `colocate_rl.memory.forecast`) against the run: s/step and
    each phase, forecast vs the median over the steps after the first (a phase: the sum of its metrics; the rest:
    the step less every phase's metrics). {} for a run directory without one (written before forecasts)."""
    try:
        record = json.loads(RunDir(run.path).forecast.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(record, dict):
        return {}
    if not record.get("available"):
        return {"forecast": f"none — {record.get('reason', 'not recorded')}"}
    timed = [r for r in (run.steps[1:] or run.steps) if finite(r, "time/step_s") is not None]
    try:
        phases = {name: (float(p["s"]), list(p.get("metrics") or [])) for name, p in record["phases"].items()}
        predicted = float(record["s_per_step"])
    except (KeyError, TypeError, ValueError, AttributeError):
        return {"forecast": f"{RunDir(run.path).forecast.name} unreadable"}
    if not timed:
        return {"forecast s/step (nothing measured)": f"{predicted:.2f}"}
    listed = [m for _, metrics in phases.values() for m in metrics]

    def spent(r: dict, metrics: list[str]) -> float:
        return sum(finite(r, f"time/{m}_s") or 0.0 for m in metrics)

    out = {
        "s/step: forecast vs measured median": _versus(predicted, statistics.median(r["time/step_s"] for r in timed))
    }
    for name, (seconds, metrics) in phases.items():
        values = [spent(r, metrics) if metrics else r["time/step_s"] - spent(r, listed) for r in timed]
        out[f"  {name} s: forecast vs measured"] = _versus(seconds, statistics.median(values))
    return out


SUMMARY_FORMATS = {  # the first key in a row's label gives its format
    "reward": ".3f",
    "s/batch": ".2f",
    "(%)": ".0f",
    "ratio": ".3f",
    "logprob": ".3f",
    "tool calls": ".2f",
    "s/step": ".2f",
    "tokens/s": ",.0f",
    "overhead": ".2f",
    "wall": ".1f",
}


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
    names = run_names(runs)
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


def report(run_dirs: list[Path | str], out: Path | str | None = None, console: Console | None = None) -> list[Path]:
    """Print the tables and write the PNGs (compare_*.png for two runs) into `out` (default the first run dir).
    Fails (UserError) on a bad run dir, a run with no logged step, or an --out that is not a writable directory."""
    from colocate_rl.telemetry.plots import plot_eval, plot_memory_timeline, plot_reward, plot_step_breakdown

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
