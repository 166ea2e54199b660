"""Long runs that survive (issue 17) on CPU, through real torchrun: a stop signal saves a checkpoint and
`train --resume` continues to the end with every step recorded once; killing torchrun leaves no rank behind; the
watchdog names a stopped rank; a log that cannot be written stops the job in one line; a NaN reward stops the run.
The fast tests at the top use stand-in processes instead of torchrun."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml
from conftest import HANG_GUARD_S, NO_GPU, ROOT, assert_user_error, clean_env, cli, cli_here, start, wait_for_steps

from colocate_rl.launch.execute import RunResult, exit_code, run
from colocate_rl.launch.supervise import run_supervised
from colocate_rl.launch.watchdog import Watchdog
from colocate_rl.plan.launch_plan import LaunchPlan
from colocate_rl.rundir import CHECKPOINT_COMPLETE, RunDir, step_records
from colocate_rl.telemetry import events

# plain DDP: faster to start than the quickstart's ZeRO-3, where that is not what a test is about
DDP = ("--set", "distributed.deepspeed=null", "--set", "distributed.deepspeed_overrides={}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ranks_of(proc: subprocess.Popen) -> list[psutil.Process]:
    """The worker processes (colocate_rl.worker) in the launcher's process tree."""
    return [
        p
        for p in psutil.Process(proc.pid).children(recursive=True)
        if "colocate_rl.worker" in " ".join(p.cmdline()) and p.name() != "pt_elastic"  # torchrun's own helper
    ]


# ---------------------------------------------------------------------------------------------- fast


def test_step_records_keep_the_last_record_of_a_redone_step(tmp_path):
    rows = [(1, 0.1), (2, 0.2), (3, 0.3), (2, 0.25), (3, 0.35), (4, 0.4)]  # resumed from step 1's checkpoint
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "reward": r, "wall_s": s}) + "\n" for s, r in rows)
        + json.dumps({"step": 4, "train_runtime": 9.0})
        + "\n"
    )
    assert [(r["step"], r["reward"]) for r in step_records(tmp_path)] == [(1, 0.1), (2, 0.25), (3, 0.35), (4, 0.4)]


def test_exit_codes():
    assert exit_code(0, signal.SIGINT) == 130 and exit_code(0, signal.SIGTERM) == 143
    assert exit_code(1, signal.SIGHUP) == 143  # SIGHUP (an ssh session dropped) is handled like SIGTERM
    assert exit_code(-9, None) == 137 and exit_code(3, None) == 3


def test_only_complete_checkpoints_count(tmp_path):
    paths = RunDir(tmp_path)
    for step, complete in ((2, True), (10, True), (12, False)):
        (paths.checkpoints / f"checkpoint-{step}").mkdir(parents=True)
        if complete:
            (paths.checkpoints / f"checkpoint-{step}" / CHECKPOINT_COMPLETE).write_text("{}")
    assert [p.name for p in paths.complete_checkpoints()] == ["checkpoint-2", "checkpoint-10"]


@pytest.mark.slow
def test_a_log_that_cannot_be_written_stops_the_job_in_one_line(tmp_path):
    """A full disk (here /dev/full, where every write fails with ENOSPC): the output is still drained, so the child
    never blocks on the pipe, and the job is ended with one line naming the log."""
    child = "import sys, time\nfor i in range(100000):\n    print('x' * 200, flush=True)\ntime.sleep(300)\n"
    outcome = run_supervised([sys.executable, "-c", child], os.environ, Path("/dev/full"))
    assert outcome.error is not None and outcome.error.startswith("/dev/full: cannot write the run's log")
    assert "No space left on device" in outcome.error and outcome.returncode != 0


def test_the_watchdog_names_the_rank_that_stopped_progressing(tmp_path):
    now = [0.0]
    paths = RunDir(tmp_path)
    paths.timeline_dir.mkdir()
    for rank in (0, 1):
        paths.timeline(rank).write_text(json.dumps({"rank": rank, "pid": 2**22 + rank}) + "\n")
    dog = Watchdog(tmp_path, [0, 1, 2], step_timeout_s=60, start_timeout_s=600, clock=lambda: now[0])
    assert dog.check() is None
    now[0] = 59.0
    with paths.timeline(0).open("a") as f:
        f.write('{"step_end": 1}\n')
    assert dog.check() is None
    now[0] = 100.0  # rank 1 (pid gone) has not grown for 100 s; rank 0 for 41 s; rank 2 never started (600 s)
    message = dog.check()
    assert message.startswith("rank 1 is not running (exited) and ended no step for 1.7 min; stopped the job")
    assert "watchdog.step_timeout_minutes" in message
    first = Watchdog(tmp_path, [2], step_timeout_s=60, start_timeout_s=600, clock=lambda: now[0])
    now[0] += 599
    assert first.check() is None  # no timeline yet: the start allowance applies
    now[0] += 2
    assert first.check().startswith("rank 2 did not end its first step for 10.0 min")


