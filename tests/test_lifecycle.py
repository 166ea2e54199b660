"""A run's life from the launcher's side (issue 31): one owner per run directory, stop signals before and after the
ranks start, a launcher killed outright, the compile cache's stale locks, and what a crash says. The fast tests at
the top run in this process; the slow ones start the CLI, stand-in ranks or real torchrun."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import NO_GPU, ROOT, assert_user_error, clean_env, cli_here

from colocate_rl.errors import UserError
from colocate_rl.launch import owner
from colocate_rl.launch.compile_cache import STALE_AFTER_S, CompileWatch
from colocate_rl.launch.failures import rank_failure
from colocate_rl.launch.supervise import Stopped, end_tree, stop_signals_raise
from colocate_rl.plan.launch_plan import extensions_dir, launch_script
from colocate_rl.rundir import CHECKPOINT_COMPLETE, OWNER_LOCK, check_run_dir_free

HANG_GUARD_S = 300  # not a speed check: only ends a hung test


# ---------------------------------------------------------------------------------------------- fast


def test_a_run_dir_has_one_owner_and_a_dead_holders_lock_is_taken_over(tmp_path):
    run = tmp_path / "run"
    lock = owner.take(run, command="colocate-rl train first")
    assert (run / OWNER_LOCK).is_file()
    with pytest.raises(UserError) as refused:
        owner.take(run, create=False)
    assert f"is in use by process {os.getpid()} (colocate-rl train first, since " in str(refused.value)
    lock.release()
    check_run_dir_free(run)  # the lock file alone does not make the directory taken
    # what a process killed with SIGKILL leaves: the file naming it, no lock (the kernel dropped it)
    (run / OWNER_LOCK).write_text(json.dumps({"pid": 999_999_999, "command": "dead"}) + "\n")
    again = owner.take(run, create=False)
    assert json.loads((run / OWNER_LOCK).read_text())["pid"] == os.getpid()
    again.release()
    assert owner.take(tmp_path / "missing", create=False) is None and not (tmp_path / "missing").exists()


def test_a_second_train_on_a_live_run_is_refused_at_once_naming_the_holder(tmp_path):
    run = tmp_path / "run"
    lock = owner.take(run, command="colocate-rl train quickstart")
    try:
        held = f"in use by process {os.getpid()} (colocate-rl train quickstart"
        assert_user_error(cli_here("train", "--resume", run), held, one_line=True)
        assert_user_error(cli_here("train", "quickstart", "--run-dir", run), held, one_line=True)
    finally:
        lock.release()
    assert sorted(p.name for p in run.iterdir()) == [OWNER_LOCK]  # neither wrote anything


def test_discard_removes_only_what_a_new_run_wrote(tmp_path):
    run = tmp_path / "new" / "run"
    lock = owner.take(run)
    lock.claim()
    (run / "recipe.yaml").write_text("x")
    lock.discard()
    assert not (tmp_path / "new").exists()  # the directories it created, too

    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "metrics.jsonl").write_text("{}\n")
    lock = owner.take(taken)
    with pytest.raises(UserError, match="already exists and is not empty"):
        lock.claim()
    assert sorted(p.name for p in taken.iterdir()) == ["metrics.jsonl"]  # another run's file is left alone


def test_a_stop_signal_before_the_ranks_start_raises_and_an_ignored_one_stays_ignored():
    before = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup
    try:
        with pytest.raises(Stopped) as stopped, stop_signals_raise():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler runs at once; never reached
        assert stopped.value.signum == signal.SIGTERM
        assert signal.getsignal(signal.SIGTERM) is before
    finally:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)


def test_a_stale_compile_lock_is_removed_but_a_live_build_is_not(tmp_path, monkeypatch):
    old = time.time() - 2 * STALE_AFTER_S
    for op in ("stale_op", "live_op"):
        (tmp_path / op).mkdir()
        (tmp_path / op / "lock").write_text("")
        os.utime(tmp_path / op / "lock", (old, old))
    monkeypatch.chdir(tmp_path / "live_op")  # a process building there, as ninja does
    watch = CompileWatch(tmp_path)
    assert watch.look() == []  # one look is not enough to call a lock stale
    lines = watch.look()
    assert not (tmp_path / "stale_op" / "lock").exists() and (tmp_path / "live_op" / "lock").exists()
    assert any(line.startswith(f"removed {tmp_path / 'stale_op' / 'lock'}: a stopped compile") for line in lines)
    assert any(line.startswith("compiling the DeepSpeed op live_op") for line in lines)
    (tmp_path / "live_op" / "lock").unlink()  # the build ended
    assert [line for line in watch.look() if line.startswith("compiled live_op in ")]


def test_the_compile_cache_is_one_per_python_environment():
    cache = Path("/cache/colocate-rl")
    a, b = extensions_dir(cache, "/a/.venv/bin/python"), extensions_dir(cache, "/b/.venv/bin/python")
    assert a != b and a.parent == b.parent == cache / "torch_extensions"
    assert extensions_dir(cache, "/a/.venv/bin/python3") == a


TORCHRUN_FAILED = """\
[rank0]:[W1202 11:06:44.633604515 reducer.cpp:1529] Warning: find_unused_parameters=True was specified
[rank1]: Traceback (most recent call last):
[rank1]:   File "/work/colocate_rl/rank/worker.py", line 274, in run
[rank1]:     trainer.train(resume_from_checkpoint=resume_from)
[rank1]: OSError: [Errno 30] Read-only file system: '/runs/x/checkpoints'
[rank0]: Traceback (most recent call last):
[rank0]:   File "/work/colocate_rl/rank/worker.py", line 274, in run
[rank0]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer
Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/torch/distributed/run.py", line 1032, in <module>
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
colocate_rl.worker FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-02_11:06:46
  host      : localhost
  rank      : {rank} (local_rank: {rank})
  exitcode  : {code} (pid: 10756)
  error_file: <N/A>
  traceback : {traceback}
