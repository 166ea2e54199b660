"""Execute a launch plan: create the run directory, build a built-in model, run torchrun supervised, and say how
it ended.

torchrun's combined output goes to this node's `train.log` (`colocate_rl.rundir`); each new step record of
`metrics.jsonl` is handed to `on_step` while the run goes. The exit code is torchrun's, except that a crash at
interpreter exit after rank 0 wrote `DONE` (a known vLLM sleep-mode problem) does not fail a finished, saved run.
Fails (UserError) before anything starts when the run directory is taken.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from colocate_rl.launch.failures import diagnose
from colocate_rl.launch.supervise import run_supervised
from colocate_rl.plan.launch_plan import LaunchPlan
from colocate_rl.rundir import RunDir, read_metrics, write_run_dir
from colocate_rl.telemetry.events import user_errors


@dataclass
class RunResult:
    code: int  # what `train` exits with
    log: Path  # this node's train.log
    torchrun_code: int = 0  # torchrun's own exit code
    crashed_after_done: bool = False  # torchrun failed at exit after the run finished and saved its model
    timed_out: bool = False
    errors: list[str] = field(default_factory=list)  # what the ranks stopped on (events.jsonl)
    hints: list[str] = field(default_factory=list)  # advice for known failures in the log

    def log_tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def build_builtin_model(plan: LaunchPlan) -> None:
    """Generate the offline built-in model once, before any rank starts, in a child process: this process
    supervises the whole run and must not hold GPU memory."""
    if plan.builtin_model:
        from colocate_rl.builtin_model import build_model_in_subprocess

        spec = dict(plan.builtin_model)
        link = Path(spec.pop("link"))
        built = build_model_in_subprocess(**spec)
        if not link.exists():
            try:
                link.symlink_to(built, target_is_directory=True)
            except FileExistsError:  # another node of a shared run dir linked it first
                pass


def prepare(plan: LaunchPlan) -> list[str]:
    """Write the run directory and build the built-in model. Returns the shared files another node wrote from a
    different recipe (multi-node; the ranks' recipe check then stops the run)."""
    differ = write_run_dir(plan.run_dir, plan.files, plan.node_dir)
    build_builtin_model(plan)
    return differ


def run(
    plan: LaunchPlan,
    *,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    echo: Callable[[str], None] | None = None,
    timeout_s: float | None = None,
    stdin: int | None = None,
) -> RunResult:
    """Run a prepared plan's torchrun under supervision until it ends; then read how it ended."""
    seen = 0

    def on_tick() -> None:
        nonlocal seen
        records = read_metrics(plan.run_dir)
        for record in records[seen:]:
            if "reward" in record and on_step is not None:
                on_step(record)
        seen = len(records)

    paths = RunDir(plan.run_dir)
    log = paths.log(plan.node_dir)
    outcome = run_supervised(
        plan.argv, {**os.environ, **plan.env}, log, echo=echo, on_tick=on_tick, timeout_s=timeout_s, stdin=stdin
    )
    result = RunResult(outcome.returncode, log, torchrun_code=outcome.returncode, timed_out=outcome.timed_out)
    if result.code != 0 and paths.done.exists() and not outcome.timed_out:
        result.code, result.crashed_after_done = 0, True
    if result.code != 0:
        result.errors = user_errors(plan.run_dir)
        if paths.recipe.exists():
            from colocate_rl.recipe.load import load_recipe

            text = log.read_text(errors="replace") if log.exists() else ""
            result.hints = diagnose(text, load_recipe(paths.recipe))
    return result
