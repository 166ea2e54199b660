"""The one process-group runner: `train`, the measuring probe's trials and the benchmark drivers start torchrun (or
another launcher) through `run_supervised`.

The child runs in its own session (process group); its combined output is appended to a log file (and echoed line
by line when asked); SIGINT/SIGTERM sent to this process are forwarded to the child's group; with a timeout the whole
tree is ended (SIGTERM, then SIGKILL after a grace period). Every process the child started is noted while it runs
(torchrun's ranks, vLLM's engine processes, which may leave the group) and none is left running afterwards: a
straggler would hold GPU memory. On Linux the child is also tied to this process (a parent-death signal): if this
process is killed outright (SIGKILL, the OOM killer), the kernel sends the child SIGTERM and torchrun ends its ranks.
A stop signal that was ignored when this process started (`nohup`'s SIGHUP) stays ignored.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

TICK_S = 0.5


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _handled_stop_signals() -> list[int]:
    """The stop signals this process may take: not those ignored (`nohup` ignores SIGHUP, a background job of a
    non-interactive shell SIGINT) — they stay ignored."""
    return [s for s in STOP_SIGNALS if signal.getsignal(s) is not signal.SIG_IGN]


class Stopped(BaseException):
    """A stop signal that arrived before the ranks started (raised by `stop_signals_raise`)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def stop_signals_raise() -> Iterator[None]:
    """Within: SIGINT, SIGTERM or SIGHUP raises `Stopped` in the main thread (a child of `subprocess.run`, such as the
    built-in model's build, is killed as it unwinds); `run_supervised` takes them over while it runs. Ignored signals
    stay ignored; elsewhere than the main thread it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_stopped(signum, _frame) -> None:
        raise Stopped(signum)

    previous = {s: signal.signal(s, raise_stopped) for s in _handled_stop_signals()}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)


def tie_to_this_process() -> Callable[[], None] | None:
    """A `preexec_fn` that has the kernel send the child SIGTERM when this process ends, however it ends (Linux's
    PR_SET_PDEATHSIG; kept across exec); None elsewhere. A child whose parent ended before the tie exits at once."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: the child only calls it
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def tie() -> None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:
            os._exit(143)

    return tie


@dataclass(frozen=True)
class Outcome:
    returncode: int
    timed_out: bool = False
    seconds: float = 0.0
    signal: int | None = None  # the first stop signal this process received
    error: str | None = None  # why the tree was ended here (the watchdog, a log that could not be written)


def _note_descendants(proc: subprocess.Popen, seen: dict) -> None:
    import psutil

    try:
        for child in psutil.Process(proc.pid).children(recursive=True):
            seen.setdefault((child.pid, child.create_time()), child)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        pass


def end_tree(proc: subprocess.Popen, seen: dict, grace_s: float) -> None:
    """SIGTERM (then SIGCONT, for a stopped one) to the child's process group and to every process it started (each
    by its id, also those in other sessions), then SIGKILL to whatever is left after `grace_s`."""
    import psutil

    _note_descendants(proc, seen)
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            os.killpg(proc.pid, signal.SIGCONT)
        except (ProcessLookupError, PermissionError):
            pass
    procs = [p for p in seen.values() if p.is_running()]
    for p in procs:
        try:
            p.terminate()
            p.resume()  # SIGCONT: a stopped process acts on SIGTERM only once it runs again
        except psutil.Error:
            pass
    deadline = time.monotonic() + grace_s
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    _, alive = psutil.wait_procs(procs, timeout=max(0.1, deadline - time.monotonic()))
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=10)
    proc.wait()


def run_supervised(
    argv: list[str],
    env: Mapping[str, str],
    log_path: Path,
    *,
    echo: Callable[[str], None] | None = None,
    on_tick: Callable[[], None] | None = None,
    check: Callable[[], str | None] | None = None,
    on_signal: Callable[[int], bool] | None = None,
    timeout_s: float | None = None,
    cwd: Path | None = None,
    stdin: int | None = None,
) -> Outcome:
    """Run `argv` with exactly `env` until it exits, appending its output to `log_path`; `on_tick` is called about
    twice a second and once at the end. The tree is ended early when `timeout_s` passes, when `check()` returns a
    reason, when the log cannot be written (a full disk: the output is still drained, so the ranks never block on
    the pipe), or on a stop signal (SIGINT, SIGTERM, SIGHUP) — except the first one that `on_signal(signum)` takes
    on itself (e.g. asking the ranks to save and stop); a second signal then ends the tree at once."""
    begin = time.monotonic()
    state: dict = {"signal": None, "end": None, "error": None}
    proc: subprocess.Popen | None = None

    def on_stop_signal(signum, _frame) -> None:
        if proc is not None and proc.poll() is not None:
            return
        if state["signal"] is None:
            state["signal"] = signum
            if proc is not None and on_signal is not None and on_signal(signum):
                return
        state["end"] = "signal"  # a second signal, or one nobody takes on: end the tree at once

    in_main = threading.current_thread() is threading.main_thread()
    # before the child starts: a signal in between ends it at once instead of killing this process alone
    previous = {s: signal.signal(s, on_stop_signal) for s in _handled_stop_signals()} if in_main else {}
    try:
        proc = subprocess.Popen(
            argv,
            env=dict(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=stdin,
            cwd=cwd,
            start_new_session=True,
            preexec_fn=tie_to_this_process(),
        )
    except BaseException:
        _restore(previous)
        raise

    def pump() -> None:
        assert proc.stdout is not None
        log = None
        try:
            log = log_path.open("ab")
        except OSError as e:
            state["error"] = f"{log_path}: cannot write the run's log ({e.strerror or e}); the job was stopped"
        for line in iter(proc.stdout.readline, b""):
            if log is not None:
                try:
                    log.write(line)
                    log.flush()
                except OSError as e:  # keep draining the pipe: a blocked pipe would hang every rank
                    state["error"] = (
                        f"{log_path}: cannot write the run's log ({e.strerror or e}); the job was stopped — free "
                        "space on that filesystem and resume from the last checkpoint"
                    )
                    log = None
            if echo is not None:
                echo(line.decode(errors="replace").rstrip("\n"))
        if log is not None:
            try:
                log.close()
            except OSError:
                pass

    copier = threading.Thread(target=pump, daemon=True)
    copier.start()
    seen: dict = {}
    timed_out = False
    try:
        while proc.poll() is None:
            _note_descendants(proc, seen)
            if timeout_s is not None and time.monotonic() - begin > timeout_s:
                timed_out = True
            elif check is not None and state["error"] is None:
                state["error"] = check()
            if timed_out or state["error"] is not None or state["end"] is not None:
                end_tree(proc, seen, grace_s=15)
                break
            if on_tick is not None:
                on_tick()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=TICK_S)  # returns as soon as the child ends
    finally:
        _restore(previous)
    if any(p.is_running() for p in seen.values()):  # a straggler of the tree (it would hold GPU memory)
        end_tree(proc, seen, grace_s=10)
    copier.join(timeout=10)
    if on_tick is not None:
        on_tick()
    return Outcome(
        proc.returncode, timed_out, round(time.monotonic() - begin, 1), signal=state["signal"], error=state["error"]
    )


def _restore(previous: dict) -> None:
    for s, handler in previous.items():
        signal.signal(s, handler if handler is not None else signal.SIG_DFL)
