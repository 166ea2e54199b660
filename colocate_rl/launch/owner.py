"""The run directory's owner lock: one `colocate-rl train` (or `--resume`, or `launch.sh`) per run directory and node.

The holder keeps an flock on `<run_dir>/.owner.lock` (several nodes: one file per node, `rundir.owner_lock_name`)
for as long as it runs; the kernel drops it when the holder ends, however it ends, so the lock of a dead process is
simply taken over. The file names the holder (pid, command, since when) for the refusal line. A filesystem that
cannot lock (some FUSE mounts) runs without the lock.

`python -m colocate_rl.launch.owner RUN_DIR [NODE_DIR] -- COMMAND ...` takes the lock and execs COMMAND holding it:
every `launch.sh` starts torchrun so.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shlex
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from colocate_rl.errors import UserError
from colocate_rl.rundir import RUN_DIR_FIX, check_run_dir_free, first_missing, owner_lock_name


@dataclass
class OwnerLock:
    run_dir: Path
    node_dir: str | None
    fd: int
    created: Path | None = None  # the outermost directory taking the lock created
    fresh: bool = False  # checked free for a new run (`claim`): what is in it now is this start's

    @property
    def path(self) -> Path:
        return self.run_dir / owner_lock_name(self.node_dir)

    def claim(self) -> None:
        """A new run: check the run directory is free (`check_run_dir_free`, the lock file aside); `discard` may then
        remove what this start writes. On failure the lock is discarded first."""
        try:
            check_run_dir_free(self.run_dir, self.node_dir)
        except UserError:
            self.discard()
            raise
        self.fresh = True

    def discard(self) -> None:
        """Undo a start that ended before any rank ran: remove the run directory it created, or, when it existed
        empty, what this start wrote into it (on several nodes, this node's own files), then release the lock."""
        if self.created is not None:
            targets = [self.created]
        elif self.fresh:
            targets = [self.run_dir / self.node_dir] if self.node_dir else list(self.run_dir.iterdir())
        else:
            targets = [self.path]
        for target in targets:
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target, ignore_errors=True)
            else:
                target.unlink(missing_ok=True)
        self.release()

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def take(run_dir: Path, node_dir: str | None = None, *, create: bool = True, command: str = "") -> OwnerLock | None:
    """Hold the owner lock of `run_dir` (this node's, given `node_dir`) until this process and every process it
    passed the lock to (exec) ends. `create`: make a missing run directory (a new run; `claim` then checks it is
    free); else a missing one gives None (a resume's own checks say what is wrong). Fails (UserError) when a live
    process holds the lock, naming it, or when the lock file cannot be written."""
    run_dir = Path(run_dir)
    created = None
    if not run_dir.is_dir():
        if not create:
            return None
        check_run_dir_free(run_dir, node_dir)  # says why it cannot be created
        created = first_missing(run_dir)
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"output.run_dir: cannot create '{run_dir}' ({e.strerror or e}); {RUN_DIR_FIX}")
    lock = OwnerLock(run_dir, node_dir, -1, created)
    try:
        lock.fd = os.open(lock.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        fix = f"fix its permissions or {RUN_DIR_FIX}" if create else "make it writable to continue the run"
        raise UserError(f"output.run_dir: cannot write '{lock.path}' ({e.strerror or e}); {fix}")
    try:
        fcntl.flock(lock.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            return lock  # the filesystem cannot lock: run without it
        holder = _holder(lock.fd)
        lock.release()
        pid = holder.get("pid")
        who = f"process {pid}" if isinstance(pid, int) else "another process"
        about = ", since ".join(str(holder[k]) for k in ("command", "since") if holder.get(k))
        raise UserError(
            f"output.run_dir: '{run_dir}' is in use by {who}" + (f" ({about})" if about else "") + "; wait for it to "
            "end, or stop it first" + (f" (kill {pid})" if isinstance(pid, int) else "") + ", then run this again"
        )
    record = {
        "pid": os.getpid(),
        "command": command or shlex.join(sys.argv),
        "since": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    try:
        os.ftruncate(lock.fd, 0)
        os.pwrite(lock.fd, (json.dumps(record) + "\n").encode(), 0)
    except OSError:
        pass  # the lock holds without its description
    return lock


def _holder(fd: int) -> dict:
    """What the holder wrote into the lock file ({} while it has not yet)."""
    try:
        record = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def main(argv: list[str]) -> int:
    """`RUN_DIR [NODE_DIR] -- COMMAND ...`: take the lock, exec COMMAND holding it (2 and one line when it is held)."""
    if "--" not in argv or argv.index("--") not in (1, 2) or argv.index("--") == len(argv) - 1:
        print("error: usage: python -m colocate_rl.launch.owner RUN_DIR [NODE_DIR] -- COMMAND ...", file=sys.stderr)
        return 2
    split = argv.index("--")
    run_dir, node_dir, command = Path(argv[0]), (argv[1] if split == 2 else None), argv[split + 1 :]
    try:
        lock = take(run_dir, node_dir, create=False, command=f"launch.sh: {shlex.join(command)}")
    except UserError as e:
        for line in e.lines:
            print(f"error: {line}", file=sys.stderr)
        return 2
    if lock is None:
        print(f"error: {run_dir}: not a run directory (it does not exist)", file=sys.stderr)
        return 2
    if lock.fd >= 0:
        os.set_inheritable(lock.fd, True)  # COMMAND holds the lock from here on
    try:
        os.execvp(command[0], command)
    except OSError as e:
        print(f"error: {command[0]}: cannot run it ({e.strerror or e})", file=sys.stderr)
    return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