def test_the_watchdog_names_the_engine_process_a_stuck_rank_waits_for(tmp_path, monkeypatch):
    """A rank that reported (`engine_wait`) waiting for its engine process since after its last step: the watchdog
    names it first (the other rank waits for it in a collective) with that process and its state (here a stopped
    stand-in); a wait reported before that step is not named."""
    now = [1000.0]
    paths = RunDir(tmp_path)
    paths.timeline_dir.mkdir()
    for rank in (0, 1):
        paths.timeline(rank).write_text(json.dumps({"rank": rank, "pid": os.getpid()}) + "\n" + '{"step_end": 1}\n')
    dog = Watchdog(tmp_path, [0, 1], step_timeout_s=60, start_timeout_s=600, clock=lambda: now[0])
    assert dog.check() is None  # progress noted at t = 1000 for both
    with paths.timeline(1).open("a") as f:
        f.write('{"step_end": 2}\n')
    now[0] = 1001.0
    assert dog.check() is None  # rank 1's progress at t = 1001: rank 0 is idle longer
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stand_in = psutil.Process(engine.pid)
        stand_in.suspend()
        deadline = time.monotonic() + 10
        while stand_in.status() != psutil.STATUS_STOPPED and time.monotonic() < deadline:  # SIGSTOP lands async
            time.sleep(0.01)
        monkeypatch.setenv("RANK", "1")
        events.emit(tmp_path, events.ENGINE_WAIT, pid=12345, since=990.0)  # before the last progress: not this wait
        now[0] = 1062.0
        assert dog.check().startswith("rank 0 (also rank 1) ended no step for 1.0 min; stopped the job")
        events.emit(tmp_path, events.ENGINE_WAIT, pid=engine.pid, since=1005.0)
        message = dog.check()
        assert message.startswith(
            f"rank 1 (also rank 0) ended no step for 1.0 min, waiting for an answer from its generation engine "
            f"process (pid {engine.pid}, stopped); stopped the job"
        ), message
    finally:
        engine.kill()
        engine.wait()


@pytest.mark.slow
def test_the_launcher_reports_errors_the_ranks_report(tmp_path):
    plan = LaunchPlan(run_dir=tmp_path, argv=[sys.executable, "-c", "import sys; sys.exit(5)"], env={}, files={})
    events.emit(tmp_path, events.USER_ERROR, lines=["rewards[0].name digit_share: returned nan for a completion"])
    result = run(plan)
    assert (
        isinstance(result, RunResult) and result.code == 2 and result.torchrun_code == 5
    )  # the ranks stopped on a user error
    assert result.errors == ["rewards[0].name digit_share: returned nan for a completion"]


