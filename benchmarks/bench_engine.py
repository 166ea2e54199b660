#!/usr/bin/env python3
"""Benchmark colocate-rl's vLLM engine against TRL's built-in colocate engine (issue: engine lifecycle).

Every row is one `colocate-rl train` run (same recipe and seed; only generation.engine / sleep_level differ).
Figures come from the run's metrics.jsonl (telemetry) over the steps after the first (warm-up), and from the
engine's start-up event in events.jsonl (vLLM's GPU memory awake and asleep, driver's count, rank 0):

    python benchmarks/bench_engine.py --out bench/ --rows 1gpu --device 0
    python benchmarks/bench_engine.py --out bench/ --rows 2gpu --device 0,1
    python benchmarks/bench_engine.py --out bench/ --table        # table.md from every results.jsonl row so far

`--dry-run` prints the commands. A failing row is recorded with its exit code and the others still run.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEPS = 12
PLAIN = ["distributed.deepspeed=null", "distributed.zero_stage=null"]  # 1 GPU: no DeepSpeed, as in TRL's docs
ROWS = {  # name: (GPUs, recipe, --set overrides)
    "1gpu-0.5b-ours-sleep2": (
        1,
        "recipes/gpu-0.5b-layout.yaml",
        PLAIN + ["generation.engine=colocate-rl", "generation.sleep_level=2"],
    ),
    "1gpu-0.5b-ours-sleep0": (
        1,
        "recipes/gpu-0.5b-layout.yaml",
        PLAIN + ["generation.engine=colocate-rl", "generation.sleep_level=0"],
    ),
    "1gpu-0.5b-trl-sleep2": (
        1,
        "recipes/gpu-0.5b-layout.yaml",
        PLAIN + ["generation.engine=trl", "generation.sleep_level=2"],
    ),
    "1gpu-0.5b-trl-sleep0": (
        1,
        "recipes/gpu-0.5b-layout.yaml",
        PLAIN + ["generation.engine=trl", "generation.sleep_level=0"],
    ),
    "2gpu-1.5b-zero3-ours-sleep2": (
        2,
        "recipes/gpu-1.5b-layout-zero3.yaml",
        ["generation.engine=colocate-rl", "generation.sleep_level=2"],
    ),
    "2gpu-1.5b-zero3-trl-sleep2": (
        2,
        "recipes/gpu-1.5b-layout-zero3.yaml",
        ["generation.engine=trl", "generation.sleep_level=2"],
    ),
    "2gpu-1.5b-zero3-ours-sleep0": (
        2,
        "recipes/gpu-1.5b-layout-zero3.yaml",
        ["generation.engine=colocate-rl", "generation.sleep_level=0"],
    ),
}


def command(name: str, out: Path, steps: int) -> list[str]:
    _, recipe, sets = ROWS[name]
    argv = [
        sys.executable,
        "-m",
        "colocate_rl",
        "train",
        recipe,
        "--run-dir",
        str(out / "runs" / name),
        "--set",
        f"trainer.max_steps={steps}",
        "--set",
        "output.save_model=false",
        "--set",
        "generation.overlap=off",  # the rows measure generation and training in turn (overlap: bench_overlap.py)
    ]
    for item in sets:
        argv += ["--set", item]
    return argv


def median_after_first(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records[1:] if r.get(key) is not None]
    return round(statistics.median(values), 4) if values else None


def figures(name: str, run_dir: Path, code: int, wall: float, cmd: str) -> dict:
    row = {"row": name, "exit": code, "wall_s": round(wall, 1), "command": cmd}
    from colocate_rl.rundir import read_metrics

    steps = [r for r in read_metrics(run_dir) if "time/step_s" in r]
    row["steps"] = len(steps)
    if len(steps) >= 2:
        walls = [r["wall_s"] for r in steps]
        row["s_per_step"] = round(statistics.median(b - a for a, b in zip(walls, walls[1:])), 4)
        for key in (
            "time/step_s",
            "time/generate_s",
            "time/weight_sync_s",
            "time/weight_check_s",
            "time/wake_s",
            "time/sleep_s",
            "time/offload_s",
            "time/reload_s",
            "time/train_s",
            "time/optimizer_s",
            "gen/tokens_per_s",
            "mem/gpu_used_gib",
            "mem/wake_end_gib",
        ):
            row[key] = median_after_first(steps, key)
        row["sleep_wake_s"] = round((row["time/wake_s"] or 0) + (row["time/sleep_s"] or 0), 4)
        row["mem/gpu_peak_gib_max"] = max((r.get("mem/gpu_peak_gib") or 0) for r in steps)
    from colocate_rl.rundir import RunDir
    from colocate_rl.telemetry import events

    memory = events.read_events(run_dir, events.ENGINE_MEMORY)  # TRL's engine reports none
    if memory:
        first = min(memory, key=lambda e: e.get("rank") or 0)
        row["vllm_awake_gib"], row["vllm_asleep_gib"] = first["awake_gib"], first["asleep_gib"]
    log = RunDir(run_dir).log()
    if code and log.exists():
        row["log_tail"] = log.read_text(errors="replace")[-1500:]
    return row


TABLE_COLUMNS = [
    ("row", "row"),
    ("s/step", "s_per_step"),
    ("generate s", "time/generate_s"),
    ("weight sync s", "time/weight_sync_s"),
    ("of which check s", "time/weight_check_s"),
    ("sleep+wake s", "sleep_wake_s"),
    ("GPU GiB at step end", "mem/gpu_used_gib"),
    ("GPU GiB peak", "mem/gpu_peak_gib_max"),
    ("vLLM awake GiB", "vllm_awake_gib"),
    ("vLLM asleep GiB", "vllm_asleep_gib"),
    ("gen tokens/s", "gen/tokens_per_s"),
    ("exit", "exit"),
]


def table(results: list[dict]) -> str:
    lines = ["| " + " | ".join(h for h, _ in TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
    for r in results:
        lines.append("| " + " | ".join("" if r.get(k) is None else str(r.get(k)) for _, k in TABLE_COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", default="all", help="comma-separated row names, or 1gpu / 2gpu / all")
    parser.add_argument("--device", default="0", help="CUDA_VISIBLE_DEVICES for the rows")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--table", action="store_true", help="only rewrite table.md from results.jsonl")
    args = parser.parse_args()
    names = (
        [n for n in ROWS if args.rows == "all" or n.startswith(args.rows)]
        if args.rows in ("all", "1gpu", "2gpu")
        else args.rows.split(",")
    )
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        print(f"error: unknown rows {unknown}; known: {', '.join(ROWS)}", file=sys.stderr)
        return 2
    results_file = args.out / "results.jsonl"
    if not args.table:
        for name in names:
            argv = command(name, args.out, args.steps)
            shown = f"CUDA_VISIBLE_DEVICES={args.device} " + shlex.join(argv)
            if args.dry_run:
                print(shown)
                continue
            args.out.mkdir(parents=True, exist_ok=True)
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": args.device, "COLUMNS": "200"}
            start = time.time()
            code = subprocess.run(
                argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            ).returncode
            row = figures(name, args.out / "runs" / name, code, time.time() - start, shown)
            with results_file.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps({k: v for k, v in row.items() if k not in ("log_tail", "command")}), flush=True)
    if args.dry_run:
        return 0
    results = [json.loads(line) for line in results_file.read_text().splitlines()] if results_file.exists() else []
    (args.out / "table.md").write_text(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
