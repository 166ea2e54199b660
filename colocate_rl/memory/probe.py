"""`colocate-rl mem-probe RECIPE` (measuring): run the real recipe for a few steps at candidate vLLM shares
(`generation.vllm_gpu_memory_utilization`), bisecting (`colocate_rl.memory.bisect`) from the window the estimate
computes (up to SEARCH_ABOVE_ESTIMATE above it), and recommend the largest share that completes the steps, less a
safety margin.

- A trial is the recipe planned in this process with the probe's overrides, then run like `train` runs it (a
  supervised torchrun process group with its own run directory and a timeout; every process it started is ended
  before the next trial begins, so no GPU memory is inherited).
- A failed trial is classified from its log (`colocate_rl.launch.failures`).
- Peaks per phase come from the trial's timelines (`colocate_rl.memory.peaks`).
- When `zero_stage` / `gradient_checkpointing` are auto, every trial trains with the layout auto chose at the
  recipe's own share (a larger share leaves no room for the faster layouts), and the best trial's peak, moved to
  that share, confirms or refutes auto's choice. Likewise `generation.sleep_level: auto`: every trial runs at the
  level auto chose at the recipe's share, and a choice of 0 is checked the same way.
- A trial turns off what a run of a few steps cannot honour (`TRIAL_OVERRIDES`): evaluation (its schedule is more
  steps than a trial has), checkpoints, saving and pushing the model, the watchdog (`--trial-timeout` stands in);
  `turned_off_line` names those the recipe has on. The recipe itself (and `--write`'s copy) keeps them.
Fails (UserError) when the recipe cannot be probed (transformers backend, a fixed KV budget, several nodes, no share
fits, a trial that does not plan).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from colocate_rl.errors import UserError
from colocate_rl.launch import execute
from colocate_rl.launch.failures import FAILED, OK, TIMEOUT, classify_failure
from colocate_rl.memory.autolayout import LAYOUT_HEADROOM, confirm_choice
from colocate_rl.memory.bisect import ProbeResult, TrialResult, bisect
from colocate_rl.memory.estimate import MEMORY_PHASES, Estimate, estimate
from colocate_rl.memory.peaks import comparison, peak_at_share, phase_peaks
from colocate_rl.memory.sweep import AUTO_SLEEP_LEVELS, SWEEP_STEPS, Config, Sweep, configs, run_sweep, sweep_share
from colocate_rl.plan.launch_plan import LaunchPlan, cache_dir, make_plan
from colocate_rl.plan.resolved import Resolved
from colocate_rl.recipe.load import format_sets
from colocate_rl.recipe.schema import Recipe
from colocate_rl.rundir import RunDir, read_metrics

SHARE_KEY = "generation.vllm_gpu_memory_utilization"
SEARCH_ABOVE_ESTIMATE = 0.05  # the estimate can be low by a few hundredths of the share: its top is tried first
TRIAL_OVERRIDES = {
    "trainer.logging_steps": 1,
    "eval.every_steps": None,  # every_steps > a trial's max_steps is refused; and it would evaluate at step 0
    "checkpoint.every_steps": None,
    "checkpoint.every_minutes": None,
    "watchdog.step_timeout_minutes": None,  # --trial-timeout ends a trial instead
    "output.save_model": False,
    "output.push_to_hub": None,  # a trial saves no model, so it pushes none
}
# What `turned_off_line` calls what a trial turns off, and the TRIAL_OVERRIDES keys that turn it on in a recipe
TURNED_OFF = {
    "evaluation": ("eval.every_steps",),
    "checkpoints": ("checkpoint.every_steps", "checkpoint.every_minutes"),
    "saving the model": ("output.save_model",),
    "the push to the hub": ("output.push_to_hub",),
    "the watchdog": ("watchdog.step_timeout_minutes",),
}


def trial_overrides(util: float, steps: int) -> dict[str, Any]:
    """What the probe sets for one trial, after the user's overrides and the pinned layout."""
    return {SHARE_KEY: util, "trainer.max_steps": steps, **TRIAL_OVERRIDES}