============================================================
"""


def test_the_failed_ranks_own_error_is_found_in_torchruns_log():
    failed = TORCHRUN_FAILED.format(rank=1, code=1, traceback="To enable traceback see: https://pytorch.org")
    assert rank_failure(failed) == "rank 1: OSError: [Errno 30] Read-only file system: '/runs/x/checkpoints'"
    killed = TORCHRUN_FAILED.format(rank=0, code=-9, traceback="Signal 9 (SIGKILL) received by PID 10756")
    assert rank_failure(killed) == "rank 0 was killed by SIGKILL"
    assert rank_failure("no torchrun summary here") is None


# ---------------------------------------------------------------------------------------------- stand-ins


LAUNCHER = """
import sys
from pathlib import Path
from rich.console import Console
from colocate_rl.cli.progress import run_with_progress
from colocate_rl.plan.launch_plan import LaunchPlan
run, rank = Path(sys.argv[1]), sys.argv[2]
plan = LaunchPlan(run_dir=run, argv=[sys.executable, rank, str(run)], env={}, files={})
sys.exit(run_with_progress(plan, Console(width=300)))
"""
LOADING_RANK = """
import pathlib, sys, time
(pathlib.Path(sys.argv[1]) / "ready").write_text("1")
time.sleep(120)  # still loading: no step ends, so no timeline
"""


@pytest.mark.slow
def test_a_stop_before_the_first_step_ends_the_job_at_once_and_nohups_sighup_stays_ignored(tmp_path):
    run = tmp_path / "run"
    (tmp_path / "launcher.py").write_text(LAUNCHER)
    (tmp_path / "rank.py").write_text(LOADING_RANK)
    proc = subprocess.Popen(
        [sys.executable, str(tmp_path / "launcher.py"), str(run), str(tmp_path / "rank.py")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN),  # nohup
    )
    guard = time.monotonic() + HANG_GUARD_S
    while not (run / "ready").exists():
        assert proc.poll() is None and time.monotonic() < guard, proc.stdout.read()
        time.sleep(0.05)
    proc.send_signal(signal.SIGHUP)  # a logout
    time.sleep(1)
    assert proc.poll() is None and not (run / "STOP").exists()  # ignored, as nohup asked
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=20)  # the rank would sleep 2 minutes: the job was ended, not asked
    assert proc.returncode == 143, out
    assert "stopped (SIGTERM) before the first step; no checkpoint was saved" in out


CRASHED_TORCHRUN = """
import pathlib, sys
run = pathlib.Path(sys.argv[1])
(run / "checkpoints" / "checkpoint-4").mkdir(parents=True)
(run / "checkpoints" / "checkpoint-4" / "{complete}").write_text("{{}}")
print({log!r})
sys.exit(1)
"""


@pytest.mark.slow
def test_a_crash_names_the_ranks_own_error_and_the_resume_command(tmp_path):
    from rich.console import Console

    from colocate_rl.cli.progress import run_with_progress
    from colocate_rl.plan.launch_plan import LaunchPlan

    run = tmp_path / "run"
    log = TORCHRUN_FAILED.format(rank=1, code=-9, traceback="Signal 9 (SIGKILL) received by PID 10756")
    code = CRASHED_TORCHRUN.format(complete=CHECKPOINT_COMPLETE, log=log)
    plan = LaunchPlan(run_dir=run, argv=[sys.executable, "-c", code, str(run)], env={}, files={})
    console = Console(record=True, width=300)
    assert run_with_progress(plan, console) == 1
    out = console.export_text()
    assert "error: rank 1 was killed by SIGKILL" in out
    assert f"the last complete checkpoint is {run / 'checkpoints' / 'checkpoint-4'}; resume with: " in out
    assert f"colocate-rl train --resume {run}" in out
    assert "ChildFailedError" not in out  # torchrun's traceback is left in train.log


@pytest.mark.slow
def test_launch_sh_of_a_live_run_is_refused_and_its_torchrun_holds_the_lock(tmp_path):
    run = tmp_path / "run"
    try_take = (
        "import sys; from colocate_rl.launch import owner; from colocate_rl.errors import UserError\n"
        "try:\n    owner.take(sys.argv[1])\nexcept UserError as e:\n    print('held', e)"
    )
    script = launch_script([sys.executable, "-c", try_take, str(run)], {}, ROOT, run, None)
    lock = owner.take(run, command="colocate-rl train quickstart")
    (run / "launch.sh").write_text(script)
    env = clean_env(PYTHONPATH=str(ROOT))
    refused = subprocess.run(["bash", str(run / "launch.sh")], capture_output=True, text=True, env=env, timeout=60)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert f"in use by process {os.getpid()} (colocate-rl train quickstart" in refused.stderr
    lock.release()
    ran = subprocess.run(["bash", str(run / "launch.sh")], capture_output=True, text=True, env=env, timeout=60)
    assert ran.returncode == 0 and "held output.run_dir" in ran.stdout, ran.stdout + ran.stderr  # exec kept it


# ---------------------------------------------------------------------------------------------- the CLI, torchrun


def _default_stop_signals() -> None:
    """As from a terminal: pytest itself may run under `nohup` (SIGHUP ignored, which the launcher keeps ignoring)."""
    for signum in (signal.SIGHUP, signal.SIGINT):
        signal.signal(signum, signal.SIG_DFL)


def start(*args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "colocate_rl", "train", *args],
        cwd=ROOT,
        env=clean_env(**NO_GPU, **(env or {})),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=_default_stop_signals,
    )


def _runs_module(cmd: list[str], module: str) -> bool:
    return cmd[1:3] == ["-m", module] or cmd[1:4] == ["-u", "-m", module]


def wait_for_child(proc: subprocess.Popen, marker: str, count: int = 1) -> list[psutil.Process]:
    """The launcher's descendants once `count` of them run `python -m <marker>` (torchrun's own command line, which
    names the worker module after its flags, does not count)."""
    guard = time.monotonic() + HANG_GUARD_S
    while True:
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < guard, f"no {marker} process started"
        tree = psutil.Process(proc.pid).children(recursive=True)
        try:
            if sum(_runs_module(p.cmdline(), marker) for p in tree) >= count:
                return tree
        except psutil.NoSuchProcess:
            pass
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_while_the_builtin_model_is_built_leaves_nothing_behind(tmp_path, signum):
    run = tmp_path / "run"
    proc = start("quickstart", "--run-dir", str(run), env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    tree = wait_for_child(proc, "colocate_rl.builtin_model")
    proc.send_signal(signum)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 143, out
    assert f"stopped ({signal.Signals(signum).name}) before training started; nothing was kept" in out
    assert "Traceback" not in out and not run.exists()
    _, alive = psutil.wait_procs(tree, timeout=10)
    assert alive == []  # the build was ended with it


SUPERVISOR = """
import os, sys
from pathlib import Path
from colocate_rl.launch.supervise import run_supervised
run_supervised(sys.argv[2:], dict(os.environ), Path(sys.argv[1]))
"""
SILENT_RANK = """
import os, pathlib, sys, time
(pathlib.Path(sys.argv[1]) / f"ready{os.environ['RANK']}").write_text("1")
time.sleep(120)  # as a rank waiting for a lock: no output, so no broken pipe would end it
"""


@pytest.mark.slow
def test_a_rank_leaves_before_the_interpreters_teardown_after_every_atexit_handler():
    """A finished rank ends after the atexit handlers (report_to backends register theirs during the run) and before
    exit()'s C destructors, where torch's and DeepSpeed's abort now and then on a loaded CPU ("terminate called
    without an active exception": exit code 1 after every step, seen in a mem-probe trial). A C handler that aborts
    stands in for those destructors; the usage error (exit code 2) is the quickest way through the entry point."""
    code = """if True:
        import atexit, ctypes, runpy, sys
        libc = ctypes.CDLL(None)
        libc.__cxa_atexit(ctypes.cast(libc.abort, ctypes.c_void_p), None, None)
        sys.argv = ["colocate_rl.worker"]
        try:
            runpy.run_module("colocate_rl.worker", run_name="__main__", alter_sys=True)
        except SystemExit:
            atexit.register(print, "a library's handler ran")
            raise
    """
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stdout == "a library's handler ran\n" and result.stderr.startswith("usage: python -m colocate_rl")


@pytest.mark.slow
def test_a_killed_launcher_takes_torchrun_and_its_ranks_with_it(tmp_path):
    (tmp_path / "supervisor.py").write_text(SUPERVISOR)
    (tmp_path / "rank.py").write_text(SILENT_RANK)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone"]
    proc = subprocess.Popen(
        [sys.executable, str(tmp_path / "supervisor.py"), str(tmp_path / "log"), *torchrun, str(tmp_path / "rank.py")]
        + [str(tmp_path)],
        env=clean_env(PYTHONPATH=str(ROOT)),
    )
    guard = time.monotonic() + HANG_GUARD_S
    while not all((tmp_path / f"ready{rank}").exists() for rank in (0, 1)):
        assert proc.poll() is None and time.monotonic() < guard, (tmp_path / "log").read_text()
        time.sleep(0.1)
    tree = psutil.Process(proc.pid).children(recursive=True)  # torchrun, its ranks
    proc.kill()
    proc.wait()
    try:
        _, alive = psutil.wait_procs(tree, timeout=45)
        assert alive == [], f"left running after the launcher was killed: {[p.cmdline()[1:4] for p in alive]}"
    finally:
        for p in tree:
            if p.is_running():
                p.kill()


# That the CPU quickstart compiles no DeepSpeed op is checked on its full run, in
# tests/test_e2e.py::test_quickstart_zero3_two_ranks_learns (one torchrun start fewer).


def test_ending_a_tree_whose_child_is_stopped_does_not_wait_for_the_grace_period(tmp_path):
    """A stopped (SIGSTOP) process acts on SIGTERM only once it runs again: end_tree continues it, so the watchdog's
    end of a job with a stopped rank takes no grace period and no SIGKILL."""
    script = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
    proc = subprocess.Popen([sys.executable, "-c", script + "time.sleep(60)"], start_new_session=True)
    guard = time.monotonic() + 30
    while not psutil.Process(proc.pid).children():
        assert time.monotonic() < guard
        time.sleep(0.05)
    [child] = psutil.Process(proc.pid).children()
    for p in (psutil.Process(proc.pid), child):
        p.suspend()
    seen = {(child.pid, child.create_time()): child}
    begin = time.monotonic()
    end_tree(proc, seen, grace_s=30)
    assert time.monotonic() - begin < 10
    assert proc.returncode == -signal.SIGTERM  # ended by SIGTERM, not by the SIGKILL after the grace period
    assert not child.is_running()
