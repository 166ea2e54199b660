"""Structured events the ranks report in the run directory's `events.jsonl`, for the launcher, `report`, the probe
and the benchmarks to read instead of scraping printed text.

One JSON object a line: `{"t": unix time, "rank": global rank, "kind": ..., ...}`, appended with one write per
event (lines of different ranks do not interleave). Kinds and their fields:

- `user_error`: `lines` — a UserError a rank stopped on (e.g. the nodes run different recipes); exit code 2.
- `stale_weights`: `message` — vLLM was not generating from the trainer's current weights; exit code 3.
- `engine_failed`: `message` — the generation engine's own process failed or ended (`generation.engine_process`).
- `engine_wait`: `pid`, `since` (unix time) — a rank has waited for an answer from its engine process for half the
  watchdog's step timeout; the watchdog names that process if the rank is then stuck.
- `reward_failed`: `message` — a process that scored a reward (`rewards[i].processes`) died; exit code 1.
- `engine_memory`: `awake_gib`, `asleep_gib` (None with sleep level 0), `sleep_level`, `config` — the GPU memory the
  colocated vLLM engine took at start-up by the driver's count, and the engine settings vLLM built.
- `checkpoint`: `step`, `path` — rank 0, once every rank saved a checkpoint (it is complete).
- `stopped`: `step`, `checkpoint` — rank 0, when a stop request ended training at a step end with a checkpoint.
- `resumed`: `step`, `checkpoint` — rank 0, when a resumed run starts from a checkpoint.
- `push`: `repo`, `url` or `error` (the other null) — node 0's launcher (`rank` null), after uploading `final/` for
  `output.push_to_hub` (colocate_rl.launch.push).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from colocate_rl.rundir import RunDir, read_jsonl

USER_ERROR = "user_error"
STALE_WEIGHTS = "stale_weights"
ENGINE_FAILED = "engine_failed"
ENGINE_WAIT = "engine_wait"
REWARD_FAILED = "reward_failed"
ENGINE_MEMORY = "engine_memory"
CHECKPOINT = "checkpoint"
STOPPED = "stopped"
RESUMED = "resumed"
PUSH = "push"


def emit(run_dir: Path, kind: str, **fields: Any) -> None:
    """Append one event; never raises (an event that cannot be written is not worth failing a run for)."""
    rank = os.environ.get("RANK")
    record = {
        "t": round(time.time(), 3),
        "rank": int(rank) if rank and rank.isdigit() else None,
        "kind": kind,
        **fields,
    }
    try:
        fd = os.open(RunDir(Path(run_dir)).events, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(record, default=str) + "\n").encode())
        finally:
            os.close(fd)
    except OSError:
        pass


def read_events(run_dir: Path, kind: str | None = None) -> list[dict[str, Any]]:
    """The run's events (of one kind), in the order they were written."""
    return [e for e in read_jsonl(RunDir(Path(run_dir)).events) if kind is None or e.get("kind") == kind]


def user_errors(run_dir: Path) -> list[str]:
    """The error lines the ranks stopped on (user errors, stale weights, a failed engine process), each once, in
    order."""
    lines: list[str] = []
    for event in read_events(run_dir):
        if event.get("kind") == USER_ERROR:
            lines += [str(line) for line in event.get("lines") or []]
        elif event.get("kind") in (STALE_WEIGHTS, ENGINE_FAILED):
            lines.append(str(event.get("message", "")))
    return list(dict.fromkeys(line for line in lines if line))


def log_line(text: str) -> None:
    """`text` as one line of the rank's output (train.log), for a person reading it, in one write: the ranks run
    unbuffered (`python -u`), where `print` writes the text and its newline apart and two ranks' lines can join."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()