def _value(recipe: Recipe, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(recipe, section), name)


def turned_off(recipe: Recipe) -> dict[str, Any]:
    """The keys of `TURNED_OFF` that `recipe` has on (not null, not false), with its values: what every trial
    turns off that the recipe would do."""
    keys = [key for group in TURNED_OFF.values() for key in group]
    return {key: _value(recipe, key) for key in keys if _value(recipe, key) not in (None, False)}


def turned_off_line(recipe: Recipe, steps: int) -> str | None:
    """One line naming what the trials turn off that `recipe` has on (None: nothing), for before the trials."""
    on = turned_off(recipe)

    def shown(value: Any) -> str:
        return "true" if value is True else f"{value:g}" if isinstance(value, float) else str(value)

    items = []
    for what, keys in TURNED_OFF.items():
        given = [f"{key} {shown(on[key])}" for key in keys if key in on]
        if given:
            extra = "; --trial-timeout ends a trial instead" if what == "the watchdog" else ""
            items.append(f"{what} ({', '.join(given)}{extra})")
    if not items:
        return None
    return f"trials turn off: {', '.join(items)} — a trial of {steps} steps cannot honour them; the recipe keeps them"


def trial_name(k: int, util: float) -> str:
    return f"trial-{k}-util{util:g}"


def plan_trial(resolved: Resolved, run_dir: Path) -> LaunchPlan:
    """A trial's launch plan: the resolved recipe (with `trial_overrides`) run like `train` runs it, from here, with
    the step-time forecast of its configuration in forecast.json."""
    from colocate_rl.memory.forecast import forecast, forecast_json

    return make_plan(
        resolved,
        run_dir=Path(run_dir).absolute(),
        python=sys.executable,
        cwd=Path.cwd(),
        cache_dir=cache_dir(os.environ),
        base_env=os.environ,
        forecast=forecast_json(forecast(resolved)),
    )


def trial_timing(run_dir: Path, records: list[dict[str, Any]]) -> tuple[float | None, dict[str, float], float | None]:
    """A trial's (s/step, phase → s, forecast s/step) from its step `records`: medians over the steps after the first
    (the first compiles and warms up; None / {} with fewer than 2 steps), and forecast.json's s/step (None when the
    run directory has none or the forecast does not cover the configuration)."""
    timed = [r for r in records if r["step"] > 1 and isinstance(r.get("time/step_s"), (int, float))]
    names = sorted({k for r in timed for k in r if k.startswith("time/") and k.endswith("_s") and k != "time/step_s"})
    phases = {
        k[5:-2]: round(statistics.median(values), 3)
        for k in names
        if (values := [r[k] for r in timed if isinstance(r.get(k), (int, float))])
    }
    step = round(statistics.median(r["time/step_s"] for r in timed), 3) if timed else None
    path = RunDir(run_dir).forecast
    record = json.loads(path.read_text()) if path.is_file() else {}
    return step, phases, record.get("s_per_step") if record.get("available") else None


