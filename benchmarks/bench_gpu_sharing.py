#!/usr/bin/env python3
"""Two processes on one GPU: how much each keeps of its speed alone, time-sliced (the default) and under CUDA MPS.

Two kernels stand in for overlap's two sides: `small`, a launch-bound chain of 256 × 576 @ 576 × 576 bf16 matmuls
with tanh (a 135M model's decode step is this size), and `big`, a compute-bound 8192² bf16 matmul. Each stage starts
its processes on a common start time after their warm-up, so that they really run at once, and prints one JSON line
per process with its seconds. Stages: each kernel alone; small + big and small + small time-sliced; the same two
under a job-local MPS daemon (colocate-rl's own, `colocate_rl.launch.mps`: its logs under --out). Leaves the GPU's
compute mode as it is.

    python benchmarks/bench_gpu_sharing.py --out OUT            # ~2 min on an H200
    python benchmarks/bench_gpu_sharing.py --out OUT --dry-run  # the commands, nothing run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from colocate_rl.launch import mps  # noqa: E402 (the repository on the path first)

ITERATIONS = {"small": 300_000, "big": 5_000}  # ~8 s each alone on an H200
STAGES = [("alone", ("small",)), ("alone", ("big",)), ("timesliced", ("small", "big")),
          ("timesliced", ("small", "small")), ("mps", ("small", "big")), ("mps", ("small", "small"))]  # fmt: skip
START_DELAY_S = 12  # covers a process's start and warm-up


def work(kernel: str, iterations: int, start_at: float) -> float:
    """Seconds `iterations` of `kernel` take, timed from `start_at` (after the warm-up)."""
    import torch

    a = torch.randn(256, 576, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(576, 576, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(20):
        a = torch.tanh(a @ w)
    torch.cuda.synchronize()
    while time.time() < start_at:
        time.sleep(0.001)
    start = time.time()
    for _ in range(iterations):
        if kernel == "small":
            a = torch.tanh(a @ w)
        else:
            b @ b
    torch.cuda.synchronize()
    return time.time() - start


def commands(kernels: tuple[str, ...], start_at: float) -> list[list[str]]:
    return [[sys.executable, __file__, "--work", k, str(ITERATIONS[k]), str(start_at)] for k in kernels]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--work", nargs=3, metavar=("KERNEL", "N", "START_AT"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.work:
        kernel, n, start_at = a.work
        print(json.dumps({"kernel": kernel, "s": round(work(kernel, int(n), float(start_at)), 3)}), flush=True)
        return
    if a.out is None:
        p.error("--out is required")
    daemon, mps_env, rows = None, None, []
    pipe = Path(tempfile.mkdtemp(prefix="bench-mps-"))
    try:
        for mode, kernels in STAGES:
            argvs = commands(kernels, time.time() + START_DELAY_S)
            if a.dry_run:
                print(mode, *(" ".join(argv) for argv in argvs), sep="\n  ")
                continue
            if mode == "mps" and mps_env is None:
                logs = a.out / "mps"
                logs.mkdir(parents=True, exist_ok=True)
                mps_env = mps.client_env(os.environ, pipe, logs)
                daemon = mps.start_daemon(mps_env, pipe, logs)
            env = mps_env if mode == "mps" else dict(os.environ)
            procs = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True) for argv in argvs]
            seconds = [json.loads(proc.communicate()[0].strip().splitlines()[-1])["s"] for proc in procs]
            row = {"mode": mode, "kernels": list(kernels), "s": seconds}
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        if daemon is not None:
            mps.stop_daemon(daemon, mps_env)
        shutil.rmtree(pipe, ignore_errors=True)
    if rows:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
