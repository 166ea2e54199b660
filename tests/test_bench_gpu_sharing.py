"""benchmarks/bench_gpu_sharing.py without a GPU: the stages it runs and that each stage starts its processes on one
common start time (the GPU figures: docs/benchmarks, "Overlap (issue 28)")."""

import subprocess
import sys

from conftest import ROOT


def test_dry_run_lists_each_stage_with_processes_sharing_one_start_time():
    out = subprocess.run(
        [sys.executable, "benchmarks/bench_gpu_sharing.py", "--out", "unused", "--dry-run"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    stages = [line for line in out.splitlines() if not line.startswith("  ")]
    assert stages == ["alone", "alone", "timesliced", "timesliced", "mps", "mps"]
    shared = [line.split()[-1] for line in out.splitlines()[5:7]]  # the first time-sliced stage's two processes
    assert len(set(shared)) == 1 and [line.split()[-3] for line in out.splitlines()[5:7]] == ["small", "big"]
