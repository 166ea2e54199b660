"""Bisection of vLLM's share over trials, as a pure function of `trial(share) -> TrialResult` (tested without GPUs).

Too high (vLLM refused to start, out of memory) bounds the share from above, too low (KV cache) from below; any
other outcome stops the search (`ProbeAborted`): bisecting on an unknown failure would report nonsense.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from colocate_rl.launch.failures import OK, TOO_HIGH, TOO_LOW


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
    s_per_step: float | None = None  # median time/step_s of the steps after the first (None: fewer than 2 steps)
    phase_s: dict[str, float] = field(default_factory=dict)  # timed phase (time/<name>_s) → median over those steps
    forecast_s: float | None = None  # the step-time forecast of the trial's configuration (None: none for it)
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
