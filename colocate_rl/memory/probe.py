"""`colocate-rl mem-probe RECIPE` (measuring): run the real recipe for a few steps at candidate vLLM shares
(`generation.vllm_gpu_memory_utilization`), bisecting from the window `mem-probe --estimate` computes (up to
SEARCH_ABOVE_ESTIMATE above it), and recommend the largest share that completes the steps, less a safety margin.

- A trial is one `colocate-rl train` subprocess in a fresh process group (session) with its own run directory,
  a timeout, and every process it started ended before the next trial begins (GPU memory is not inherited).
- A failed trial is classified from its log (`classify_failure`): vLLM refused to start or CUDA ran out of
  memory → the share is too high; vLLM's KV cache cannot hold a sequence → too low; anything else stops the
  probe (bisecting on an unknown failure would report nonsense).
- `bisect` is pure: it takes `trial(util) -> TrialResult`, so it is tested without GPUs.
- `phase_peaks` reads the trial's `timeline/rank<N>.jsonl` files (colocate_rl.rank.telemetry) and gives each
  estimator phase's peak (GiB, the largest of all ranks, the first step left out: it includes the warm-up).
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from colocate_rl.memory.estimate import PHASES

OK = "ok"
START_REFUSED = "vLLM refused to start"  # too high: the share is not free at start-up
KV_TOO_SMALL = "KV cache too small"  # too low: the share leaves no KV room for one sequence / batch
OOM = "out of memory"  # too high: a rank ran out of GPU memory while training or generating
TIMEOUT = "timeout"
FAILED = "failed"  # anything else: the probe stops
TOO_HIGH, TOO_LOW = {START_REFUSED, OOM}, {KV_TOO_SMALL}

FAILURE_PATTERNS: list[tuple[str, str]] = [
    (START_REFUSED, r"less than desired GPU memory utilization"),
    (KV_TOO_SMALL, r"No available memory for the cache blocks"),
    (KV_TOO_SMALL, r"larger than the available KV cache memory"),
    (KV_TOO_SMALL, r"maximum number of tokens that can be stored in KV cache"),
    (KV_TOO_SMALL, r"estimated maximum model length is"),
    (KV_TOO_SMALL, r"Try increasing `?gpu_memory_utilization`?"),
    (OOM, r"CUDA out of memory"),
    (OOM, r"OutOfMemoryError"),
    (OOM, r"(?i)CUDA error: out of memory"),  # also vLLM's sleep-pool allocator: "CUDA Error: out of memory at …"
    (OOM, r"CUDA_ERROR_OUT_OF_MEMORY"),
    (OOM, r"cudaErrorMemoryAllocation"),
]

# telemetry phase → estimator phase. generation: `generate` without its nested phases (the KV-cache wake stays in);
# weight sync: `weight_sync` with the wake of the weights inside it; training: `train` without what nests in it
# (TRL generates inside training_step; DeepSpeed steps inside backward); optimizer step: `optimizer`.
INCLUSIVE = {"weight sync": "weight_sync", "optimizer step": "optimizer"}
EXCLUSIVE = {"generation": ("generate", {"wake"}), "training": ("train", set())}
# A weight sync with vLLM's weights asleep first empties torch's cache (what the optimizer step left reserved), then
# wakes them: readings before that wake still show the optimizer step's blocks being freed (H200, 0.5B ZeRO-3 on 2
# GPUs: 16.5 GiB read 7 ms into the sync, 8.7 at the wake, 10.2 the sync's own peak). Its peak starts at the wake.
STARTS_AT_CHILD = {"weight_sync": "wake"}

# The measured search runs this far above the estimate's largest share: on the H200s the estimate's top passed at
# once in the 0.5B cases (its phase peaks run 2-10 % off, a few GiB, i.e. a few hundredths of the share).
SEARCH_ABOVE_ESTIMATE = 0.05
TRIAL_SETS = ("trainer.logging_steps=1", "trainer.save_steps=0", "output.save_model=false")


@dataclass
class TrialResult:
    util: float
    outcome: str  # OK, START_REFUSED, KV_TOO_SMALL, OOM, TIMEOUT or FAILED
    seconds: float = 0.0
    steps: int = 0
    run_dir: str | None = None
    detail: str = ""  # the log line that classified the failure, or why it failed
    peaks: dict[str, float] = field(default_factory=dict)  # estimator phase → GiB (max over ranks)
    raw_peaks: dict[str, float] = field(default_factory=dict)  # telemetry phase → GiB, nested phases included
    log_tail: str = ""

    @property
    def ok(self) -> bool:
        return self.outcome == OK

    def record(self) -> dict[str, Any]:
        """The trial as JSON: every field but the log tail (that is for the error message)."""
        return {k: v for k, v in asdict(self).items() if k != "log_tail"}


@dataclass
class ProbeResult:
    trials: list[TrialResult]
    lower: float  # the window searched (on the resolution's grid)
    upper: float
    resolution: float
    margin: float
    largest: float | None  # the largest share that completed the steps
    smallest: float | None  # the smallest that did
    recommended: float | None  # largest − margin; not below the window, nor below `smallest` after a KV failure
    notes: list[str]

    def best_trial(self) -> TrialResult | None:
        return next((t for t in self.trials if t.ok and t.util == self.largest), None)


class ProbeAborted(Exception):
    """A trial failed for a reason the probe does not recognise (or timed out): bisecting on it would mislead."""

    def __init__(self, trial: TrialResult, trials: list[TrialResult]):
        self.trial, self.trials = trial, trials
        super().__init__(f"trial at {trial.util} failed ({trial.outcome}): {trial.detail}")


# --------------------------------------------------------------------------------------------- bisection


def _decimals(resolution: float) -> int:
    """Decimals of the grid: 0.01 → 2, 0.005 → 3."""
    return len(f"{resolution:.10f}".rstrip("0").partition(".")[2])


def bisect(
    trial: Callable[[float], TrialResult],
    lower: float,
    upper: float,
    resolution: float = 0.01,
    start: float | None = None,
    margin: float = 0.02,
) -> ProbeResult:
    """The largest share in [lower, upper] (on a grid of `resolution`) whose trial completes. Trials are taken at
    `start` first (default the middle); when that is too high, 2, 4 and 8 grid steps below it until one is not (the
    start is the estimate's largest share, so the answer is usually near it); then halfway between the largest
    passing share (else the largest too-low one) and the smallest too-high one, until they are one grid step apart.
    Too high (refused, OOM) bounds from above, too low (KV cache) from below; any other outcome raises
    ProbeAborted."""
    if resolution <= 0:
        raise ValueError("resolution must be positive")
    lo, hi = max(1, math.ceil(lower / resolution - 1e-9)), math.floor(upper / resolution + 1e-9)  # never 0
    if lo > hi:
        raise ValueError(f"no share on the {resolution:g} grid between {lower:.3f} and {upper:.3f}")
    digits = _decimals(resolution)

    def util(i):
        return round(i * resolution, digits)

    bad_low, bad_high = lo - 1, hi + 1  # exclusive bounds, grid indices
    passed: set[int] = set()
    trials: list[TrialResult] = []
    notes: list[str] = []
    nxt = None if start is None else min(hi, max(lo, round(start / resolution)))
    first, gallop = nxt, 2  # a too-high start: try 2, 4, 8 grid steps below it before halving
    while True:
        best = max((i for i in passed if i < bad_high), default=None)
        base = best if best is not None else bad_low
        if bad_high - base <= 1:
            break
        if nxt is None and first is not None and best is None and bad_low < lo and bad_high <= first and gallop <= 8:
            nxt, gallop = first - gallop, gallop * 2
        if nxt is None or not base < nxt < bad_high:
            nxt = (base + bad_high + 1) // 2
        result = trial(util(nxt))
        trials.append(result)
        if result.ok:
            passed.add(nxt)
            if nxt <= bad_low:
                notes.append(
                    f"{util(nxt)} completed although {util(bad_low)} had too little KV cache; results are "
                    "not monotonic (another process on the GPU?)"
                )
                bad_low = nxt - 1
        elif result.outcome in TOO_HIGH:
            if any(i >= nxt for i in passed):
                notes.append(
                    f"{util(nxt)} failed ({result.outcome}) although a share as large completed; results "
                    "are not monotonic (another process on the GPU?)"
                )
            bad_high = min(bad_high, nxt)
        elif result.outcome in TOO_LOW:
            bad_low = max(bad_low, nxt)
            passed = {i for i in passed if i > bad_low}
        else:
            raise ProbeAborted(result, trials)
        nxt = None
    good = sorted(i for i in passed if bad_low < i < bad_high)
    largest = util(good[-1]) if good else None
    smallest = util(good[0]) if good else None
    recommended = None
    if good:
        # A smaller share leaves the trainer more room, down to the estimate's lower bound (vLLM's weights and one
        # batch's KV cache); once a trial had too little KV cache that bound is wrong: stay at a share that passed.
        floor_ok = good[0] if bad_low >= lo else lo
        recommended = max(
            util(floor_ok), round(math.floor(round((largest - margin) / resolution, 6)) * resolution, digits)
        )
        if good[-1] == hi:
            notes.append(f"the top of the window ({util(hi)}) completed: larger shares were not tried")
    else:
        notes.append(
            "no share in the window completed the steps"
            + (f": {util(bad_high)} is too high" if bad_high <= hi else "")
            + (f", {util(bad_low)} too low" if bad_low >= lo else "")
        )
    return ProbeResult(trials, util(lo), util(hi), resolution, margin, largest, smallest, recommended, notes)


# ---------------------------------------------------------------------------------------- classification


def classify_failure(text: str) -> tuple[str, str]:
    """(outcome, the log line) of the earliest known failure in `text`; (FAILED, '') when none is recognised."""
    found = []
    for outcome, pattern in FAILURE_PATTERNS:
        match = re.search(pattern, text)
        if match:
            found.append((match.start(), outcome))
    if not found:
        return FAILED, ""
    pos, outcome = min(found)
    line_start = text.rfind("\n", 0, pos) + 1
    line_end = text.find("\n", pos)
    return outcome, text[line_start : line_end if line_end >= 0 else len(text)].strip()[:400]


# ------------------------------------------------------------------------------------------- phase peaks


def _rank_peaks(lines: list[dict[str, Any]], skip_first: bool) -> tuple[dict[str, float], dict[str, float]]:
    records = [r for r in lines if "rank" not in r]
    cut = next((i for i, r in enumerate(records) if "step_end" in r), -1) if skip_first else -1
    intervals: list[dict[str, Any]] = []  # name, start, end, parent (index into intervals)
    stack: list[int] = []
    for i, r in enumerate(records):
        if "phase" not in r:
            continue
        if r.get("edge") == "start":
            intervals.append(
                {
                    "name": r["phase"],
                    "start": i,
                    "end": len(records) - 1,  # unclosed: a crash
                    "parent": stack[-1] if stack else None,
                }
            )
            stack.append(len(intervals) - 1)
        elif r.get("edge") == "end":
            while stack:
                top = stack.pop()
                intervals[top]["end"] = i
                if intervals[top]["name"] == r["phase"]:
                    break
    children: dict[int, list[int]] = {}
    for k, iv in enumerate(intervals):
        if iv["parent"] is not None:
            children.setdefault(iv["parent"], []).append(k)

    def peak(k: int, keep: set[str] | None) -> float | None:
        """Max memory in interval k after its start edge (that reading is what the previous phase left, e.g. the
        allocator's cache from backward before the weight sync empties it), or from its STARTS_AT_CHILD child's
        start edge on, up to its end edge; with `keep`, inside nested phases only those named in it."""
        iv = intervals[k]
        first = iv["start"] + 1
        if iv["name"] in STARTS_AT_CHILD:
            first = next(
                (
                    intervals[c]["start"]
                    for c in children.get(k, [])
                    if intervals[c]["name"] == STARTS_AT_CHILD[iv["name"]]
                ),
                first,
            )
        skip = set()
        if keep is not None:
            for c in children.get(k, []):
                if intervals[c]["name"] not in keep:
                    skip.update(range(intervals[c]["start"] + 1, intervals[c]["end"]))  # a child's edges count
        values = [
            records[i]["mem"]
            for i in range(max(first, cut + 1), iv["end"] + 1)
            if i not in skip and isinstance(records[i].get("mem"), (int, float))
        ]
        return max(values) if values else None

    mapped: dict[str, float] = {}
    raw: dict[str, float] = {}
    for k, iv in enumerate(intervals):
        value = peak(k, None)
        if value is not None:
            raw[iv["name"]] = max(raw.get(iv["name"], value), value)
        for phase, name in INCLUSIVE.items():
            if iv["name"] == name and value is not None:
                mapped[phase] = max(mapped.get(phase, value), value)
        for phase, (name, keep) in EXCLUSIVE.items():
            if iv["name"] == name:
                value = peak(k, keep)
                if value is not None:
                    mapped[phase] = max(mapped.get(phase, value), value)
    return mapped, raw


def phase_peaks(run_dir: Path, skip_first: bool = True) -> tuple[dict[str, float], dict[str, float]]:
    """Per estimator phase (PHASES) the peak memory in GiB over all ranks' timelines, and per telemetry phase
    (nested phases included). The first step is left out when a later one was recorded."""
    mapped: dict[str, float] = {}
    raw: dict[str, float] = {}
    for path in sorted((Path(run_dir) / "timeline").glob("rank*.jsonl")):
        lines = []
        for text in path.read_text().splitlines():
            try:
                lines.append(json.loads(text))
            except json.JSONDecodeError:
                pass  # a line cut off by a crash
        m, r = _rank_peaks(lines, skip_first)
        if skip_first and not m:
            m, r = _rank_peaks(lines, False)  # one step only: take it, warm-up included
        for out, got in ((mapped, m), (raw, r)):
            for key, value in got.items():
                out[key] = round(max(out.get(key, value), value), 3)
    return {p: mapped[p] for p in PHASES if p in mapped}, raw


# ---------------------------------------------------------------------------------------------- one trial


def trial_command(
    recipe: str | Path,
    util: float,
    run_dir: Path,
    steps: int,
    sets: list[str] | None = None,
    python: str = sys.executable,
) -> list[str]:
    """`python -m colocate_rl train RECIPE --run-dir DIR --set ...`: the user's overrides, then the probe's."""
    argv = [python, "-m", "colocate_rl", "train", str(recipe), "--run-dir", str(run_dir)]
    for item in [
        *(sets or []),
        f"generation.vllm_gpu_memory_utilization={util:g}",
        f"trainer.max_steps={steps}",
        *TRIAL_SETS,
    ]:
        argv += ["--set", item]
    return argv


def _descendants(proc: subprocess.Popen, seen: dict) -> None:
    import psutil

    try:
        for child in psutil.Process(proc.pid).children(recursive=True):
            seen.setdefault((child.pid, child.create_time()), child)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        pass


def _end_all(proc: subprocess.Popen, seen: dict, grace_s: float) -> None:
    """End the trial: SIGTERM to its process group (`train` forwards it to torchrun's group) and to every process
    it started (each by its id), then SIGKILL to whatever is left after `grace_s`."""
    import psutil

    _descendants(proc, seen)
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    procs = [p for p in seen.values() if p.is_running()]
    for p in procs:  # also those in other sessions (torchrun's, vLLM's engine processes)
        try:
            p.terminate()
        except psutil.Error:
            pass
    deadline = time.monotonic() + grace_s
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    _, alive = psutil.wait_procs(procs, timeout=max(0.1, deadline - time.monotonic()))
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=10)
    proc.wait()


def _wait(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Wait for the trial, noting the processes it starts; afterwards none of them is left. True on timeout."""
    seen: dict = {}
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None:
        _descendants(proc, seen)
        if time.monotonic() > deadline:
            _end_all(proc, seen, grace_s=15)
            return True
        time.sleep(0.5)
    # torchrun, its ranks and vLLM's engine processes exit with `train`; end any straggler (it would hold GPU memory)
    if any(p.is_running() for p in seen.values()):
        _end_all(proc, seen, grace_s=10)
    return False


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


def run_trial(
    recipe: str | Path,
    util: float,
    run_dir: Path,
    steps: int,
    sets: list[str] | None = None,
    timeout_s: float = 900,
    python: str = sys.executable,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
) -> TrialResult:
    """Train `recipe` for `steps` steps at share `util` in `run_dir` (must not exist); classify the outcome and
    read the per-phase peaks. `train`'s own output goes to `<run_dir>.out` beside the run directory."""
    from colocate_rl.launch.execute import LOG_FILE, read_metrics

    run_dir = Path(run_dir).absolute()
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    out_path = run_dir.with_name(run_dir.name + ".out")
    argv = trial_command(recipe, util, run_dir, steps, sets, python)
    begin = time.monotonic()
    with out_path.open("wb") as out:
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=cwd,
            env={**os.environ, "COLUMNS": "200", **(env or {})},
        )
        timed_out = _wait(proc, timeout_s)
    seconds = round(time.monotonic() - begin, 1)
    done = {
        r["step"]
        for r in read_metrics(run_dir)
        if isinstance(r.get("step"), int) and ("reward" in r or "loss" in r) and "train_runtime" not in r
    }
    steps_done = max(done, default=0)
    log = (run_dir / LOG_FILE).read_text(errors="replace") if (run_dir / LOG_FILE).exists() else ""
    printed = out_path.read_text(errors="replace")
    peaks, raw = phase_peaks(run_dir) if (run_dir / "timeline").is_dir() else ({}, {})
    result = TrialResult(util, OK, seconds, steps_done, str(run_dir), peaks=peaks, raw_peaks=raw)
    if timed_out:
        result.outcome, result.detail = TIMEOUT, f"no result after {timeout_s:g} s (--trial-timeout); ended it"
    elif proc.returncode != 0 or steps_done < steps:
        outcome, line = classify_failure(log)
        if outcome == FAILED:
            outcome, line = classify_failure(printed)
        result.outcome = outcome
        result.detail = line or (
            f"exit code {proc.returncode} after {steps_done} of {steps} steps; see "
            f"{run_dir / LOG_FILE if log else out_path}"
        )
    if not result.ok:
        result.log_tail = _tail(log or printed)
    return result


# -------------------------------------------------------------------------------------- the whole probe


def trial_name(k: int, util: float) -> str:
    return f"trial-{k}-util{util:g}"


def run_probe(
    recipe: str | Path,
    sets: list[str],
    lower: float,
    upper: float,
    start: float | None,
    probe_dir: Path,
    steps: int = 3,
    resolution: float = 0.01,
    margin: float = 0.02,
    timeout_s: float = 900,
    on_trial: Callable[[int, TrialResult], None] | None = None,
    on_start: Callable[[int, float], None] | None = None,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
) -> ProbeResult:
    """Bisect the share with real trials of `recipe` (+ `sets`) in `probe_dir/trial-<k>-util<U>`."""
    count = 0

    def trial(util: float) -> TrialResult:
        nonlocal count
        count += 1
        if on_start:
            on_start(count, util)
        result = run_trial(
            recipe, util, Path(probe_dir) / trial_name(count, util), steps, sets, timeout_s, cwd=cwd, env=env
        )
        if on_trial:
            on_trial(count, result)
        return result

    return bisect(trial, lower, upper, resolution, start, margin)


def comparison(estimated: dict[str, float], measured: dict[str, float]) -> list[dict[str, Any]]:
    """Rows phase / estimate / measured / error of the estimate in % of the measurement."""
    rows = []
    for phase in PHASES:
        e, m = estimated.get(phase), measured.get(phase)
        rows.append(
            {
                "phase": phase,
                "estimate_gib": None if e is None else round(e, 3),
                "measured_gib": m,
                "error_pct": round((e - m) / m * 100, 1) if e is not None and m else None,
            }
        )
    return rows


def peak_at_share(
    measured: dict[str, float], util: float, target: float, estimate_at: Callable[[float], dict[str, float]]
) -> float | None:
    """The peak over phases of a trial measured at share `util`, moved to share `target`: each phase's measurement
    plus the estimate's change of that phase between the two shares (only vLLM's share term depends on the share,
    and vLLM takes exactly its share). None when nothing was measured."""
    at, to = estimate_at(util), estimate_at(target)
    moved = [m + to[p] - at[p] for p, m in measured.items() if p in at and p in to]
    return round(max(moved), 3) if moved else None


def to_json(result: ProbeResult, estimate_at: Callable[[float], dict[str, float]] | None = None) -> dict[str, Any]:
    """The probe for `--json`: window, trials, largest/smallest passing share, recommendation, and measured vs
    estimated peaks at the largest passing share."""
    best = result.best_trial()
    out: dict[str, Any] = {
        "window": {"lower": result.lower, "upper": result.upper, "resolution": result.resolution},
        "margin": result.margin,
        "largest_passing": result.largest,
        "smallest_passing": result.smallest,
        "recommended": result.recommended,
        "notes": result.notes,
        "trials": [t.record() for t in result.trials],
    }
    if best is not None and estimate_at is not None:
        out["phases"] = comparison(estimate_at(best.util), best.peaks)
    return out


def trials_table(trials: list[TrialResult]):
    from rich.table import Table

    table = Table(title="trials (peak GiB per phase, any rank, first step left out)")
    for col in ("#", "share", "result", "seconds", "steps", *PHASES):
        table.add_column(col, justify="left" if col == "result" else "right")
    for k, t in enumerate(trials, 1):
        table.add_row(
            str(k),
            f"{t.util:g}",
            t.outcome if t.ok else f"[red]{t.outcome}[/]",
            f"{t.seconds:.0f}",
            str(t.steps),
            *(f"{t.peaks[p]:.2f}" if p in t.peaks else "" for p in PHASES),
        )
    return table


def comparison_table(rows: list[dict[str, Any]], util: float):
    from rich.table import Table

    table = Table(title=f"measured vs estimated peak per GPU (GiB) at share {util:g}")
    for col in ("phase", "estimate", "measured", "estimate error"):
        table.add_column(col, justify="left" if col == "phase" else "right")

    def fmt(v, f):
        return "" if v is None else format(v, f)

    for r in rows:
        table.add_row(
            r["phase"],
            fmt(r["estimate_gib"], ".2f"),
            fmt(r["measured_gib"], ".2f"),
            "" if r["error_pct"] is None else f"{r['error_pct']:+.1f} %",
        )
    return table