def run_trial(plan: LaunchPlan, util: float, steps: int, timeout_s: float = 900) -> TrialResult:
    """Run a trial's plan (its run directory must not exist) for `steps` steps at share `util`; classify the
    outcome, read the per-phase peaks and time the steps after the first (the first compiles and warms up)."""
    begin = time.monotonic()
    execute.prepare(plan)
    run = execute.run(plan, timeout_s=timeout_s, stdin=subprocess.DEVNULL)
    run_dir = plan.run_dir
    records = [
        r
        for r in read_metrics(run_dir)
        if isinstance(r.get("step"), int) and ("reward" in r or "loss" in r) and "train_runtime" not in r
    ]
    steps_done = max((r["step"] for r in records), default=0)
    log = run.log.read_text(errors="replace") if run.log.exists() else ""
    peaks, raw = phase_peaks(run_dir) if RunDir(run_dir).timeline_dir.is_dir() else ({}, {})
    seconds = round(time.monotonic() - begin, 1)
    result = TrialResult(util, OK, seconds, steps_done, str(run_dir), peaks=peaks, raw_peaks=raw)
    result.s_per_step, result.phase_s, result.forecast_s = trial_timing(run_dir, records)
    if run.timed_out:
        result.outcome, result.detail = TIMEOUT, f"no result after {timeout_s:g} s (--trial-timeout); ended it"
    elif run.torchrun_code != 0 or steps_done < steps:
        outcome, line = classify_failure(log)
        result.outcome = outcome
        result.detail = (
            line
            or (run.errors[0] if outcome == FAILED and run.errors else "")
            or (f"exit code {run.torchrun_code} after {steps_done} of {steps} steps; see {run.log}")
        )
    if not result.ok:
        result.log_tail = run.log_tail()
    return result


@dataclass
class ProbePlan:
    """What the measuring probe will search: the estimate's window and the layout every trial trains with."""

    resolved: Resolved  # the recipe as given (user overrides applied)
    estimate: Estimate
    lower: float  # the estimated window, clipped to the grid and to 1
    upper: float
    search_upper: float  # up to SEARCH_ABOVE_ESTIMATE above the window's top
    pinned: dict[str, Any]  # overrides that fix auto's layout and sleep level at the recipe's share ({}: no auto)
    probe_dir: Path

    def estimate_at(self, util: float) -> dict[str, float]:
        return {p: self.estimate.total(p, util) for p in MEMORY_PHASES}

    def sweep_configs(self) -> list[Config]:
        """What the sweep tries: auto's sleep levels (else the recipe's level) × auto's micro-batch and every larger
        divisor of the step's completions (else the recipe's micro-batch); at level 0 from the micro-batch taken
        awake where the forecast chose level 2 for a larger one."""
        recipe, micro, sleep = self.resolved.recipe, self.resolved.micro_batch_choice, self.resolved.sleep_choice
        levels = AUTO_SLEEP_LEVELS if sleep is not None else (recipe.generation.sleep_level,)
        if micro is None:
            return configs(levels, (recipe.trainer.per_device_train_batch_size,))
        total = recipe.trainer.step_completions
        awake = sleep.awake_micro_batch if sleep is not None and sleep.awake_micro_batch else micro.size
        divisors = [m for m in range(1, total + 1) if total % m == 0]
        return [Config(level, m) for level in levels for m in divisors if m >= (awake if level == 0 else micro.size)]


