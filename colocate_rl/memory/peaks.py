"""Peak GPU memory per estimator phase of a run, from its timelines (`colocate_rl.telemetry.timeline`), and the
comparison of those peaks with the estimate."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from colocate_rl.memory.estimate import MEMORY_PHASES
from colocate_rl.telemetry.timeline import Timeline, read_timelines

# telemetry phase → estimator phase. generation: `generate` without its nested phases (the KV-cache wake stays in);
# weight sync: `weight_sync` with the wake of the weights inside it; training: `train` without what nests in it
# (TRL generates inside training_step; DeepSpeed steps inside backward); optimizer step: `optimizer`.
INCLUSIVE = {"weight sync": "weight_sync", "optimizer step": "optimizer"}
EXCLUSIVE = {"generation": ("generate", {"wake"}), "training": ("train", set())}
# A weight sync with vLLM's weights asleep first empties torch's cache (what the optimizer step left reserved), then
# wakes them: readings before that wake still show the optimizer step's blocks being freed (H200, 0.5B ZeRO-3 on 2
# GPUs: 16.5 GiB read 7 ms into the sync, 8.7 at the wake, 10.2 the sync's own peak). Its peak starts at the wake.
STARTS_AT_CHILD = {"weight_sync": "wake"}


def rank_peaks(timeline: Timeline, skip_first: bool) -> tuple[dict[str, float], dict[str, float]]:
    """(peak per estimator phase, peak per telemetry phase with nested phases included) of one rank; with
    `skip_first`, readings up to the first step end are left out."""
    records = timeline.records
    cut = next((i for i, r in enumerate(records) if "step_end" in r), -1) if skip_first else -1
    intervals = timeline.intervals()
    children: dict[int, list[int]] = {}
    for k, iv in enumerate(intervals):
        if iv.parent is not None:
            children.setdefault(iv.parent, []).append(k)

    def peak(k: int, keep: set[str] | None) -> float | None:
        """Max memory in interval k after its start edge (that reading is what the previous phase left, e.g. the
        allocator's cache from backward before the weight sync empties it), or from its STARTS_AT_CHILD child's
        start edge on, up to its end edge; with `keep`, inside nested phases only those named in it."""
        iv = intervals[k]
        first = iv.start + 1
        if iv.name in STARTS_AT_CHILD:
            first = next(
                (intervals[c].start for c in children.get(k, []) if intervals[c].name == STARTS_AT_CHILD[iv.name]),
                first,
            )
        skip = set()
        if keep is not None:
            for c in children.get(k, []):
                if intervals[c].name not in keep:
                    skip.update(range(intervals[c].start + 1, intervals[c].end))  # a child's edges count
        values = [
            records[i]["mem"]
            for i in range(max(first, cut + 1), iv.end + 1)
            if i not in skip and isinstance(records[i].get("mem"), (int, float))
        ]
        return max(values) if values else None

    mapped: dict[str, float] = {}
    raw: dict[str, float] = {}
    for k, iv in enumerate(intervals):
        value = peak(k, None)
        if value is not None:
            raw[iv.name] = max(raw.get(iv.name, value), value)
        for phase, name in INCLUSIVE.items():
            if iv.name == name and value is not None:
                mapped[phase] = max(mapped.get(phase, value), value)
        for phase, (name, keep) in EXCLUSIVE.items():
            if iv.name == name:
                value = peak(k, keep)
                if value is not None:
                    mapped[phase] = max(mapped.get(phase, value), value)
    return mapped, raw


def phase_peaks(run_dir: Path, skip_first: bool = True) -> tuple[dict[str, float], dict[str, float]]:
    """Per estimator phase (MEMORY_PHASES) the peak memory in GiB over all ranks' timelines, and per telemetry phase
    (nested phases included). The first step is left out when a later one was recorded."""
    mapped: dict[str, float] = {}
    raw: dict[str, float] = {}
    for timeline in read_timelines(run_dir):
        m, r = rank_peaks(timeline, skip_first)
        if skip_first and not m:
            m, r = rank_peaks(timeline, False)  # one step only: take it, warm-up included
        for out, got in ((mapped, m), (raw, r)):
            for key, value in got.items():
                out[key] = round(max(out.get(key, value), value), 3)
    return {p: mapped[p] for p in MEMORY_PHASES if p in mapped}, raw


def comparison(estimated: dict[str, float], measured: dict[str, float]) -> list[dict[str, Any]]:
    """Rows phase / estimate / measured / error of the estimate in % of the measurement."""
    rows = []
    for phase in MEMORY_PHASES:
        e, m = estimated.get(phase), measured.get(phase)
        rows.append(
            {
                "phase": phase,
                "estimate_gib": None if e is None else round(e, 3),
                "measured_gib": m,
                "error_pct": round((e - m) / m * 100, 1) if e is not None and m else None,
            }
        )
    return rows


def peak_at_share(
    measured: dict[str, float], util: float, target: float, estimate_at: Callable[[float], dict[str, float]]
) -> float | None:
    """The peak over phases of a trial measured at share `util`, moved to share `target`: each phase's measurement
    plus the estimate's change of that phase between the two shares (only vLLM's share term depends on the share,
    and vLLM takes exactly its share). None when nothing was measured."""
    at, to = estimate_at(util), estimate_at(target)
    moved = [m + to[p] - at[p] for p, m in measured.items() if p in at and p in to]
    return round(max(moved), 3) if moved else None
