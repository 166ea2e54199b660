"""A run directory's telemetry as `report` and its plots read it: the step and evaluation records of
`metrics.jsonl` and the ranks' timelines (`Run`, `load_run`), the phases and their plot colours, the runs' names.
Fails (UserError) only for a RUN_DIR that is not a run directory or a run with no logged step."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from colocate_rl.errors import UserError
from colocate_rl.rundir import RunDir, read_metrics, step_records
from colocate_rl.telemetry.timeline import TIMED_PHASES, Timeline, finite, read_timelines

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
            "crimson",
            "tab:brown",
            "tab:pink",
            "tab:olive",
            "tab:gray",
        ),
    )
)
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


def phase_names(steps: list[dict]) -> list[str]:
    found = {m.group(1) for r in steps for k in r if (m := re.fullmatch(r"time/(\w+)_s", k)) and m.group(1) != "step"}
    return [p for p in PHASES if p in found] + sorted(found - set(PHASES))


def run_names(runs: list[Run]) -> list[str]:
    names = [r.path.name or str(r.path) for r in runs]
    return names if len(set(names)) == len(names) else [str(r.path) for r in runs]
