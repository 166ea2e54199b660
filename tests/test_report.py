"""`colocate-rl report` on hand-made run directories: table numbers, PNGs with drawn data, comparison, errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from colocate_rl import report as rep
from colocate_rl.errors import UserError

ROOT = Path(__file__).resolve().parent.parent

# One step, in order: (innermost phase, seconds, memory during it in GiB); generate wraps wake … sleep.
GPU_STEP = [("wake", 0.2, 70.0), ("weight_sync", 0.3, 72.0), ("generate", 2.0, 75.0), ("sleep", 0.2, 22.0),
            ("reward", 0.1, 22.0), ("prepare", 0.2, 23.0), ("train", 1.0, 35.0), ("optimizer", 0.5, 40.0),
            ("other", 0.1, 21.0)]
CPU_STEP = [("generate", 1.5, 1.2), ("reward", 0.1, 1.2), ("train", 0.8, 1.6), ("optimizer", 0.4, 1.8),
            ("other", 0.2, 1.3)]
WARMUP_GENERATE = 5.0  # step 1's generate seconds (the others take GPU_STEP's / CPU_STEP's)


def make_run(path: Path, *, gpu: bool = True, steps: int = 6, ranks: int = 2, sleep: bool = True,
             timeline: bool = True) -> Path:
    """A run dir with metrics.jsonl (+ the final train_runtime line) and timeline/rank<N>.jsonl."""
    plan = [s for s in (GPU_STEP if gpu else CPU_STEP) if sleep or s[0] not in ("wake", "sleep")]
    if gpu and not sleep:  # vLLM keeps its memory all the time
        plan = [(p, s, max(m, 72.0)) for p, s, m in plan]
    path.mkdir(parents=True)
    (path / "timeline").mkdir()
    lines = {r: [json.dumps({"rank": r, "device": f"cuda:{r}" if gpu else "cpu", "unit": "GiB", "t0": 1000.0 + r})]
             for r in range(ranks)}
    metrics, t = [], 0.0
    for step in range(1, steps + 1):
        secs = {p: (WARMUP_GENERATE if step == 1 and p == "generate" else s) for p, s, _ in plan}
        for r in range(ranks):
            tt, in_gen = t, False
            for i, (p, _, mem) in enumerate(plan):
                nested = p in ("wake", "weight_sync", "generate", "sleep")  # inside generate
                if nested and not in_gen:
                    lines[r].append(json.dumps({"t": tt, "phase": "generate", "edge": "start", "mem": mem + 0.3 * r}))
                    in_gen = True
                if p not in ("generate", "other"):
                    lines[r].append(json.dumps({"t": tt, "phase": p, "edge": "start", "mem": mem + 0.3 * r}))
                lines[r] += [json.dumps({"t": round(tt + 0.1 * k, 3), "mem": mem + 0.3 * r})
                             for k in range(round(secs[p] / 0.1))]
                tt += secs[p]
                if p not in ("generate", "other"):
                    lines[r].append(json.dumps({"t": tt, "phase": p, "edge": "end", "mem": mem + 0.3 * r}))
                if in_gen and (i + 1 == len(plan) or plan[i + 1][0] not in ("wake", "weight_sync", "generate", "sleep")):
                    lines[r].append(json.dumps({"t": tt, "phase": "generate", "edge": "end", "mem": mem + 0.3 * r}))
                    in_gen = False
            lines[r].append(json.dumps({"t": tt, "step_end": step, "mem": plan[-1][2] + 0.3 * r}))
        t += sum(secs.values())
        record = {"step": step, "max_steps": steps, "wall_s": t, "reward": 0.1 * step, "loss": 0.5,
                  "time/step_s": sum(secs.values()), **{f"time/{p}_s": s for p, s in secs.items()},
                  "gen/tokens_per_s": 1000.0 + step, "telemetry/overhead_s": 0.046}
        if gpu:
            record.update({f"mem/{p}_end_gib": m for p, _, m in plan}, **{
                "mem/gpu_used_gib": plan[-1][2], "mem/gpu_peak_gib": max(m for *_, m in plan) + step,
                "mem/torch_allocated_gib": 15.0, "mem/torch_reserved_gib": 18.0})
        else:
            record.update({"mem/rss_gib": 1.3, "mem/rss_peak_gib": 1.8})
        metrics.append(json.dumps(record))
    metrics.append(json.dumps({"step": steps, "wall_s": t, "train_runtime": t}))
    (path / "metrics.jsonl").write_text("\n".join(metrics) + "\n")
    if timeline:
        for r, rank_lines in lines.items():
            (path / "timeline" / f"rank{r}.jsonl").write_text("\n".join(rank_lines) + "\n")
    return path
