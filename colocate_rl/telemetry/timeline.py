"""The timeline format and its one reader.

Each rank writes `timeline/rank<N>.jsonl` (`colocate_rl.rank.telemetry`): a header `{"rank", "device", "unit", "t0",
"pid"}`,
then records with `t` (seconds since t0) and `mem` (GiB: NVML's used memory of the rank's GPU, or the process RSS
on CPU), each either a sample, a phase edge (`phase`, `edge`: start/end) or a step end (`step_end`). Phases nest
(`generate` holds `wake`, `weight_sync`, `sleep`, ...). `report` (shading, plots) and `mem-probe` (peaks per phase)
both read timelines through `Timeline`. Malformed lines are skipped (a line cut off by a crash is normal).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from colocate_rl.rundir import RunDir, read_jsonl

# The phases the rank-side recorder times, in display order.
TIMED_PHASES = (
    "generate",
    "weight_sync",
    "weight_check",
    "wake",
    "sleep",
    "offload",
    "reload",
    "reward",
    "tools",
    "prepare",
    "train",
    "optimizer",
)


@dataclass
class Interval:
    """One phase between its edges: `start`/`end` are record indices; an unclosed phase (a crash) ends at the last
    record. `parent` is the index of the enclosing interval."""

    name: str
    start: int
    end: int
    parent: int | None


def nest(edges: Iterable[tuple[str, str] | None], last: int) -> tuple[list[Interval], list[int | None]]:
    """The one nesting rule. `edges` holds (phase, "start"|"end") per record, None for other records; `last` is the
    last record's index. A start opens an interval inside the innermost open one; an end closes the innermost open
    interval of that phase and any still open inside it; an end of a phase that is not open is ignored. Returns the
    intervals and, per record, the innermost interval open after it."""
    intervals: list[Interval] = []
    stack: list[int] = []
    innermost: list[int | None] = []
    for i, item in enumerate(edges):
        if item is not None:
            phase, edge = item
            if edge == "start":
                intervals.append(Interval(phase, i, last, stack[-1] if stack else None))
                stack.append(len(intervals) - 1)
            elif edge == "end" and any(intervals[k].name == phase for k in stack):
                while stack:
                    top = stack.pop()
                    intervals[top].end = i
                    if intervals[top].name == phase:
                        break
        innermost.append(stack[-1] if stack else None)
    return intervals, innermost


def finite(record: dict, key: str) -> float | None:
    """record[key] when it is a finite number (not a bool), else None."""
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _edge(record: dict[str, Any]) -> tuple[str, str] | None:
    if isinstance(record.get("phase"), str) and record.get("edge") in ("start", "end"):
        return record["phase"], record["edge"]
    return None


@dataclass
class Timeline:
    """One rank's timeline: its header fields and its records in order."""

    rank: int
    device: str = "?"
    t0: float = 0.0
    records: list[dict[str, Any]] = field(default_factory=list)
    pid: int | None = None  # the rank's process

    @classmethod
    def read(cls, path: Path) -> Timeline:
        records = read_jsonl(path)
        head = records[0] if records and "rank" in records[0] else {}
        match = re.fullmatch(r"rank(\d+)\.jsonl", Path(path).name)
        rank = finite(head, "rank")
        return cls(
            rank=int(rank) if rank is not None else int(match.group(1)) if match else 0,
            device=str(head.get("device", "?")),
            t0=finite(head, "t0") or 0.0,
            pid=head["pid"] if isinstance(head.get("pid"), int) else None,
            records=[r for r in records if "rank" not in r],
        )

    @cached_property
    def points(self) -> list[tuple[float, float]]:
        """(t, GiB) of every record with both."""
        return [
            (t, m) for r in self.records if (t := finite(r, "t")) is not None and (m := finite(r, "mem")) is not None
        ]

    @cached_property
    def edges(self) -> list[tuple[float, str, str]]:
        """(t, phase, edge) of every timed phase edge."""
        return [(t, *e) for r in self.records if (t := finite(r, "t")) is not None and (e := _edge(r)) is not None]

    @cached_property
    def step_ends(self) -> list[tuple[float, float | None]]:
        """(t, GiB or None) of every step end."""
        return [(t, finite(r, "mem")) for r in self.records if "step_end" in r and (t := finite(r, "t")) is not None]

    def intervals(self) -> list[Interval]:
        """Every phase interval, in start order (indices into `records`)."""
        return nest((_edge(r) for r in self.records), len(self.records) - 1)[0]


def read_timelines(run_dir: Path) -> list[Timeline]:
    """Every rank's timeline of a run directory, by rank."""
    return sorted((Timeline.read(p) for p in RunDir(Path(run_dir)).timelines()), key=lambda t: t.rank)


def innermost_spans(edges: list[tuple[float, str, str]]) -> list[tuple[float, float, str]]:
    """(start, end, phase) spans of the innermost open phase, from phase edges (t, phase, edge) in time order."""
    intervals, innermost = nest(((phase, edge) for _, phase, edge in edges), len(edges) - 1)
    spans = []
    for i in range(len(edges) - 1):
        k = innermost[i]
        if k is not None and edges[i + 1][0] > edges[i][0]:
            spans.append((edges[i][0], edges[i + 1][0], intervals[k].name))
    return spans
