"""`python -m colocate_rl.launch.mps [--or-without] RUN_DIR LOG_DIR -- COMMAND ...`: run COMMAND (torchrun) as the
client of a CUDA MPS daemon of its own (`generation.mps: on`), so that the processes sharing a GPU (the trainer and
its engine processes) run their kernels at once instead of taking time slices. `train` and `launch.sh` start
torchrun so.

The daemon (`nvidia-cuda-mps-control -f`, in a session of its own, ended with this process however it ends) gets a fresh
directory under the temp dir for its pipes (a socket path holds ~100 characters) and LOG_DIR for its logs; COMMAND finds
it by CUDA_MPS_PIPE_DIRECTORY. The environment's CUDA_MPS_CLIENT_PRIORITY and CUDA_MPS_ACTIVE_THREAD_PERCENTAGE are
every client's, but an engine process takes COLOCATE_RL_ENGINE_MPS_PRIORITY's and
COLOCATE_RL_ENGINE_MPS_THREAD_PERCENTAGE's where those are set (`engine_client_settings`; the benchmark arms
`overlap-prio-mps`, the trainers below the engines, and `overlap-cap-mps`, the trainers on part of the GPU's SMs;
neither was faster at the 1.7B shape: docs/benchmarks, invocation S). Stop signals are passed on to COMMAND (ended, as
the daemon is, if this process is killed); once COMMAND ends the daemon is asked to quit (killed if it does not) and
this process exits with COMMAND's code, or ends by the signal that ended COMMAND. When the daemon does not start (its
control pipe does not appear, or it exits): one line on stderr and in RUN_DIR's events, exit 2, COMMAND not run; with
--or-without (`mps: auto` chose it) a line on stderr and COMMAND runs without MPS.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

from colocate_rl.plan.host import ENGINE_PRIORITY, ENGINE_THREADS, PRIORITY, THREADS
from colocate_rl.plan.host import MPS_CONTROL as CONTROL

START_S = 30.0  # for the control pipe to appear
QUIT_S = 30.0  # for the daemon to end after `quit` (it waits for its clients)
FIX = "set generation.mps: off"
OR_WITHOUT = "--or-without"  # `mps: auto` chose the daemon: a daemon that does not start is run without
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
ENGINE_OWN = {ENGINE_PRIORITY: PRIORITY, ENGINE_THREADS: THREADS}  # an engine process's own → what it sets


class MpsError(Exception):
    pass


def client_env(env: Mapping[str, str], pipe: Path, log_dir: Path) -> dict[str, str]:
    """`env` for the daemon and its clients: its pipe and log directories."""
    return {**env, "CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(log_dir)}


def client_settings(env: Mapping[str, str]) -> str:
    """The MPS client settings `env` holds, for a log line: `CUDA_MPS_CLIENT_PRIORITY=1 ...`, or `defaults`."""
    return " ".join(f"{name}={env[name]}" for name in (PRIORITY, THREADS) if name in env) or "defaults"


def engine_client_settings() -> str | None:
    """In an engine process, before its CUDA context exists: ENGINE_PRIORITY and ENGINE_THREADS, where set, as its
    MPS client priority and SM percentage, and those of the processes it starts (vLLM's engine core). Returns the
    settings it now has (`client_settings`) where it took any, else None."""
    took = False
    for engine_name, name in ENGINE_OWN.items():
        if (value := os.environ.pop(engine_name, None)) is not None:
            os.environ[name], took = value, True
    return client_settings(os.environ) if took else None


def start_daemon(env: dict[str, str], pipe: Path, log_dir: Path) -> subprocess.Popen:
    """Start the control daemon in the foreground of a child process; return once its control pipe exists. Raises
    MpsError (naming the fix) when it cannot run, exits, or makes no pipe within START_S."""
    from colocate_rl.launch.supervise import tie_to_this_process

    out = log_dir / "daemon.out"
    try:
        with out.open("ab") as f:
            daemon = subprocess.Popen(
                [CONTROL, "-f"], env=env, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=tie_to_this_process(),
            )  # fmt: skip
    except OSError as e:
        raise MpsError(f"generation.mps: on: {CONTROL} cannot run ({e.strerror or e}); {FIX}") from e
    deadline = time.monotonic() + START_S
    while not (pipe / "control").exists():
        if daemon.poll() is not None or time.monotonic() > deadline:
            if daemon.poll() is None:
                daemon.kill()
            daemon.wait()
            said = out.read_text(errors="replace").strip().splitlines()
            why = f": {said[-1].strip()}" if said else f" (exit {daemon.returncode})"
            raise MpsError(f"generation.mps: on: the CUDA MPS daemon ({CONTROL}) did not start{why}; {FIX}")
        time.sleep(0.1)
    return daemon


def stop_daemon(daemon: subprocess.Popen, env: dict[str, str]) -> None:
    """Ask the daemon to quit (it ends its server once the clients are gone); kill it after QUIT_S."""
    try:
        subprocess.run([CONTROL], input="quit\n", text=True, env=env, capture_output=True, timeout=QUIT_S)
        daemon.wait(timeout=QUIT_S)
    except (OSError, subprocess.SubprocessError):
        daemon.kill()
        daemon.wait()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    or_without = args[:1] == [OR_WITHOUT]
    args = args[or_without:]
    if len(args) < 4 or args[2] != "--":
        print(f"usage: python -m colocate_rl.launch.mps [{OR_WITHOUT}] RUN_DIR LOG_DIR -- COMMAND ...", file=sys.stderr)
        return 2
    run_dir, log_dir, command = Path(args[0]), Path(args[1]), args[3:]
    log_dir.mkdir(parents=True, exist_ok=True)
    pipe = Path(tempfile.mkdtemp(prefix="colocate-rl-mps-"))
    env, daemon = client_env(os.environ, pipe, log_dir), None
    try:
        try:
            daemon = start_daemon(env, pipe, log_dir)
            print(
                f"[colocate-rl] CUDA MPS daemon {daemon.pid} for this run: pipes {pipe}, logs {log_dir}; clients' "
                f"settings {client_settings(env)}",
                flush=True,
            )
        except MpsError as e:
            if not or_without:
                from colocate_rl.telemetry import events

                events.emit(run_dir, events.USER_ERROR, lines=[str(e)])
                print(f"colocate-rl: {e}", file=sys.stderr, flush=True)
                return 2
            said = str(e).replace("generation.mps: on", "generation.mps auto", 1).removesuffix(f"; {FIX}")
            print(f"colocate-rl: {said}; running without MPS", file=sys.stderr, flush=True)
            env = dict(os.environ)  # auto's choice: the run goes on as it would have without the daemon
        code = run_command(command, env)
    finally:
        if daemon is not None:
            stop_daemon(daemon, env)
        shutil.rmtree(pipe, ignore_errors=True)
    if code < 0:  # COMMAND was killed by a signal: so is this process, for whoever reads its status
        if -code in FORWARDED:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return 128 - code if code < 0 else code


def run_command(command: list[str], env: dict[str, str]) -> int:
    """Run `command` (ended if this process is killed), passing stop signals on; its exit code (negative: killed by
    that signal)."""
    from colocate_rl.launch.supervise import tie_to_this_process

    tie, child = tie_to_this_process(), None

    def forward(signum: int, _frame) -> None:
        if child is not None:
            child.send_signal(signum)

    def in_child() -> None:
        if tie is not None:
            tie()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)

    for s in FORWARDED:
        signal.signal(s, forward)
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)  # a stop signal before `child` is set waits for it
    try:
        child = subprocess.Popen(command, env=env, preexec_fn=in_child)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    return child.wait()


if __name__ == "__main__":
    sys.exit(main())
