"""Execute a launch plan: create the run directory, build a built-in model, run torchrun supervised.

torchrun's combined output goes to `<run_dir>/train.log` (and to the terminal with `--verbose`);
progress comes from `metrics.jsonl`: a live bar on a terminal, one line per step otherwise. SIGINT/SIGTERM are forwarded to the
whole torchrun process group. The exit code is torchrun's, except that a crash at interpreter exit
after rank 0 wrote `DONE` (a known vLLM sleep-mode problem) does not fail a finished, saved run.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.console import Console

from colocate_rl.errors import UserError
from colocate_rl.plan.launch_plan import LaunchPlan
from colocate_rl.rank.worker import DONE_FILE, METRICS_FILE

LOG_FILE = "train.log"


def default_run_dir(name: str, now: datetime, rdzv_id: str | None = None) -> Path:
    """runs/<name>-<date>-<time>; on several nodes runs/<name>-<rdzv_id>, the same on every node (the nodes
    start at different seconds), e.g. the Slurm job id."""
    if rdzv_id is not None:
        return Path("runs") / f"{name}-{re.sub(r'[^A-Za-z0-9._-]', '_', rdzv_id)}"
    return Path("runs") / f"{name}-{now:%Y%m%d-%H%M%S}"


# What other nodes of the same multi-node run may already have put into a shared run directory.
SHARED_BEFORE_START = {"recipe.yaml", "launch.json", "deepspeed.json", "model", "nodes"}


def log_path(plan: LaunchPlan) -> Path:
    """This node's log: `<run_dir>/train.log`, or `<run_dir>/nodes/<node_rank>/train.log` on several nodes."""
    return plan.run_dir / (plan.node_dir or "") / LOG_FILE


def check_run_dir_free(run_dir: Path, node_dir: str | None = None) -> None:
    """Fail if `run_dir` holds another run (results of two runs must never mix).

    One node (`node_dir` None): the directory must be missing or empty. Several nodes sharing one directory:
    the other nodes' files of this run are expected, so it fails only when this node's own `node_dir` exists,
    the run finished (`DONE`), or it holds anything a starting run does not write (a log, metrics, a model)."""
    if not run_dir.exists():
        return
    fix = "pass another --run-dir (the same on every node, or a local one each) or remove it"
    if not run_dir.is_dir():
        raise UserError(f"output.run_dir: '{run_dir}' exists and is not a directory; {fix}")
    entries = sorted(p.name for p in run_dir.iterdir())
    if node_dir is None:
        if entries:
            raise UserError(
                f"output.run_dir: '{run_dir}' already exists and is not empty; pass another --run-dir or remove it"
            )
        return
    if DONE_FILE in entries:
        raise UserError(f"output.run_dir: '{run_dir}' holds a finished run ({DONE_FILE}); {fix}")
    if (run_dir / node_dir).exists():
        raise UserError(
            f"output.run_dir: '{run_dir}' already has {node_dir}/ (this node rank already started "
            f"a run there); {fix}, and give each node its own --node-rank"
        )
    foreign = [name for name in entries if name not in SHARED_BEFORE_START and not name.startswith(".")]
    if foreign:
        raise UserError(f"output.run_dir: '{run_dir}' holds another run ({', '.join(foreign[:3])}); {fix}")


def _write_shared(path: Path, content: str) -> bool:
    """Write a file all nodes write with the same bytes: the first writer wins, nothing is overwritten or seen
    half-written. Returns whether the file now holds `content` (False: another node wrote something else)."""
    if not path.exists():
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(content)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        except OSError:  # a filesystem without hard links
            if not path.exists():
                os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return path.read_text() == content


def write_run_dir(plan: LaunchPlan) -> list[str]:
    """Create the run directory and write the plan's files into it. Several nodes: this node's files go to its
    `node_dir`, created exclusively; the shared ones are written unless present. Returns the shared files that
    another node wrote differently (the ranks' recipe check then stops the run)."""
    check_run_dir_free(plan.run_dir, plan.node_dir)
    plan.run_dir.mkdir(parents=True, exist_ok=True)
    differ = []
    if plan.node_dir is not None:
        try:
            (plan.run_dir / plan.node_dir).mkdir(parents=True)
        except FileExistsError:
            raise UserError(
                f"output.run_dir: '{plan.run_dir}' already has {plan.node_dir}/ (another node started "
                "with the same node rank?); give each node its own --node-rank"
            )
    for name, content in plan.files.items():
        path = plan.run_dir / name
        if plan.node_dir is not None and not name.startswith(plan.node_dir + "/"):
            if not _write_shared(path, content):
                differ.append(name)
            continue
        path.write_text(content)
        if name.endswith(".sh"):
            path.chmod(0o755)
    return differ


