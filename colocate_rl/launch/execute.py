"""Execute a launch plan: create the run directory, build a built-in model, run torchrun supervised, and say how
it ended.

torchrun's combined output goes to this node's `train.log` (`colocate_rl.rundir`); each new step record of
`metrics.jsonl` is handed to `on_step` while the run goes. The exit code is torchrun's, except that a crash at
interpreter exit after rank 0 wrote `DONE` (a known vLLM sleep-mode problem) does not fail a finished, saved run.
Fails (UserError) before anything starts when the run directory is taken. Until the first step ends, the ranks'
compile cache is watched (a compile is announced, a lock a stopped compile left is removed) and a stop signal ends
the job at once (there is nothing to save, and the step end it would wait for may never come).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from colocate_rl.launch.compile_cache import CompileWatch
from colocate_rl.launch.failures import diagnose, rank_failure
from colocate_rl.launch.supervise import run_supervised
from colocate_rl.launch.watchdog import Watchdog
from colocate_rl.plan.launch_plan import LaunchPlan
from colocate_rl.rundir import RunDir, read_metrics, replace_file, write_run_dir
from colocate_rl.telemetry.events import STALE_WEIGHTS, STOPPED, USER_ERROR, read_events, user_errors


@dataclass
class RunResult:
    code: int  # what `train` exits with
    log: Path  # this node's train.log
    torchrun_code: int = 0  # torchrun's own exit code (negative: killed by that signal)
    crashed_after_done: bool = False  # torchrun failed at exit after the run finished and saved its model
    timed_out: bool = False
    seconds: float = 0.0
    stop_signal: int | None = None  # a stop signal asked the ranks to save and stop
    stopped_at: dict | None = None  # the `stopped` event: step and checkpoint the ranks stopped with
    ended_by: str | None = None  # why this launcher ended the job (the watchdog, a log it could not write)
    errors: list[str] = field(default_factory=list)  # what the ranks stopped on (events.jsonl), or the launcher
    hints: list[str] = field(default_factory=list)  # advice for known failures in the log
    before_first_step: bool = False  # a stop signal came before any rank ended a step: the job was ended at once
    rank_error: str | None = None  # the failed rank's own error line (or how it was killed), from the log

    def log_tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def exit_code(torchrun_code: int, stop_signal: int | None) -> int:
    """`train`'s exit code: 130 after Ctrl-C, 143 after SIGTERM or SIGHUP (the ranks saved and stopped), 128 + N when
    torchrun was killed by signal N, else torchrun's own."""
    if stop_signal is not None:
        return 130 if stop_signal == signal.SIGINT else 143
    return 128 - torchrun_code if torchrun_code < 0 else torchrun_code


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
    different recipe (multi-node; the ranks' recipe check then stops the run). A resumed run's plan
    (`resume_from`) rewrites its files in place, each replaced whole."""
    if plan.resume_from is not None:
        for name, content in plan.files.items():
            replace_file(plan.run_dir / name, content)
        differ = []
    else:
        differ = write_run_dir(plan.run_dir, plan.files, plan.node_dir)
    build_builtin_model(plan)
    return differ


def run(
    plan: LaunchPlan,
    *,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    echo: Callable[[str], None] | None = None,
    on_stop_request: Callable[[int], None] | None = None,
    watchdog: Watchdog | None = None,
    timeout_s: float | None = None,
    stdin: int | None = None,
    on_notice: Callable[[str], None] | None = None,
) -> RunResult:
    """Run a prepared plan's torchrun under supervision until it ends; then read how it ended. The first stop
    signal asks every rank to save a checkpoint at the next step end and stop (the run dir's STOP request;
    `on_stop_request(signum)` is told), a second one ends the job at once, and so does the first one before any
    step ended; `watchdog` ends a job that stalls. `on_notice` gets the compile cache's lines (`CompileWatch`)."""
    seen = 0
    paths = RunDir(plan.run_dir)
    env = {**os.environ, **plan.env}
    watch = CompileWatch(Path(env["TORCH_EXTENSIONS_DIR"])) if env.get("TORCH_EXTENSIONS_DIR") else None
    timelines = {p: p.stat().st_size for p in paths.timelines()}  # a resumed run's: the new steps make them grow
    state = {"stepped": False, "before_first_step": False}

    def stepped() -> bool:
        if not state["stepped"]:
            state["stepped"] = any(p.stat().st_size > timelines.get(p, 0) for p in paths.timelines())
        return state["stepped"]

    def notice(lines: list[str]) -> None:
        for line in lines:
            if on_notice is not None:
                on_notice(line)

    def on_tick() -> None:
        nonlocal seen
        records = read_metrics(plan.run_dir)
        for record in records[seen:]:
            if ("reward" in record or "eval/reward" in record) and on_step is not None:  # a step or an evaluation
                on_step(record)
        seen = len(records)
        if watch is not None and not stepped():  # the ops are built before the first step
            notice(watch.look())

    def on_signal(signum: int) -> bool:
        if not stepped():
            state["before_first_step"] = True
            return False  # nothing to save yet: end the job now
        try:
            paths.stop_request.write_text(f"{signal.Signals(signum).name}\n")
        except OSError:
            return False  # cannot ask the ranks: end the job now
        if on_stop_request is not None:
            on_stop_request(signum)
        return True

    log = paths.log(plan.node_dir)
    if watch is not None:
        notice(watch.clear_stale())
    started = time.time()
    outcome = run_supervised(
        plan.argv,
        env,
        log,
        echo=echo,
        on_tick=on_tick,
        check=watchdog.check if watchdog is not None else None,
        on_signal=on_signal,
        timeout_s=timeout_s,
        stdin=stdin,
    )
    result = RunResult(
        exit_code(outcome.returncode, outcome.signal),
        log,
        torchrun_code=outcome.returncode,
        timed_out=outcome.timed_out,
        seconds=outcome.seconds,
        stop_signal=outcome.signal,
        before_first_step=state["before_first_step"],
    )
    paths.stop_request.unlink(missing_ok=True)
    stopped = [
        e for e in read_events(plan.run_dir, STOPPED) if isinstance(e.get("t"), (int, float)) and e["t"] >= started
    ]
    if stopped and not paths.done.exists():  # this node's signal, or another node's stop request in a shared run dir
        result.stopped_at = stopped[-1]
        if outcome.signal is None and outcome.returncode == 0:
            result.code = 143
    if paths.done.exists() and not outcome.timed_out and (outcome.signal is None or outcome.returncode == 0):
        if outcome.returncode != 0:
            result.crashed_after_done = True
        result.code = 0  # the run finished and saved its model (a stop request came too late to matter)
    if outcome.error is not None:
        result.ended_by = outcome.error
        result.code = 1  # ended here (the watchdog, a log that could not be written), whatever torchrun said
    elif outcome.returncode < 0 and outcome.signal is None:
        name = signal.Signals(-outcome.returncode).name
        result.errors.append(f"torchrun was killed by {name}; every rank it had started was ended")
    if result.code != 0 and result.stopped_at is None:
        reported = user_errors(plan.run_dir)
        result.errors += reported
        if reported and outcome.error is None and outcome.signal is None:  # the ranks' own verdict: 2 or 3
            kinds = {e.get("kind") for e in read_events(plan.run_dir)}
            result.code = 2 if USER_ERROR in kinds else 3 if STALE_WEIGHTS in kinds else result.code
        text = log.read_text(errors="replace") if log.exists() else ""
        if outcome.signal is None and outcome.error is None:
            result.rank_error = rank_failure(text)
        if paths.recipe.exists():
            from colocate_rl.recipe.load import load_recipe

            result.hints = diagnose(text, load_recipe(paths.recipe))
    return result
