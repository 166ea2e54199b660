"""The measured probe's second stage: the fastest configuration that fits, as a pure function of
`trial(config) -> TrialResult` (tested without GPUs).

Every trial runs at one vLLM share (`sweep_share`): the estimate's share for vLLM's weights and the whole generation
batch's KV cache plus its margin (a bigger share buys nothing), never above what the bisection found to complete
less its margin. What the recipe leaves `auto` is swept: `generation.sleep_level` over 0 and 2 (auto's levels),
`trainer.micro_batch_size` over auto's choice and every larger divisor of the step's completions, smallest first; at a
level, once a size runs out of memory or peaks above the limit (the GPU less LAYOUT_HEADROOM), larger ones are not
tried. The recommendation is the passing trial with the shortest s/step whose peak stays within the limit; every
other configuration gets the reason it lost. A runner-up within CLOSE of the fastest is timed again, and so is the
fastest after it (A-B-A-B): the same configuration's s/step varied by up to 18 % between invocations on the H200
(issue 29's 1.7B runs), more than such a lead; the two are then ranked by the mean of their trials.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from colocate_rl.launch.failures import TOO_HIGH, TOO_LOW
from colocate_rl.memory.bisect import ProbeResult, TrialResult

AUTO_SLEEP_LEVELS = (0, 2)  # what generation.sleep_level auto chooses between (colocate_rl.memory.autolayout)
# Steps a swept trial runs at least (`--steps` when more): its s/step is the median of the steps after the first, and
# on the H200 one disturbed trial timed over 2 steps lost by 61 % (issue 29's sweep; its other phases were slow too)
SWEEP_STEPS = 6
CLOSE = 0.10  # a runner-up this close to the fastest is timed again, as is the fastest


@dataclass(frozen=True)
class Config:
    sleep_level: int
    micro_batch: int

    def sets(self) -> dict[str, Any]:
        return {"generation.sleep_level": self.sleep_level, "trainer.micro_batch_size": self.micro_batch}

    @property
    def label(self) -> str:
        return f"sleep {self.sleep_level}, micro-batch {self.micro_batch}"


@dataclass
class Entry:
    config: Config
    trial: TrialResult | None  # None: not tried
    verdict: str = ""  # why it lost ("" for the fastest)
    again: list[float] = field(default_factory=list)  # s/step of the trials that timed it again

    @property
    def timings(self) -> list[float]:
        """The s/step of each trial that timed it (none: [])."""
        return [self.trial.s_per_step, *self.again] if self.trial is not None and self.trial.s_per_step else []

    @property
    def s_per_step(self) -> float | None:
        """The mean s/step of its timed trials (None when none timed it)."""
        return sum(self.timings) / len(self.timings) if self.timings else None

    @property
    def peak(self) -> float | None:
        return max(self.trial.peaks.values()) if self.trial is not None and self.trial.peaks else None

    @property
    def forecast_cell(self) -> str:
        """The configuration's step-time forecast and how far it is off the measured s/step: `3.16 (+9 %)`; `none`
        where the forecast does not cover it; "" when not tried."""
        t = self.trial
        if t is None:
            return ""
        if t.forecast_s is None:
            return "none"
        off = f" ({100 * (t.forecast_s - t.s_per_step) / t.s_per_step:+.0f} %)" if t.s_per_step else ""
        return f"{t.forecast_s:.2f}{off}"

    def record(self) -> dict[str, Any]:
        t = self.trial
        return {
            "sleep_level": self.config.sleep_level,
            "micro_batch": self.config.micro_batch,
            "outcome": None if t is None else t.outcome,
            "s_per_step": self.s_per_step,
            "s_per_step_trials": self.timings,
            "forecast_s": None if t is None else t.forecast_s,
            "phase_s": None if t is None else t.phase_s,
            "peak_gib": None if self.peak is None else round(self.peak, 3),
            "run_dir": None if t is None else t.run_dir,
            "verdict": self.verdict or "fastest",
        }


@dataclass
class Sweep:
    share: float
    limit_gib: float
    entries: list[Entry]
    best: Entry | None  # None: no configuration completed within the limit

    def to_json(self) -> dict[str, Any]:
        return {
            "share": self.share,
            "limit_gib": round(self.limit_gib, 3),
            "configs": [e.record() for e in self.entries],
            "fastest": None if self.best is None else self.best.record(),
        }


def sweep_share(estimated: float, result: ProbeResult) -> float | None:
    """The share the sweep runs at: the estimate's (`Estimate.chosen`: weights, one batch's KV, margin), raised to
    the smallest passing share when a bisection trial had too little KV cache, lowered to the bisection's
    recommendation (largest passing less its margin). None when no share passed."""
    if result.recommended is None:
        return None
    floor = result.smallest if any(t.outcome in TOO_LOW for t in result.trials) else 0.0
    return min(max(estimated, floor or 0.0), result.recommended)


def configs(sleep_levels: tuple[int, ...], sizes: tuple[int, ...]) -> list[Config]:
    return [Config(level, size) for level in sleep_levels for size in sorted(sizes)]


def run_sweep(
    trial: Callable[[Config], TrialResult], candidates: list[Config], limit_gib: float, share: float
) -> Sweep:
    """Run `trial` on each candidate (grouped by level, micro-batches ascending), skipping the sizes above one that
    did not fit at that level; pick the fastest that fits. A failure of any kind is that configuration's verdict."""
    entries: list[Entry] = []
    stopped: dict[int, str] = {}  # level → the size that did not fit there
    for config in candidates:
        if config.sleep_level in stopped:
            entries.append(Entry(config, None, f"not tried: micro-batch {stopped[config.sleep_level]} did not fit"))
            continue
        t = trial(config)
        entry = Entry(config, t)
        if not t.ok:
            entry.verdict = t.outcome + (f": {t.detail}" if t.detail else "")
            if t.outcome in TOO_HIGH or t.outcome in TOO_LOW:
                stopped[config.sleep_level] = str(config.micro_batch)
        elif entry.peak is not None and entry.peak > limit_gib:
            entry.verdict = f"peak {entry.peak:.2f} GiB above the limit {limit_gib:.1f} GiB"
            stopped[config.sleep_level] = str(config.micro_batch)
        elif t.s_per_step is None:
            entry.verdict = "not timed (fewer than 2 steps)"
        entries.append(entry)
    fitting = sorted((e for e in entries if e.trial is not None and not e.verdict), key=lambda e: e.s_per_step)
    if len(fitting) > 1 and fitting[1].s_per_step <= fitting[0].s_per_step * (1 + CLOSE):
        for e in (fitting[1], fitting[0]):  # B-A after A-B: the runner-up first, so that neither always goes last
            again = trial(e.config)
            if again.ok and again.s_per_step:
                e.again.append(again.s_per_step)
        fitting.sort(key=lambda e: e.s_per_step)
    best = fitting[0] if fitting else None
    for e in fitting[1:]:
        s, b = e.s_per_step, best.s_per_step
        means = f", each the mean of {len(e.timings)} trials" if e.again else ""
        e.verdict = f"{(s / b - 1) * 100:.0f} % slower ({s:.2f} against {b:.2f} s/step{means})"
    return Sweep(share, limit_gib, entries, best)