def build_builtin_model(plan: LaunchPlan) -> None:
    """Generate the offline built-in model once, before any rank starts, in a child process: this process
    supervises the whole run and must not hold GPU memory (measured: 4.1 GiB of GPU 0 for the 1.5B layout)."""
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


def worker_errors(log: str) -> list[str]:
    """The `error: ...` lines ranks printed (a UserError in the worker, e.g. a recipe mismatch between nodes),
    each once, in order."""
    found = re.findall(r"^(?:\[[^\]\n]*\]:?\s*)?error: (.+)$", log, flags=re.MULTILINE)
    return list(dict.fromkeys(line.strip() for line in found))


SHORT_PHASES = {
    "generate": "gen",
    "weight_sync": "sync",
    "weight_check": "check",
    "wake": "wake",
    "sleep": "sleep",
    "offload": "offload",
    "reload": "reload",
    "reward": "reward",
    "prepare": "prep",
    "train": "train",
    "optimizer": "opt",
}


def phase_summary(record: dict[str, Any]) -> str:
    """`gen 0.61s sync 0.10s train 0.30s opt 0.05s | GPU 14.5 GiB (peak 41.5)` from one metrics record."""
    phases = [
        f"{short} {record[f'time/{name}_s']:.2f}s"
        for name, short in SHORT_PHASES.items()
        if record.get(f"time/{name}_s", 0) >= 0.005
    ]
    text = " ".join(phases)
    if "mem/gpu_used_gib" in record:
        text += f" | GPU {record['mem/gpu_used_gib']:.1f} GiB (peak {record.get('mem/gpu_peak_gib', 0):.1f})"
    elif "mem/rss_gib" in record:
        text += f" | RSS {record['mem/rss_gib']:.2f} GiB"
    return text


def _step_line(record: dict[str, Any]) -> str:
    parts = [f"step {record['step']}/{record.get('max_steps', '?')}"]
    for key in ("reward", "loss"):
        if isinstance(record.get(key), (int, float)):
            parts.append(f"{key} {record[key]:.4f}")
    parts.append(f"{record['wall_s']:.1f}s")
    breakdown = phase_summary(record)
    return "  ".join(parts) + (f"  [{breakdown}]" if breakdown else "")


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
        self.proc = subprocess.Popen(
            self.plan.argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
        pump = threading.Thread(target=self._pump, args=(log_path(self.plan),), daemon=True)
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
    differ = write_run_dir(plan)
    console.print(f"run dir: [bold]{plan.run_dir}[/]  (log: {log_path(plan)})")
    if differ:
        console.print(
            f"[yellow]warning:[/] {', '.join(differ)} in the run dir were written by another node from a "
            "different recipe; the ranks compare recipes at start and stop if the nodes differ",
            highlight=False,
        )
    if plan.builtin_model:
        console.print(f"building built-in model {plan.builtin_model['layout']} ...")
        build_builtin_model(plan)
    interactive = console.is_terminal and not verbose
    seen = 0
    progress = None
    if interactive:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        progress = Progress(
            TextColumn("training"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[status]}"),
            console=console,
        )
        task = progress.add_task("train", total=None, status="starting ranks ...")
        progress.start()

    def on_tick() -> None:
        nonlocal seen
        records = read_metrics(plan.run_dir)
        for record in records[seen:]:
            if "reward" not in record:
                continue
            if progress is not None:
                status = f"reward {record['reward']:.3f}  {phase_summary(record)}"
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
        console.print(
            f"[yellow]warning:[/] torchrun exited {code} after the run finished and saved its model "
            "(a crash at interpreter exit, known with vLLM sleep mode); the run counts as successful"
        )
        code = 0
    if code != 0:
        from colocate_rl.launch.failures import diagnose
        from colocate_rl.recipe.schema import load_recipe

        log_file = log_path(plan)
        log = log_file.read_text(errors="replace") if log_file.exists() else ""
        if not verbose:
            console.print("\n".join(log.splitlines()[-40:]), markup=False, highlight=False)
        console.print(f"[red]error:[/] training failed (torchrun exit {code}); full log: {log_file}")
        for line in worker_errors(log):
            console.print(f"[red]error:[/] {line}", highlight=False, soft_wrap=True)
        recipe_file = plan.run_dir / "recipe.yaml"
        for line in diagnose(log, load_recipe(recipe_file)) if recipe_file.exists() else []:
            console.print(f"[yellow]hint:[/] {line}", highlight=False)
    return code