def plan_probe(
    resolved: Resolved,
    gpu_gib: float,
    probe_dir: Path,
    *,
    prompt_tokens: int | None = None,
    resolution: float = 0.01,
    resolve_with: Callable[[Mapping[str, Any]], Resolved] | None = None,
    steps: int = 3,
) -> ProbePlan:
    """Check that `resolved` can be probed and compute the window; with `resolve_with` (as `measure` takes it), also
    that a trial of `steps` steps plans (`trial_recipe`), so that its problems come before any trial runs. Fails
    (UserError) with the fix otherwise."""
    if resolved.backend != "vllm":
        raise UserError(
            "mem-probe: the recipe generates with transformers here (generation.backend); measuring bisects vLLM's "
            "share: install vLLM (pip install -e '.[gpu]') or set generation.backend: vllm"
        )
    dist = resolved.recipe.distributed
    if dist.nnodes > 1:
        fix = "--set distributed.nnodes=1" + (" --set distributed.rdzv_endpoint=null" if dist.rdzv_endpoint else "")
        raise UserError(
            f"distributed.nnodes: {dist.nnodes} nodes, but the probe's trials run on this machine alone; probe one "
            f"node with {fix} (the trainer then shards over {resolved.world_size // dist.nnodes} ranks, not "
            f"{resolved.world_size}: the share found errs low), or estimate with `colocate-rl mem-probe RECIPE "
            "--estimate`"
        )
    est = estimate(resolved, gpu_gib, prompt_tokens)
    if est.kv_budget_gib is not None:
        raise UserError(
            "generation.kv_cache_memory: set, so vLLM's share is fixed by it; the probe bisects "
            "generation.vllm_gpu_memory_utilization: add --set generation.kv_cache_memory=null to probe it"
        )
    lower, upper = max(est.lower, resolution), min(est.upper, 1.0)
    if lower > upper:
        raise UserError(
            f"mem-probe: the estimate leaves no vLLM share that fits (window {est.lower:.3f} to {est.upper:.3f}); "
            "`colocate-rl mem-probe RECIPE --estimate` names the cheapest change: pass it with --set and probe again"
        )
    if probe_dir.exists() and any(probe_dir.iterdir()):
        raise UserError(f"--probe-dir: {probe_dir} is not empty; choose another directory or remove it")
    choice = resolved.layout_choice
    pinned = choice.pinned_overrides(resolved.recipe.distributed.deepspeed) if choice is not None else {}
    if resolved.sleep_choice is not None:
        pinned["generation.sleep_level"] = resolved.sleep_choice.level
    if resolved.micro_batch_choice is not None:
        pinned["trainer.micro_batch_size"] = resolved.micro_batch_choice.size
    plan = ProbePlan(resolved, est, lower, upper, min(1.0, upper + SEARCH_ABOVE_ESTIMATE), pinned, probe_dir)
    if resolve_with is not None:
        trial_recipe(plan, resolve_with, upper, steps)
    return plan


def trial_recipe(
    plan: ProbePlan,
    resolve_with: Callable[[Mapping[str, Any]], Resolved],
    util: float,
    steps: int,
    config: Config | None = None,
) -> Resolved:
    """A trial's recipe: the user's (`resolve_with`), the layout pinned (a sweep's `config` in place of the pinned
    sleep level and micro-batch), then the probe's `trial_overrides`."""
    swept = {} if config is None else {k: v for k, v in config.sets().items() if k in plan.pinned}
    return resolve_with({**plan.pinned, **swept, **trial_overrides(util, steps)})


@dataclass
class Measurement:
    plan: ProbePlan
    result: ProbeResult
    layout_check: dict[str, Any] | None  # auto's choice checked against the best trial moved to the recipe's share
    sleep_check: dict[str, Any] | None = None  # the same for generation.sleep_level auto
    sweep: Sweep | None = None  # the second stage (None: not run, or no share passed)

    def recommended_sets(self) -> dict[str, Any] | None:
        """The one recommendation as overrides: the sweep's fastest configuration at its share (with the pinned
        layout); without a sweep, the bisection's share (largest passing less the margin). None: nothing passed."""
        plan, result = self.plan, self.result
        if self.sweep is None:
            if result.recommended is None:
                return None
            return {**plan.pinned, SHARE_KEY: result.recommended}
        if self.sweep.best is None:
            return None
        swept = {k: v for k, v in self.sweep.best.config.sets().items() if k in plan.pinned}
        return {**plan.pinned, **swept, SHARE_KEY: self.sweep.share}

    def to_json(self) -> dict[str, Any]:
        """The probe for `--json`: window, trials, largest/smallest passing share, recommendation, measured vs
        estimated peaks at the largest passing share, the pinned layout and its check, what the trials turned off
        (`turned_off`: key → the recipe's value)."""
        plan, result, best = self.plan, self.result, self.result.best_trial()
        out: dict[str, Any] = {
            "window": {"lower": result.lower, "upper": result.upper, "resolution": result.resolution},
            "margin": result.margin,
            "largest_passing": result.largest,
            "smallest_passing": result.smallest,
            "recommended": None if (sets := self.recommended_sets()) is None else sets[SHARE_KEY],
            "notes": result.notes,
            "trials": [t.record() for t in result.trials],
        }
        if best is not None:
            out["phases"] = comparison(plan.estimate_at(best.util), best.peaks)
        return {
            "estimate": {
                "lower": round(plan.estimate.lower, 4),
                "upper": round(plan.estimate.upper, 4),
                "chosen": plan.estimate.chosen,
            },
            "searched": [round(plan.lower, 4), round(plan.search_upper, 4)],
            "pinned_sets": format_sets(plan.pinned),
            "turned_off": turned_off(plan.resolved.recipe),
            **out,
            "layout_check": self.layout_check,
            "sleep_check": self.sleep_check,
            "sweep": None if self.sweep is None else self.sweep.to_json(),
            "recommended_sets": None if sets is None else format_sets(sets),
        }