# ---------------------------------------------------------------------------------------------- real torchrun


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_resume_reaches_max_steps(tmp_path):
    run_dir = tmp_path / "run"
    proc = start(run_dir, "quickstart", "--set", "trainer.max_steps=8")
    wait_for_steps(proc, run_dir, 2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=HANG_GUARD_S)
    assert proc.returncode == 143, out
    [stopped] = events.read_events(run_dir, events.STOPPED)
    checkpoint = RunDir(run_dir).complete_checkpoints()[-1]
    assert stopped["checkpoint"] == str(checkpoint) and checkpoint.name == f"checkpoint-{stopped['step']}"
    assert f"resume with: colocate-rl train --resume {run_dir}" in out
    assert not RunDir(run_dir).done.exists() and not RunDir(run_dir).final.exists()
    kept = step_records(run_dir)
    relaunch = subprocess.run(["bash", str(run_dir / "launch.sh")], capture_output=True, text=True, timeout=600)
    assert relaunch.returncode != 0 and "already holds trained steps" in relaunch.stdout + relaunch.stderr
    assert step_records(run_dir) == kept  # the interrupted run's launch.sh did not start it over

    resumed = cli("train", "--resume", run_dir, timeout=HANG_GUARD_S)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resuming from {checkpoint}" in resumed.stdout
    assert [r["step"] for r in step_records(run_dir)] == list(range(1, 9))  # every step once
    walls = [r["wall_s"] for r in step_records(run_dir)]
    assert walls == sorted(walls)  # the resumed steps continue the wall clock
    assert RunDir(run_dir).done.exists() and (RunDir(run_dir).final / "config.json").is_file()
    [event] = events.read_events(run_dir, events.RESUMED)
    assert event["step"] == stopped["step"]
    report = cli_here("report", run_dir, "--out", tmp_path / "report")
    assert report.returncode == 0, report.stderr
    assert_user_error(cli_here("train", "--resume", run_dir), "the run already finished")
    again = subprocess.run(["bash", str(run_dir / "launch.sh")], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert again.returncode != 0 and "the run already finished" in again.stdout + again.stderr
    assert [r["step"] for r in step_records(run_dir)] == list(range(1, 9))  # nothing was appended


@pytest.mark.slow
def test_killing_torchrun_leaves_no_rank_alive(tmp_path):
    run_dir = tmp_path / "run"
    proc = start(run_dir, "quickstart", *DDP, "--set", "trainer.max_steps=500")
    wait_for_steps(proc, run_dir, 1)
    ranks = ranks_of(proc)
    torchrun = next(p for p in psutil.Process(proc.pid).children() if "torch.distributed.run" in " ".join(p.cmdline()))
    assert len(ranks) == 2
    torchrun.kill()
    _, alive = psutil.wait_procs(ranks, timeout=5)
    assert alive == [], f"ranks still alive 5 s after torchrun was killed: {[p.pid for p in alive]}"
    out, _ = proc.communicate(timeout=HANG_GUARD_S)
    assert proc.returncode == 137, out
    assert "torchrun was killed by SIGKILL; every rank it had started was ended" in out


@pytest.mark.slow
def test_the_watchdog_stops_a_job_whose_rank_is_stopped(tmp_path):
    run_dir = tmp_path / "run"
    proc = start(
        run_dir, "quickstart", *DDP, "--set", "trainer.max_steps=500", "--set", "watchdog.step_timeout_minutes=0.1"
    )
    wait_for_steps(proc, run_dir, 2)
    ranks = ranks_of(proc)
    stopped = next(p for p in ranks if p.environ().get("RANK") == "1")
    stopped.suspend()
    try:
        out, _ = proc.communicate(timeout=HANG_GUARD_S)
    finally:
        for p in ranks:
            if p.is_running():
                p.kill()
    assert proc.returncode == 1, out
    assert "rank 1" in out and "is not running (stopped) and ended no step for" in out


@pytest.mark.slow
def test_a_nan_reward_stops_the_run(tmp_path):
    # finite when validation calls it on a sample completion (which refuses NaN), NaN on the ranks: told apart by the
    # trainer state TRL passes (validation's is a stand-in; RANK in the environment may leak from in-process tests)
    (tmp_path / "nan_reward.py").write_text(
        "def reward(completions, trainer_state=None, **kwargs):\n"
        "    on_a_rank = type(trainer_state).__name__ == 'TrainerState'\n"
        "    return [float('nan') if on_a_rank else 0.0] * len(completions)\n"
    )
    run_dir = tmp_path / "run"
    result = cli(
        "train",
        "quickstart",
        *DDP,
        "--set",
        "trainer.max_steps=3",
        "--set",
        f"rewards=[{{name: '{tmp_path / 'nan_reward.py'}:reward'}}]",
        "--run-dir",
        run_dir,
        timeout=HANG_GUARD_S,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "returned nan for a completion; a reward must be a finite number" in result.stdout
    assert not RunDir(run_dir).done.exists() and not RunDir(run_dir).final.exists()


@pytest.fixture
def small_disk(tmp_path):
    """A 200 KiB tmpfs (root only; skipped where mounting is not allowed): the run dir's files before launch take
    12 KiB, the logs of a CPU run then grow ~35 KiB/s."""
    mount = tmp_path / "small"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode(errors='replace').strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], capture_output=True)


