"""The torch-extension cache the ranks JIT-compile DeepSpeed ops into ($TORCH_EXTENSIONS_DIR, one per Python
environment: `plan.launch_plan.extensions_dir`): say when a compile runs, and clear a lock a stopped compile left.

torch guards each op's build directory with a `lock` file, created before the build and deleted after it
(`torch.utils.file_baton`); a process killed mid-build leaves it behind, and every later rank that needs the op then
waits for it forever. A lock is stale when it is older than STALE_AFTER_S and, on two looks in a row, no process
works in its directory (ninja and the compiler run there).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

STALE_AFTER_S = 10.0  # a live build has ninja running in its directory well before this


def _busy_dirs(root: Path) -> set[Path]:
    """The directories under `root` some process has as its working directory (a build in progress)."""
    import psutil

    busy = set()
    for proc in psutil.process_iter(["cwd"]):
        cwd = proc.info.get("cwd")
        if cwd and Path(cwd).is_relative_to(root):
            busy.add(Path(cwd))
    return busy


class CompileWatch:
    def __init__(self, root: Path, clock: Callable[[], float] = time.time):
        self.root, self.clock = Path(root), clock
        self.suspect: set[Path] = set()  # stale-looking locks on the last look
        self.busy_before: set[Path] = set()  # op directories being built on the last look
        self.compiling: dict[Path, float] = {}  # op directory → when its compile was announced

    def look(self) -> list[str]:
        """One look at the cache; returns lines to show: a compile that started or ended, a stale lock removed."""
        locks = list(self.root.glob("*/lock")) if self.root.is_dir() else []
        busy = _busy_dirs(self.root) if locks or self.compiling else set()
        lines = []
        for lock in locks:
            op = lock.parent
            building = any(d.is_relative_to(op) for d in busy)
            if building and op in self.busy_before and op not in self.compiling:  # not ninja's quick up-to-date check
                self.compiling[op] = self.clock()
                lines.append(
                    f"compiling the DeepSpeed op {op.name} (once per Python environment, into {op.parent}); this "
                    "takes a minute or two ..."
                )
            if building or not self._old(lock):
                self.suspect.discard(lock)
            elif lock in self.suspect:
                lock.unlink(missing_ok=True)
                self.suspect.discard(lock)
                lines.append(
                    f"removed {lock}: a stopped compile left it behind, and the ranks would wait for it forever"
                )
            else:
                self.suspect.add(lock)
        self.busy_before = {lock.parent for lock in locks if any(d.is_relative_to(lock.parent) for d in busy)}
        for op, since in list(self.compiling.items()):
            if not (op / "lock").exists():
                del self.compiling[op]
                lines.append(f"compiled {op.name} in {self.clock() - since:.0f} s")
        return lines

    def _old(self, lock: Path) -> bool:
        try:
            return self.clock() - lock.stat().st_mtime > STALE_AFTER_S
        except OSError:
            return False

    def clear_stale(self, pause_s: float = 0.5) -> list[str]:
        """Before the ranks start: two looks `pause_s` apart, so a stale lock is gone before any rank waits on it."""
        lines = self.look()
        if self.suspect:
            time.sleep(pause_s)
            lines += self.look()
        return lines