def measure(
    plan: ProbePlan,
    resolve_with: Callable[[Mapping[str, Any]], Resolved],
    *,
    steps: int = 3,
    resolution: float = 0.01,
    margin: float = 0.02,
    timeout_s: float = 900,
    on_start: Callable[[int, float], None] | None = None,
    on_trial: Callable[[int, TrialResult], None] | None = None,
    sweep: bool = True,
    on_sweep: Callable[[int, Config, float], None] | None = None,
) -> Measurement:
    """Bisect the share with real trials in `plan.probe_dir/trial-<k>-util<U>`, then (`sweep`) time each of
    `plan.sweep_configs()` at `sweep_share` in `trial-<k>-util<U>-sleep<L>-mb<M>`; `resolve_with(overrides)` resolves
    the recipe with the probe's overrides on top of the user's. Raises ProbeAborted on an unknown bisection failure
    (a sweep's failure is that configuration's verdict)."""
    count = 0

    def trial(util: float, config: Config | None = None) -> TrialResult:
        nonlocal count
        count += 1
        if on_start and config is None:
            on_start(count, util)
        if on_sweep and config is not None:
            on_sweep(count, config, util)
        n = steps if config is None else max(steps, SWEEP_STEPS)
        resolved = trial_recipe(plan, resolve_with, util, n, config)
        name = trial_name(count, util) + (
            "" if config is None else f"-sleep{config.sleep_level}-mb{config.micro_batch}"
        )
        result = run_trial(plan_trial(resolved, plan.probe_dir / name), util, n, timeout_s)
        if on_trial:
            on_trial(count, result)
        return result

    result = bisect(trial, plan.lower, plan.search_upper, resolution, plan.upper, margin)
    share = sweep_share(plan.estimate.chosen, result) if sweep else None
    limit = plan.estimate.gpu_gib * (1 - LAYOUT_HEADROOM)
    swept = None if share is None else run_sweep(lambda c: trial(share, c), plan.sweep_configs(), limit, share)
    best, choice, sleep = result.best_trial(), plan.resolved.layout_choice, plan.resolved.sleep_choice
    share = plan.resolved.recipe.generation.vllm_gpu_memory_utilization
    peak = peak_at_share(best.peaks, best.util, share, plan.estimate_at) if best is not None else None

    def check(confirmed: tuple[bool, str]) -> dict[str, Any]:
        ok, line = confirmed
        return {"confirmed": ok, "measured_peak_gib": peak, "at_share": share, "line": line}

    layout_check = (
        {**check(confirm_choice(choice, peak)), "pinned": format_sets(plan.pinned)}
        if choice is not None and peak is not None
        else None
    )
    sleep_check = check(sleep.confirm(peak)) if sleep is not None and peak is not None else None
    return Measurement(plan, result, layout_check, sleep_check, swept)


def default_probe_dir(now) -> Path:
    """runs/mem-probe-<date>-<time>: where the trials' run directories go unless `--probe-dir` says otherwise."""
    return Path("runs") / f"mem-probe-{now:%Y%m%d-%H%M%S}"