@pytest.mark.slow
def test_a_full_disk_stops_the_job_with_one_line(small_disk):
    """The run dir fills up: the job ends (no hang) with one line naming the file that could not be written, or, when
    a rank hit the full disk first, the advice that names the run dir and the resume command."""
    run_dir = small_disk / "run"
    result = cli("train", "quickstart", *DDP, "--set", "trainer.max_steps=500", "--run-dir", run_dir,
                 timeout=HANG_GUARD_S)  # fmt: skip
    out = result.stdout + result.stderr
    assert result.returncode == 1, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    launcher = [line for line in errors if "cannot write the run's log (No space left on device)" in line]
    if launcher:  # the launcher's copy of the log hit it first: that one line, nothing else
        assert errors == launcher and launcher[0].startswith(f"error: {run_dir}/train.log:"), out[-3000:]
    else:  # a rank hit it first (metrics.jsonl, a checkpoint): the advice names the cause and the way on
        assert "hint: a disk is full (No space left on device)" in out and f"--resume {run_dir}" in out, out[-3000:]


@pytest.mark.slow
def test_two_nodes_train_stop_together_and_resume(tmp_path):
    """Two nodes on this machine through scripts/multinode.sh (one rank each, c10d on localhost, one shared run
    dir): they train into one run dir (the shared files once, each node's under nodes/<k>/, the same recipe hash);
    SIGTERM to node 1 alone stops both with the same checkpoint; resuming on both nodes reaches max_steps with every
    step once. (GPU twin: test_gpu.py::test_two_gpus_as_two_nodes_stop_together_and_resume.)"""
    run_dir = tmp_path / "run"

    def node(rank: int, port: int, *args: str) -> subprocess.Popen:
        env = clean_env(
            **NO_GPU,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            NNODES="2",
            NODE_RANK=str(rank),
            COLOCATE_RL=f"{sys.executable} -m colocate_rl",
        )
        return subprocess.Popen(
            ["bash", "scripts/multinode.sh", *args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    sets = (*DDP, "--set", "distributed.nproc_per_node=1", "--set", "trainer.max_steps=8")
    port = free_port()
    nodes = [node(k, port, "quickstart", "--run-dir", str(run_dir), *sets) for k in (0, 1)]
    wait_for_steps(nodes[0], run_dir, 2)
    nodes[1].send_signal(signal.SIGTERM)
    outs = [p.communicate(timeout=HANG_GUARD_S)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [143, 143], outs
    [stopped] = events.read_events(run_dir, events.STOPPED)
    assert RunDir(run_dir).complete_checkpoints()[-1].name == f"checkpoint-{stopped['step']}"
    assert all(f"resume with: colocate-rl train --resume {run_dir}" in out for out in outs), outs
    assert "stopped (SIGTERM) at step" in outs[1] and "by another node's stop request" in outs[0], outs
    # one run dir: the shared files once (written by global rank 0), each node's own under nodes/<k>/
    assert all(re.search(rf"node\s+{k} of 2", outs[k]) for k in (0, 1)), outs
    hashes = {re.search(r"recipe hash\s+(\w+)", out).group(1) for out in outs}
    assert hashes == {json.loads((run_dir / "launch.json").read_text())["recipe_hash"]}, outs
    for k in (0, 1):
        assert (run_dir / f"nodes/{k}/train.log").is_file() and (run_dir / f"nodes/{k}/launch.sh").is_file()
        assert len(list((run_dir / f"nodes/{k}/ranks").glob("*/attempt_0/0/stderr.log"))) == 1
        assert "[default0]:" in (run_dir / f"nodes/{k}/train.log").read_text()
    assert not (run_dir / "train.log").exists() and not (run_dir / "launch.sh").exists()
    assert "node_rank" not in yaml.safe_load((run_dir / "recipe.yaml").read_text())["distributed"]

    port = free_port()  # a new rendezvous, as a new job would use
    resumed = [node(k, port, "--resume", str(run_dir)) for k in (0, 1)]
    outs = [p.communicate(timeout=HANG_GUARD_S)[0] for p in resumed]
    assert [p.returncode for p in resumed] == [0, 0], outs
    assert [r["step"] for r in step_records(run_dir)] == list(range(1, 9))
    assert json.loads(RunDir(run_dir).done.read_text()) == {"global_step": 8, "world_size": 2}
    assert (RunDir(run_dir).final / "config.json").is_file()
    assert "step 8/8" in outs[0] and "reward first → last" in outs[0], outs[0]
