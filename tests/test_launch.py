"""Executing a plan with real subprocesses standing in for torchrun: exit codes, the DONE rule, signals, files,
the run's errors and hints, and how `train` renders them."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from colocate_rl.cli.progress import run_with_progress, step_line
from colocate_rl.launch.execute import prepare, run
from colocate_rl.plan.launch_plan import LaunchPlan
from colocate_rl.recipe.load import dump_recipe, parse_recipe
from colocate_rl.rundir import LOG, summarize

pytestmark = pytest.mark.slow  # every test starts a process standing in for torchrun
RECIPE = dump_recipe(parse_recipe({"rewards": [{"name": "digit_share"}]}))


def plan_running(tmp_path: Path, code: str) -> LaunchPlan:
    """A plan whose 'torchrun' is a small Python program (stands in for the ranks)."""
    return LaunchPlan(
        run_dir=tmp_path / "run",
        argv=[sys.executable, "-c", code],
        env={"RUN_MARK": "x"},
        files={"recipe.yaml": RECIPE, "launch.sh": "#!/bin/sh\n"},
    )


def test_exit_code_is_propagated_and_files_written(tmp_path):
    plan = plan_running(tmp_path, "import os, sys; print('rank says', os.environ['RUN_MARK']); sys.exit(3)")
    console = Console(record=True, width=200)
    assert run_with_progress(plan, console) == 3
    assert (plan.run_dir / "recipe.yaml").read_text() == RECIPE
    assert (plan.run_dir / "launch.sh").stat().st_mode & 0o100
    assert "rank says x" in (plan.run_dir / LOG).read_text()
    assert "training failed (exit code 3)" in console.export_text()


def test_errors_the_ranks_reported_and_hints_for_known_failures(tmp_path):
    code = (
        "import json, pathlib, sys; run = pathlib.Path(sys.argv[1]); "
        "(run / 'events.jsonl').write_text(json.dumps({'kind': 'user_error', 'rank': 0, 'lines': ['nodes differ']})"
        " + '\\n'); print('torch.OutOfMemoryError: CUDA out of memory. Tried to allocate'); sys.exit(1)"
    )
    plan = plan_running(tmp_path, code)
    plan = LaunchPlan(plan.run_dir, [*plan.argv, str(plan.run_dir)], plan.env, plan.files)
    prepare(plan)
    result = run(plan)
    assert result.code == 2 and result.torchrun_code == 1 and not result.crashed_after_done
    assert result.errors == ["nodes differ"]
    assert len(result.hints) == 1 and result.hints[0].startswith("a rank ran out of GPU memory")
    assert "CUDA out of memory" in result.log_tail()


def test_crash_at_exit_after_done_counts_as_success(tmp_path):
    """vLLM can crash at interpreter exit after sleep mode; a run that wrote DONE still succeeds."""
    run_dir = tmp_path / "run"
    code = f"import pathlib, os; pathlib.Path({str(run_dir)!r}, 'DONE').write_text('{{}}'); os.abort()"
    console = Console(record=True, width=200)
    assert run_with_progress(plan_running(tmp_path, code), console) == 0
    assert "the run counts as successful" in console.export_text()


def test_metrics_drive_step_lines_and_summary(tmp_path):
    run_dir = tmp_path / "run"
    records = [
        {"step": i, "max_steps": 3, "wall_s": i * 0.5, "reward": r, "loss": 0.1}
        for i, r in [(1, 0.1), (2, 0.2), (3, 0.4)]
    ]
    (tmp_path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    code = f"import shutil; shutil.copy({str(tmp_path / 'records.jsonl')!r}, {str(run_dir / 'metrics.jsonl')!r})"
    console = Console(record=True, width=200)
    assert run_with_progress(plan_running(tmp_path, code), console) == 0
    assert "step 3/3  reward 0.4000  loss 0.1000" in console.export_text()
    assert step_line({"step": 2, "wall_s": 1.0, "time/generate_s": 0.5}) == "step 2/?  1.0 s in all  [gen 0.50s]"
    timed = {"step": 2, "max_steps": 9, "wall_s": 1.0, "reward": 0.5, "time/step_s": 0.25}
    assert step_line(timed) == "step 2/9  reward 0.5000  0.25 s/step  1.0 s in all"
    assert summarize(run_dir) == {"steps": 3, "reward_first": 0.1, "reward_last": 0.4, "train_s": 1.5}


RANK = """
import pathlib, signal, sys, time
run = pathlib.Path(sys.argv[1])
def on_term(*_):
    (run / "got-term").write_text("1")
    sys.exit(7)
signal.signal(signal.SIGTERM, on_term)
(run / "timeline").mkdir()
(run / "timeline" / "rank0.jsonl").write_text('{"step": 1}\\n')  # a step ended: a stop now waits for the next
(run / "ready").write_text("1")
time.sleep(60)
"""

LAUNCHER = """
import sys
from pathlib import Path
from rich.console import Console
from colocate_rl.cli.progress import run_with_progress
from colocate_rl.plan.launch_plan import LaunchPlan
run, rank = Path(sys.argv[1]), sys.argv[2]
plan = LaunchPlan(run_dir=run, argv=[sys.executable, rank, str(run)], env={}, files={})
sys.exit(run_with_progress(plan, Console()))
"""


def test_a_stop_signal_asks_the_ranks_first_and_a_second_one_ends_them(tmp_path):
    """Slurm's scancel (or its pre-timeout signal) sends SIGTERM to the launcher: the first one writes the run dir's
    STOP request for the ranks (they save a checkpoint at the next step end and stop; this stand-in rank ignores
    it), a second one sends SIGTERM to the whole torchrun group; `train` exits 143."""
    run_dir = tmp_path / "run"
    (tmp_path / "rank.py").write_text(RANK)
    (tmp_path / "launcher.py").write_text(LAUNCHER)
    proc = subprocess.Popen([sys.executable, str(tmp_path / "launcher.py"), str(run_dir), str(tmp_path / "rank.py")])
    hang_guard = time.monotonic() + 300  # not a speed check: only ends a hung test
    while not (run_dir / "ready").exists():  # the rank's handler is installed
        assert proc.poll() is None and time.monotonic() < hang_guard, "the rank never got ready"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    while not (run_dir / "STOP").exists():
        assert proc.poll() is None and time.monotonic() < hang_guard, "no stop request was written"
        time.sleep(0.05)
    assert (run_dir / "STOP").read_text() == "SIGTERM\n" and not (run_dir / "got-term").exists()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143
    assert (run_dir / "got-term").exists()
