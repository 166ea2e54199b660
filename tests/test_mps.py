"""`generation.mps`: what `auto` decides, what an explicit `on` needs, and the daemon wrapper torchrun runs under
(`colocate_rl.launch.mps`). NVIDIA's nvidia-cuda-mps-control needs an NVIDIA driver, so these tests put a test double
of it first on PATH (conftest's `fake_mps`; a run through torchrun under it: test_overlap's learning test); the real
daemon ran on an H200 (docs/benchmarks, invocation O)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CPU, H200_GIB, QWEN05, QWEN7_1GPU, assert_user_error, cli_here, write_recipe
from conftest import resolved as resolved_for

from colocate_rl.plan.host import assumed_host
from colocate_rl.plan.launch_plan import make_plan
from colocate_rl.telemetry import events


def wrapped(tmp_path, env: dict[str, str], *command: str, flags: tuple[str, ...] = (), **popen) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "colocate_rl.launch.mps", *flags, str(tmp_path / "run"), str(tmp_path / "run" / "mps"),
         "--", *command], env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen,
    )  # fmt: skip


def test_the_command_runs_as_the_client_of_a_daemon_of_its_own_that_quits_after_it(tmp_path, fake_mps):
    (tmp_path / "run").mkdir()
    show = "import os, sys; print('pipe', os.environ['CUDA_MPS_PIPE_DIRECTORY']); sys.exit(3)"
    proc = wrapped(tmp_path, fake_mps, sys.executable, "-c", show)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, err  # the command's own code
    daemon = json.loads((tmp_path / "run" / "mps" / "fake.json").read_text())
    assert f"pipe {daemon['pipe']}" in out and "CUDA MPS daemon" in out and "clients' settings defaults" in out
    assert len(daemon["pipe"]) < 100  # a socket path: not under a long run directory
    assert (tmp_path / "run" / "mps" / "quit").exists() and not Path(daemon["pipe"]).exists()
    killed = wrapped(
        tmp_path, fake_mps, sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    )
    killed.communicate(timeout=60)
    assert killed.returncode == -signal.SIGKILL  # as torchrun's own status: the launcher reads how it ended


@pytest.mark.parametrize("engine", [None, ("0", "100")])
def test_an_engine_process_takes_its_own_mps_client_settings_where_they_are_set(
    tmp_path, fake_mps, monkeypatch, engine
):
    """The command (the trainers) gets the environment's CUDA_MPS_CLIENT_PRIORITY and CUDA_MPS_ACTIVE_THREAD_PERCENTAGE;
    an engine process, as it starts, takes COLOCATE_RL_ENGINE_MPS_PRIORITY's and ..._THREAD_PERCENTAGE's where set
    (benchmarks' overlap-prio-mps: trainer 1, engine 0; overlap-cap-mps: trainer 75 %, engine 100 %)."""
    from colocate_rl.launch.mps import engine_client_settings
    from colocate_rl.plan.host import ENGINE_PRIORITY, ENGINE_THREADS, PRIORITY, THREADS

    (tmp_path / "run").mkdir()
    names = (PRIORITY, THREADS, ENGINE_PRIORITY, ENGINE_THREADS)
    show = f"import os; print(*(os.environ.get(n) for n in {names!r}))"
    trainer = {PRIORITY: "1", THREADS: "75"}
    own = dict(zip((ENGINE_PRIORITY, ENGINE_THREADS), engine)) if engine else {}
    proc = wrapped(tmp_path, {**fake_mps, **trainer, **own}, sys.executable, "-c", show)
    out, err = proc.communicate(timeout=60)
    shown = out.strip().splitlines()[-1].split()
    assert proc.returncode == 0 and shown == ["1", "75", *map(str, engine or (None, None))], err
    assert f"clients' settings {PRIORITY}=1 {THREADS}=75" in out  # said in train.log
    for name, value in {**trainer, **own}.items():  # in an engine process that trainer started
        monkeypatch.setenv(name, value)
    said = engine_client_settings()
    assert (os.environ[PRIORITY], os.environ[THREADS]) == (engine or ("1", "75"))
    assert said == (f"{PRIORITY}=0 {THREADS}=100" if engine else None)  # the engine process's line, where it took any
    assert ENGINE_PRIORITY not in os.environ and ENGINE_THREADS not in os.environ


def test_two_runs_at_once_each_run_under_a_daemon_of_their_own(tmp_path, fake_mps):
    """Two runs on one machine (each GPU its own run, or two runs sharing one): each wrapper starts its own daemon
    in its own pipe directory, its command is that daemon's client only, and each quits its own."""
    show = "import os, time; print('pipe', os.environ['CUDA_MPS_PIPE_DIRECTORY'], flush=True); time.sleep(1)"
    runs = [tmp_path / name for name in ("a", "b")]
    for base in runs:
        (base / "run").mkdir(parents=True)
    procs = [wrapped(base, fake_mps, sys.executable, "-c", show) for base in runs]
    outs = [proc.communicate(timeout=60)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0]
    daemons = [json.loads((base / "run" / "mps" / "fake.json").read_text()) for base in runs]
    assert daemons[0]["pipe"] != daemons[1]["pipe"] and daemons[0]["pid"] != daemons[1]["pid"]
    assert all(f"pipe {d['pipe']}" in out for d, out in zip(daemons, outs))
    assert all((base / "run" / "mps" / "quit").exists() for base in runs)


def test_a_stop_signal_reaches_the_command_and_the_daemon_still_quits(tmp_path, fake_mps):
    (tmp_path / "run").mkdir()
    wait = (
        "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(7)); print('up', flush=True); "
        "time.sleep(60)"
    )
    proc = wrapped(tmp_path, fake_mps, sys.executable, "-c", wait)
    assert "CUDA MPS daemon" in proc.stdout.readline()  # its random pipe directory's name may hold "up": not a sign
    assert proc.stdout.readline().strip() == "up"  # the command's handler is set
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == 7 and (tmp_path / "run" / "mps" / "quit").exists()


@pytest.mark.parametrize("cause", ["fails", "missing"])
def test_a_daemon_that_does_not_start_ends_it_in_one_line_before_the_command_runs(tmp_path, fake_mps, cause):
    (tmp_path / "run").mkdir()
    marker = tmp_path / "ran"
    env = {**fake_mps, "FAKE_MPS_FAIL": "cannot open /dev/nvidia0"} if cause == "fails" else {"PATH": "/nonexistent"}
    proc = wrapped(tmp_path, env, sys.executable, "-c", f"open({str(marker)!r}, 'w')")
    _, err = proc.communicate(timeout=60)
    why = "did not start: cannot open /dev/nvidia0" if cause == "fails" else "nvidia-cuda-mps-control cannot run"
    assert proc.returncode == 2 and len(err.strip().splitlines()) == 1, err
    assert why in err and err.strip().endswith("set generation.mps: off")
    assert not marker.exists()
    assert events.user_errors(tmp_path / "run") == [err.strip().removeprefix("colocate-rl: ")]


def test_a_daemon_auto_chose_that_does_not_start_leaves_the_command_to_run_without_it(tmp_path, fake_mps):
    (tmp_path / "run").mkdir()
    env = {**fake_mps, "FAKE_MPS_FAIL": "cannot open /dev/nvidia0"}
    show = "import os, sys; print(os.environ.get('CUDA_MPS_PIPE_DIRECTORY')); sys.exit(3)"
    proc = wrapped(tmp_path, env, sys.executable, "-c", show, flags=("--or-without",))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 3 and out.strip() == "None"  # the command's own code, no daemon's pipe
    assert err.strip() == (
        "colocate-rl: generation.mps auto: the CUDA MPS daemon (nvidia-cuda-mps-control) did not start: cannot open "
        "/dev/nvidia0; running without MPS"
    )
    assert events.user_errors(tmp_path / "run") == []


def on_h200(recipe, *sets, **host):
    return resolved_for(recipe, assumed_host(1, H200_GIB, **host), *sets)


def test_auto_runs_a_large_model_overlapped_under_mps_and_the_launch_starts_the_daemon(tmp_path):
    r = on_h200(QWEN7_1GPU, "generation.overlap=one_step", "generation.sleep_level=0")
    assert r.recipe.generation.mps == "on" and r.recorded_recipe().generation.mps == "on"
    assert r.mps_choice.line().startswith("generation.mps auto: on — a model of 7.62B parameters: the trainer's")
    assert r.mps_choice.line() in r.choice_lines()
    run_dir = tmp_path / "run"
    plan = make_plan(r, run_dir=run_dir, python="python", cwd=tmp_path, cache_dir=tmp_path, base_env={})
    wrapper = ["python", "-m", "colocate_rl.launch.mps", "--or-without", str(run_dir), str(run_dir / "mps"), "--"]
    assert plan.argv[:7] == wrapper  # auto's daemon: a run without it where it does not start
    assert plan.argv[7:10] == ["python", "-m", "torch.distributed.run"]
    explicit = on_h200(QWEN7_1GPU, "generation.overlap=one_step", "generation.sleep_level=0", "generation.mps=on")
    argv = make_plan(explicit, run_dir=run_dir, python="python", cwd=tmp_path, cache_dir=tmp_path, base_env={}).argv
    assert argv[:7] == [*wrapper[:3], *wrapper[4:], "python"]  # asked for: a daemon that does not start ends the run
    assert "colocate_rl.launch.owner" in plan.files["launch.sh"] and "colocate_rl.launch.mps" in plan.files["launch.sh"]


def test_a_resume_may_turn_mps_off_and_runs_without_the_daemon(tmp_path):
    """The daemon changes how the GPU runs the kernels, not what they compute: the one setting of overlap's a resume
    may change (the message of a daemon that does not start says to set it off)."""
    from colocate_rl.resume import plan_resume
    from colocate_rl.rundir import CHECKPOINT_COMPLETE, write_run_dir

    sets = ("generation.overlap=one_step", "generation.sleep_level=0", "generation.mps=on", "trainer.max_steps=4")
    host = assumed_host(1, H200_GIB)
    run_dir, started = tmp_path / "run", resolved_for(QWEN7_1GPU, host, *sets)
    kw = dict(python="python", cwd=tmp_path, cache_dir=tmp_path, base_env={})
    write_run_dir(run_dir, make_plan(started, run_dir=run_dir, **kw).files)
    (run_dir / "checkpoints" / "checkpoint-2").mkdir(parents=True)
    (run_dir / "checkpoints" / "checkpoint-2" / CHECKPOINT_COMPLETE).write_text("{}")
    resume = dict(host=host, env={}, cwd=tmp_path, python="python")
    assert "colocate_rl.launch.mps" in plan_resume(run_dir, **resume)[1].argv
    r, plan = plan_resume(run_dir, {"generation.mps": "off"}, **resume)
    assert r.recipe.generation.overlap == "one_step" and "colocate_rl.launch.mps" not in plan.argv


@pytest.mark.parametrize(
    ("recipe", "sets", "host", "reason"),
    [
        (
            QWEN05,
            ("generation.overlap=one_step", "generation.sleep_level=0"),
            {},
            "a model of 0.49B parameters: overlap was measured faster under",
        ),
        (
            QWEN7_1GPU,
            ("generation.overlap=one_step", "generation.sleep_level=0"),
            {"mps_control": False},
            "nvidia-cuda-mps-control is not on",
        ),
        (
            QWEN7_1GPU,
            ("generation.overlap=one_step", "generation.sleep_level=0"),
            {"mps_pipe_set": True},
            "CUDA_MPS_PIPE_DIRECTORY is set",
        ),
        (QWEN7_1GPU, (), {}, "without overlap, generation and training take turns"),
    ],
    ids=["0.5b", "no-daemon", "users-daemon", "no-overlap"],
)
def test_auto_leaves_mps_off_otherwise_and_says_why(tmp_path, recipe, sets, host, reason):
    from dataclasses import replace

    r = resolved_for(recipe, replace(assumed_host(1, H200_GIB), **host), *sets)
    assert r.recipe.generation.mps == "off" and r.mps_choice.reason.startswith(reason)
    assert (r.mps_choice.line() in r.choice_lines()) == ("generation.overlap=one_step" in sets)  # said with overlap
    plan = make_plan(r, run_dir=tmp_path / "run", python="python", cwd=tmp_path, cache_dir=tmp_path, base_env={})
    assert "colocate_rl.launch.mps" not in plan.argv


def test_on_cpu_auto_is_off_and_an_explicit_on_names_what_it_needs(tmp_path):
    r = resolved_for("quickstart", CPU, "generation.overlap=one_step")
    assert r.mps_choice.reason == "generation with transformers"
    recipe = write_recipe(tmp_path / "r.yaml", QWEN05)
    result = cli_here("validate", recipe, "--gpus", "1", "--set", "generation.mps=on")
    assert_user_error(result, "generation.mps: on lets generation's kernels run beside training's, which only")
    assert "set generation.overlap: one_step, or set generation.mps: off" in result.stderr
