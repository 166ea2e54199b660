"""The step watchdog: stops a job whose ranks make no progress, and says which rank is stuck.

Progress is read from the run directory, not from the ranks: each rank's timeline (`timeline/rank<N>.jsonl`) is
written out at every step end (`colocate_rl.rank.telemetry`) and stays empty until the first one. A rank is stuck
when its timeline has not grown for `watchdog.step_timeout_minutes` since its last step end, or, before its first
step end, for `watchdog.start_timeout_minutes` since the launch (model load, engine start, compilation).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from colocate_rl.rundir import RunDir


def _header_pid(path: Path) -> int | None:
    """The `pid` of a timeline's header line (read alone: timelines grow long)."""
    try:
        with path.open() as f:
            head = json.loads(f.readline())
    except (OSError, ValueError):
        return None
    return head.get("pid") if isinstance(head, dict) and isinstance(head.get("pid"), int) else None


class Watchdog:
    def __init__(
        self,
        run_dir: Path,
        ranks: list[int],
        step_timeout_s: float,
        start_timeout_s: float,
        clock: Callable[[], float] = time.time,
    ):
        """`ranks`: the global ranks whose timelines to watch (all of them on one node; on several nodes, the ranks
        whose timelines appear)."""
        self.paths, self.ranks = RunDir(Path(run_dir)), ranks
        self.step_timeout_s, self.start_timeout_s, self.clock = step_timeout_s, start_timeout_s, clock
        self.started = clock()
        self.progress: dict[int, tuple[int, float]] = {}  # rank → (timeline size, when it last grew)
        self._pids: dict[int, int | None] = {}

    def _halted(self, rank: int) -> str | None:
        """The process state of a rank that is not running (stopped, zombie, dead), from its timeline's pid."""
        import psutil

        pid = self._pids.get(rank) or self._pids.setdefault(rank, _header_pid(self.paths.timeline(rank)))
        if pid is None:
            return None
        try:
            status = psutil.Process(pid).status()
        except psutil.NoSuchProcess:
            return "exited"
        return status if status in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD) else None

    @classmethod
    def for_run(cls, resolved, run_dir: Path) -> Watchdog | None:
        """The recipe's watchdog (None when `watchdog.step_timeout_minutes` is null). On one node every rank is
        watched from the start; on several, the ranks whose timelines appear in the run dir."""
        w, dist = resolved.recipe.watchdog, resolved.recipe.distributed
        if w.step_timeout_minutes is None:
            return None
        ranks = list(range(resolved.world_size)) if dist.nnodes == 1 else []
        return cls(run_dir, ranks, w.step_timeout_minutes * 60, w.start_timeout_minutes * 60)

    def check(self) -> str | None:
        """None while every rank progresses; else one line naming the stuck rank(s)."""
        now, stuck = self.clock(), []
        ranks = self.ranks or [int(p.stem.removeprefix("rank")) for p in self.paths.timelines()]
        for rank in ranks:
            path = self.paths.timeline(rank)
            size = path.stat().st_size if path.is_file() else 0
            last_size, since = self.progress.get(rank, (0, self.started))
            if size != last_size:
                self.progress[rank] = (size, now)
                continue
            limit = self.step_timeout_s if size else self.start_timeout_s
            if now - since > limit:
                stuck.append((rank, size > 0, now - since))
        if not stuck:
            return None
        # A rank that waits for a stuck one is stuck too: name first the ones that are not running at all
        # (stopped, suspended, zombie), then those waiting for their own engine process, then the one idle longest.
        from colocate_rl.telemetry import events

        reported = events.read_events(self.paths.path, events.ENGINE_WAIT)
        waits = {rank: self._engine_wait(reported, rank, now - idle) for rank, _, idle in stuck}
        stuck.sort(key=lambda s: (not self._halted(s[0]), not waits[s[0]], -s[2]))
        rank, started, idle = stuck[0]
        what = "ended no step" if started else "did not end its first step"
        if self._halted(rank):
            what = f"is not running ({self._halted(rank)}) and {what}"
        others = f" (also rank {', '.join(str(r) for r, _, _ in stuck[1:])})" if len(stuck) > 1 else ""
        key = "watchdog.step_timeout_minutes" if started else "watchdog.start_timeout_minutes"
        return (
            f"rank {rank}{others} {what} for {idle / 60:.1f} min{waits[rank]}; stopped the job (raise {key} if its "
            "steps are that slow)"
        )

    @staticmethod
    def _engine_wait(reported: list[dict], rank: int, since: float) -> str:
        """`, waiting for its generation engine process …` when the rank reported (`engine_wait` events: `reported`)
        a wait for an answer that began after its last progress; else nothing."""
        import psutil

        waits = [
            e
            for e in reported
            if e.get("rank") == rank and isinstance(e.get("since"), (int, float)) and e["since"] >= since - 1
        ]
        if not waits:
            return ""
        pid = waits[-1].get("pid")
        try:
            state = psutil.Process(pid).status()
        except (psutil.Error, TypeError, ValueError):
            state = "exited"
        return f", waiting for an answer from its generation engine process (pid {pid}, {state})"
