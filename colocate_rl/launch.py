"""Execute a launch plan: create the run directory, build a built-in model, run torchrun supervised.

torchrun's combined output goes to `<run_dir>/train.log` (and to the terminal with `--verbose`);
progress comes from `metrics.jsonl`: a live bar on a terminal, one line per step otherwise. SIGINT/SIGTERM are forwarded to the
whole torchrun process group. The exit code is torchrun's, except that a crash at interpreter exit
after rank 0 wrote `DONE` (a known vLLM sleep-mode problem) does not fail a finished, saved run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.console import Console

from colocate_rl.errors import UserError
from colocate_rl.plan import LaunchPlan
from colocate_rl.worker import DONE_FILE, METRICS_FILE

LOG_FILE = "train.log"


def default_run_dir(name: str, now: datetime) -> Path:
    return Path("runs") / f"{name}-{now:%Y%m%d-%H%M%S}"


def check_run_dir_free(run_dir: Path) -> None:
    """Fail if `run_dir` exists and is not empty (results of two runs must never mix)."""
    if run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
        raise UserError(f"output.run_dir: '{run_dir}' already exists and is not empty; "
                        "pass another --run-dir or remove it")


def write_run_dir(plan: LaunchPlan) -> None:
    """Create the run directory and write the plan's files into it."""
    check_run_dir_free(plan.run_dir)
    plan.run_dir.mkdir(parents=True, exist_ok=True)
    for name, content in plan.files.items():
        path = plan.run_dir / name
        path.write_text(content)
        if name.endswith(".sh"):
            path.chmod(0o755)


def build_builtin_model(plan: LaunchPlan) -> None:
    """Generate the offline built-in model once, before any rank starts."""
    if plan.builtin_model:
        from transformers.utils import logging as hf_logging

        from colocate_rl.builtin_model import build_model

        hf_logging.disable_progress_bar()
        build_model(**plan.builtin_model)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The records of `metrics.jsonl` (a partially written last line is skipped)."""
    path = run_dir / METRICS_FILE
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return records


def summarize(run_dir: Path) -> dict[str, Any]:
    """Steps, reward first → last and training wall time from `metrics.jsonl`."""
    records = [r for r in read_metrics(run_dir) if "reward" in r]
    if not records:
        return {"steps": 0}
    return {
        "steps": records[-1]["step"],
        "reward_first": records[0]["reward"],
        "reward_last": records[-1]["reward"],
        "train_s": records[-1]["wall_s"],
    }


def _step_line(record: dict[str, Any]) -> str:
    parts = [f"step {record['step']}/{record.get('max_steps', '?')}"]
    for key in ("reward", "loss"):
        if isinstance(record.get(key), (int, float)):
            parts.append(f"{key} {record[key]:.4f}")
    parts.append(f"{record['wall_s']:.1f}s")
    return "  ".join(parts)


class _Supervisor:
    """Runs argv in its own process group, copies its output to the log, forwards signals."""

    def __init__(self, plan: LaunchPlan, echo: bool, console: Console):
        self.plan, self.echo, self.console = plan, echo, console
        self.proc: subprocess.Popen | None = None

    def _pump(self, log_path: Path) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        with log_path.open("ab") as log:
            for line in iter(self.proc.stdout.readline, b""):
                log.write(line)
                log.flush()
                if self.echo:
                    self.console.out(line.decode(errors="replace").rstrip("\n"), highlight=False)

    def _forward(self, signum, _frame) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signum)

    def run(self, on_tick) -> int:
        env = {**os.environ, **self.plan.env}
        self.proc = subprocess.Popen(self.plan.argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        pump = threading.Thread(target=self._pump, args=(self.plan.run_dir / LOG_FILE,), daemon=True)
        pump.start()
        previous = {s: signal.signal(s, self._forward) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            while self.proc.poll() is None:
                on_tick()
                time.sleep(0.5)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        pump.join(timeout=10)
        on_tick()
        return self.proc.returncode


def execute(plan: LaunchPlan, console: Console, verbose: bool = False) -> int:
    """Write the run dir, build the model, run torchrun; return the exit code for the CLI."""
    write_run_dir(plan)
    console.print(f"run dir: [bold]{plan.run_dir}[/]  (log: {plan.run_dir / LOG_FILE})")
    if plan.builtin_model:
        console.print(f"building built-in model {plan.builtin_model['layout']} ...")
        build_builtin_model(plan)
    interactive = console.is_terminal and not verbose
    seen = 0
    progress = None
    if interactive:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        progress = Progress(TextColumn("training"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                            TextColumn("{task.fields[status]}"), console=console)
        task = progress.add_task("train", total=None, status="starting ranks ...")
        progress.start()

    def on_tick() -> None:
        nonlocal seen
        records = read_metrics(plan.run_dir)
        for record in records[seen:]:
            if "reward" not in record:
                continue
            if progress is not None:
                status = f"reward {record['reward']:.3f}" + (
                    f"  loss {record['loss']:.4f}" if isinstance(record.get("loss"), float) else "")
                progress.update(task, completed=record["step"], total=record.get("max_steps"), status=status)
            else:
                console.out(_step_line(record), highlight=False)
        seen = len(records)

    try:
        code = _Supervisor(plan, echo=verbose, console=console).run(on_tick)
    finally:
        if progress is not None:
            progress.stop()
    done = (plan.run_dir / DONE_FILE).exists()
    if code != 0 and done:
        console.print(f"[yellow]warning:[/] torchrun exited {code} after the run finished and saved its model "
                      "(a crash at interpreter exit, known with vLLM sleep mode); the run counts as successful")
        code = 0
    if code != 0:
        from colocate_rl.diagnose import diagnose
        from colocate_rl.recipe import load_recipe

        log_path = plan.run_dir / LOG_FILE
        log = log_path.read_text(errors="replace") if log_path.exists() else ""
        if not verbose:
            console.print("\n".join(log.splitlines()[-40:]), markup=False, highlight=False)
        console.print(f"[red]error:[/] training failed (torchrun exit {code}); full log: {log_path}")
        for line in diagnose(log, load_recipe(plan.run_dir / "recipe.yaml")):
            console.print(f"[yellow]hint:[/] {line}", highlight=False)
    return code
