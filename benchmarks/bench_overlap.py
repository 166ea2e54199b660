#!/usr/bin/env python3
"""Overlap (issue 28), side by side in one invocation on one GPU: colocate-rl with `generation.overlap: one_step`,
colocate-rl without (`off`; `process`: without, the engine in its own process, for its generation speed alone;
`overlap-mps`: with, `generation.mps: on`, `overlap-2e-mps` the same with two engine processes, `overlap-prio-mps`
the same with the trainer at NVIDIA's below-normal MPS client priority and the engine process at normal,
`overlap-cap-mps` the same with the trainer's kernels on at most 75 % of the GPU's SMs and the engine's on all,
`overlap-2e-prio-mps` prio's with two engine processes (each CPU-bound loop on half the batch, should priority bring
the engine back near its speed alone, where one thread's loop was the limit), `overlap-prio-ecap50-mps` and
`overlap-prio-ecap70-mps` prio's with the engine's kernels on at most 50 or 70 % of the SMs (in S priority alone sped
the engine's batch to 3.0-3.2 s and slowed training to 4.3-4.7: a cap on the engine leaves training the rest); every
other colocate-rl arm sets `generation.mps` off, as measured before it existed;
`overlap-mp`: with, vLLM's engine core in a process of its own beside the engine process; `overlap-plain`: with,
the trainer without DeepSpeed, fp32 weights under bf16 autocast; `overlap-omp1`: with, every process of the run at
one torch CPU thread, as vLLM sets its own multiprocess workers against CPU contention; `process` and `overlap`
run as many engine processes as `generation.engine_processes: auto` chooses (two for SmolLM2-135M since 2026-12-04,
one before), `process-1e`, `overlap-1e` one, `process-2e`, `overlap-2e` two (each generating half of every batch),
`process-4e`, `overlap-4e` four; `overlap-nogroup`: with, TRL's micro-batches as TRL cuts them,
`trainer.length_grouping: false`), and TRL's own GRPOTrainer (benchmarks/trl_grpo.py, micro-batch set by hand: `trl` at share 0.3,
`trl-lean` at the share one batch needs with the larger micro-batch, `trl-mb32` at 32 × 8 without gradient
checkpointing), in the order given (default A-B-C-A-B-C), on
256 completions per step of recipes/smollm2-135m-gsm8k.yaml's task.

Workloads: `c256` SmolLM2-135M-Instruct (`--model`); `d256` a random-init model of SmolLM2-1.7B's shape with the same
tokenizer, built once into OUT/smollm2-1.7b-shape from `--model` (config changed, weights random, bf16); `arith` the
same learning with and without overlap (issue 28's target): SmolLM2-135M-Instruct on `builtin:arithmetic` with
math_verify, 8 prompts × 8 completions per step, held-out greedy evaluation of 200 prompts every 20 steps and after
the last, for each seed of `--seeds` (arms overlap and off only; the rows add the held-out curve).

    python benchmarks/bench_overlap.py --out OUT --model DIR --data FILE.jsonl --workload c256 --steps 12
    python benchmarks/bench_overlap.py --out OUT --model DIR --workload arith --steps 120 --order overlap,off --seeds 0,1
    python benchmarks/bench_overlap.py ... --workload arith ... --concurrent   # learning curves only, all runs at once
    python benchmarks/bench_overlap.py --out OUT --table

Per run: s/step = the median of the step-to-step wall-clock intervals from step 3 on (step 1 compiles and generates
without overlap, step 2 is the first overlapped one); colocate-rl's phase medians over the same steps; the GPU's peak
memory used (NVML, sampled every 0.2 s over the whole run, all processes); exit code. Rows are appended to
OUT/results.jsonl as runs end; OUT/table.md holds the table. `--dry-run` prints the commands.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from colocate_rl.plan.host import ENGINE_PRIORITY, ENGINE_THREADS, PRIORITY, THREADS  # noqa: E402 (after the path above)

RECIPE = "recipes/smollm2-135m-gsm8k.yaml"
# process: no overlap, the engine in its own process; overlap-mps: overlap under colocate-rl's CUDA MPS daemon
ARMS = ("overlap", "off", "process", "trl", "trl-lean", "trl-mb32", "overlap-mps", "overlap-2e-mps", "overlap-prio-mps",
        "overlap-cap-mps", "overlap-2e-prio-mps", "overlap-prio-ecap50-mps", "overlap-prio-ecap70-mps", "overlap-mp", "overlap-plain", "overlap-omp1",
        "process-1e", "process-2e", "process-4e", "overlap-1e", "overlap-2e", "overlap-4e", "overlap-nogroup")  # fmt: skip
ARM_SETS = {  # what an arm sets beyond overlap on or off (its docstring entry says why)
    "process": ["generation.engine_process=true"],
    "overlap-mp": ["generation.vllm_multiprocessing=true"],
    "overlap-plain": ["distributed.zero_stage=null", "model.dtype=float32"],  # no DeepSpeed, fp32 master weights
    "process-1e": ["generation.engine_process=true", "generation.engine_processes=1"],
    "process-2e": ["generation.engine_process=true", "generation.engine_processes=2"],
    "process-4e": ["generation.engine_process=true", "generation.engine_processes=4"],
    "overlap-1e": ["generation.engine_processes=1"],
    "overlap-2e": ["generation.engine_processes=2"],
    "overlap-2e-mps": ["generation.engine_processes=2"],
    "overlap-2e-prio-mps": ["generation.engine_processes=2"],
    "overlap-4e": ["generation.engine_processes=4"],
    "overlap-nogroup": ["trainer.length_grouping=false"],
}
ARM_ENV = {  # the plan and the MPS wrapper leave a variable the user set alone
    "overlap-omp1": {"OMP_NUM_THREADS": "1"},
    "overlap-prio-mps": {PRIORITY: "1", ENGINE_PRIORITY: "0"},  # trainer below normal, engine normal
    "overlap-2e-prio-mps": {PRIORITY: "1", ENGINE_PRIORITY: "0"},
    "overlap-prio-ecap50-mps": {PRIORITY: "1", ENGINE_PRIORITY: "0", ENGINE_THREADS: "50"},  # engine first, on half
    "overlap-prio-ecap70-mps": {PRIORITY: "1", ENGINE_PRIORITY: "0", ENGINE_THREADS: "70"},
    "overlap-cap-mps": {THREADS: "75", ENGINE_THREADS: "100"},  # trainer on 75 % of the SMs, engine on all
}
PHASES = ("generate", "prepare", "reward", "train", "weight_sync", "optimizer")
SHAPE_1P7B = dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=32,
                  intermediate_size=8192)  # fmt: skip
# TRL by hand: `trl` the best micro-batch that fits at the share 0.3 (stack facts); `trl-lean` the whole step in one
# micro-batch at the share one batch needs (as colocate-rl's `auto` plans c256), in case that is faster for TRL too
# (micro-batch, accumulation, share, gradient checkpointing): at d256 TRL's default checkpointing stays on (its
# GRPOConfig's; 128 x 2 without it would need ~150 GiB of activations), as in the 10.21 s/step issue 28 quotes;
# `trl-mb32` the micro-batch colocate-rl's plan takes at d256 (32 x 8) without checkpointing, in case TRL is faster so
TRL_BY_HAND = {
    ("trl", "c256"): (128, 2, 0.3, False),
    ("trl", "d256"): (128, 2, 0.3, True),
    ("trl-lean", "c256"): (256, 1, 0.1, False),
    ("trl-lean", "d256"): (128, 2, 0.25, True),
    ("trl-mb32", "c256"): (32, 8, 0.3, False),
    ("trl-mb32", "d256"): (32, 8, 0.3, False),
}
# --concurrent: runs on the GPU at once. On the H200 eight arith runs at once (two of them with two engine processes)
# ran out of GPU memory as they started (2026-12-05, invocation N-arith); four ran in F-arith and I-arith, six in N.
AT_ONCE = 4
CONCURRENT_KV = "2GiB"  # --concurrent: each run's KV cache (135M: ~90k tokens; a step needs 64 x <= 512)
ARITH = [  # the learning workload: a task SmolLM2-135M learns (stack facts: held-out 0.115 -> 0.295 in 120 steps)
    "data.source=builtin:arithmetic",
    "data.prompt_field=prompt",
    "data.subset=null",
    "rewards=[{name: math_verify}]",
    "trainer.gradient_accumulation_steps=2",  # 8 prompts x 8 completions per step
    "eval.every_steps=20",
    "eval.num_samples=200",
]


def build_1p7b(src: Path, out: Path) -> Path:
    """SmolLM2-1.7B's shape with `src`'s tokenizer, random weights (seed 0), bf16; built once."""
    if (out / "config.json").is_file():
        return out
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(src)
    for key, value in SHAPE_1P7B.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template", "generation_config")):
            shutil.copy(f, tmp / f.name)
    tmp.rename(out)
    return out


def command(
    arm: str, workload: str, model: Path, data: Path | None, run: Path, steps: int, sets: list[str], seed: int = 0
) -> list[str]:
    if arm.startswith("trl"):
        mb, ga, share, checkpointing = TRL_BY_HAND[arm, workload]
        return [sys.executable, "benchmarks/trl_grpo.py", "--model", str(model), "--data", str(data), "--out",
                str(run), "--steps", str(steps), "--micro-batch", str(mb), "--grad-accum", str(ga),
                "--share", str(share)] + ["--gradient-checkpointing"] * checkpointing  # fmt: skip
    speed = [f"data.source={data}", "eval.every_steps=null", "trainer.gradient_accumulation_steps=8"]  # 32 x 8
    items = [
        f"model.name={model}",
        *(ARITH if workload == "arith" else speed),
        f"trainer.max_steps={steps}",
        f"trainer.seed={seed}",
        f"generation.overlap={'one_step' if arm.startswith('overlap') else 'off'}",
        f"generation.mps={'on' if arm.endswith('-mps') else 'off'}",
        *ARM_SETS.get(arm, []),
        *sets,
    ]
    argv = [sys.executable, "-m", "colocate_rl", "train", RECIPE, "--run-dir", str(run)]
    for item in items:
        argv += ["--set", item]
    return argv


class PeakMemory(threading.Thread):
    """The GPU's used memory (NVML, all processes), its maximum over the thread's life, in GiB."""

    def __init__(self, index: int = 0):
        super().__init__(daemon=True)
        self.peak, self._done = 0.0, threading.Event()
        self.index = index

    def run(self) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(self.index)
        except Exception:  # no NVML (CPU machine): no figure
            return
        while not self._done.wait(0.2):
            self.peak = max(self.peak, pynvml.nvmlDeviceGetMemoryInfo(handle).used / 2**30)

    def stop(self) -> float:
        self._done.set()
        self.join(timeout=5)
        return round(self.peak, 2)


def step_rows(arm: str, run: Path) -> list[dict]:
    if arm.startswith("trl"):
        path = run / "steps.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    from colocate_rl.rundir import step_records

    return step_records(run)


def training_start(run: Path) -> float | None:
    """When rank 0 began its first step (epoch seconds, from its timeline), or None."""
    path = run / "timeline" / "rank0.jsonl"
    if not path.is_file():
        return None
    with path.open() as f:
        head = f.readline()
        if not head.strip():  # the rank failed before its first record
            return None
        t0 = json.loads(head)["t0"]
        first = next((json.loads(line) for line in f if '"phase"' in line), None)
    return None if first is None else t0 + first["t"]


STARTUP_LINES = ("torch.compile takes", "compiled graph", "Compiling a graph", "Graph capturing finished",
                 "Loading weights took", "ready; staging buffer", "init engine",
                 "CUDA MPS daemon", "MPS client settings")  # fmt: skip  # the last two: the MPS settings in effect


def startup_lines(run: Path, most: int = 16) -> list[str]:
    """The lines of a run's train.log that say where its start-up went (vLLM's compile or its cache, CUDA graphs,
    weights, the engine process ready), with vLLM's own timestamps."""
    log = run / "train.log"
    if not log.is_file():
        return []
    lines = log.read_text(errors="replace").splitlines()
    return [line[:300] for line in lines if any(key in line for key in STARTUP_LINES)][:most]


def figures(arm: str, run: Path, started: float | None = None) -> dict:
    rows = step_rows(arm, run)
    out: dict = {"steps": len(rows)}
    trl = arm.startswith("trl")
    begun = training_start(run) if not trl else None
    if begun is not None and started is not None:  # launch, model, engine start (vLLM's compile, graphs): until step 1
        out["startup_s"] = round(begun - started, 1)
    if not trl:
        out["startup_lines"] = startup_lines(run)
    later = [(a, b) for a, b in zip(rows, rows[1:]) if b["step"] >= 3 and b["step"] == a["step"] + 1]
    if later:
        out["s_per_step"] = round(statistics.median(b["wall_s"] - a["wall_s"] for a, b in later), 4)
        out["s_per_step_range"] = [round(min(b["wall_s"] - a["wall_s"] for a, b in later), 3),
                                   round(max(b["wall_s"] - a["wall_s"] for a, b in later), 3)]  # fmt: skip
    tail = [r for r in rows if r["step"] >= 3]
    if not trl and tail:
        out["phases_s"] = {p: round(statistics.median(r.get(f"time/{p}_s", 0.0) for r in tail), 4) for p in PHASES}
        out["overlap_ahead"] = [r.get("overlap/ahead") for r in rows]
        engine = [r["engine_process/generate_s"] for r in tail if "engine_process/generate_s" in r]
        if engine:  # the engine process's own generation time: beside training, against `off`'s generate phase
            out["engine_generate_s"] = round(statistics.median(engine), 4)
            # every step's, from step 1 (generated alone, the trainer waiting): its drift over the run and between runs
            out["engine_generate_steps"] = [round(r.get("engine_process/generate_s", float("nan")), 3) for r in rows]
            for key in ("cpu_s", "preempted"):  # whether its CPU was its own: CPU seconds, times the OS took it away
                values = [r[f"engine_process/{key}"] for r in tail if f"engine_process/{key}" in r]
                if values:
                    out[f"engine_{key}"] = round(statistics.median(values), 3)
        out["torch_peak_gib"] = max((r["mem/torch_peak_gib"] for r in rows if "mem/torch_peak_gib" in r), default=None)
        out["alloc_retries"] = sum(r.get("mem/alloc_retries", 0) for r in rows)  # GPU full: cache freed, retried
    if trl and rows:
        out["torch_peak_gib"] = max(r.get("torch_peak_gib", 0.0) for r in rows)
    if not trl:
        from colocate_rl.rundir import read_metrics

        evals = [r for r in read_metrics(run) if isinstance(r.get("eval/reward"), (int, float))]
        if evals:
            out["eval_reward"] = [[r["step"], round(r["eval/reward"], 4)] for r in evals]
    if rows:
        out["reward_first_last"] = [round(rows[0].get("reward", float("nan")), 4),
                                    round(rows[-1].get("reward", float("nan")), 4)]  # fmt: skip
    return out


def table(results: list[dict]) -> str:
    lines = ["| # | workload | arm | seed | s/step (range) | generate / prepare / reward / train / sync | "
             "GPU peak GiB (NVML) | reward first → last | held-out (step: reward) | exit |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        ph = r.get("phases_s")
        cells = " / ".join(f"{ph[p]:.3f}" for p in PHASES[:5]) if ph else "–"
        rng = r.get("s_per_step_range")
        s = f"{r['s_per_step']:.3f} ({rng[0]:.2f}–{rng[1]:.2f})" if r.get("s_per_step") else "–"
        fl = r.get("reward_first_last") or ["–", "–"]
        held = ", ".join(f"{step}: {v:.3f}" for step, v in r.get("eval_reward", [])) or "–"
        lines.append(f"| {r['order']} | {r['workload']} | {r['arm']} | {r.get('seed', 0)} | {s} | {cells} | "
                     f"{r.get('nvml_peak_gib')} | {fl[0]} → {fl[1]} | {held} | {r['exit']} |")  # fmt: skip
    by_arm: dict = {}
    for r in results:
        if r.get("s_per_step") and r["exit"] == 0:
            by_arm.setdefault((r["workload"], r["arm"]), []).append(r["s_per_step"])
    lines += [
        "",
        "| workload | arm | runs | pooled median s/step | × vs TRL (its faster setting) |",
        "|---|---|---|---|---|",
    ]
    for (w, arm), values in sorted(by_arm.items()):
        trls = [statistics.median(v) for (w2, a2), v in by_arm.items() if w2 == w and a2.startswith("trl")]
        ratio = f"{min(trls) / statistics.median(values):.2f}×" if trls else "–"  # against TRL's faster setting
        lines.append(f"| {w} | {arm} | {len(values)} | {statistics.median(values):.3f} | {ratio} |")
    return "\n".join(lines) + "\n"


class Run:
    """One run of the invocation: started in the background, its row appended to OUT/results.jsonl as it ends."""

    def __init__(self, order: int, arm: str, seed: int, name: str, run: Path, argv: list[str]):
        self.order, self.arm, self.seed, self.name, self.run, self.argv = order, arm, seed, name, run, argv

    def start(self, out: Path, env: dict) -> None:
        self.env = {**env, **ARM_ENV.get(self.arm, {})}
        self.peak = PeakMemory()
        self.peak.start()
        self.started = time.time()
        self.log = open(out / f"{self.name}.log", "w")  # noqa: SIM115 (closed in finish)
        self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=self.env, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_for_first_step(self, timeout: float) -> None:
        while self.proc.poll() is None and not step_rows(self.arm, self.run) and time.time() - self.started < timeout:
            time.sleep(2)

    def finish(self, a, results_file: Path, concurrent: bool) -> None:
        try:
            code = self.proc.wait(timeout=max(1.0, a.timeout - (time.time() - self.started)))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            code = 124
        self.log.close()
        row = {"order": self.order, "workload": a.workload, "arm": self.arm, "seed": self.seed, "exit": code,
               "wall_s": round(time.time() - self.started, 1), "nvml_peak_gib": self.peak.stop(),
               **figures(self.arm, self.run, self.started), "env": ARM_ENV.get(self.arm, {}),
               "command": shlex.join(self.argv)}  # fmt: skip
        if concurrent:  # runs shared the GPU: times and the GPU's peak are not this run's alone
            row.update(concurrent=True, s_per_step=None, nvml_peak_gib=None)
        with results_file.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps({k: v for k, v in row.items() if k != "command"}), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", type=Path, help="SmolLM2-135M-Instruct as a transformers directory")
    p.add_argument("--data", type=Path, help="gsm_symbolic_train.jsonl")
    p.add_argument("--workload", choices=("c256", "d256", "arith"), default="c256")
    p.add_argument("--seeds", default="0", help="trainer.seed of each run, comma-separated: the order runs per seed")
    p.add_argument("--order", default="overlap,off,trl,overlap,off,trl", help=f"arms, comma-separated: {ARMS}")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")
    p.add_argument("--set", dest="sets", action="append", default=[], help="to every colocate-rl run, last")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--concurrent", action="store_true",
                   help="learning only: the first run alone until it trains, then the others beside it on the GPU, "
                        "--at-once at a time (no s/step or GPU peak in their rows)")  # fmt: skip
    p.add_argument("--at-once", type=int, default=AT_ONCE, help=f"--concurrent: runs on the GPU at once ({AT_ONCE})")
    p.add_argument("--table", action="store_true", help="only rewrite OUT/table.md from OUT/results.jsonl")
    a = p.parse_args(argv)
    results_file = a.out / "results.jsonl"
    if a.table:
        results = [json.loads(x) for x in results_file.read_text().splitlines()]
        (a.out / "table.md").write_text(table(results))
        print(table(results))
        return 0
    order = a.order.split(",")
    if unknown := sorted(set(order) - set(ARMS)):
        p.error(f"--order: unknown arm(s) {unknown}; the arms are {', '.join(ARMS)}")
    if a.model is None or (a.data is None and a.workload != "arith"):
        p.error("--model and --data are needed (arith: --model)")
    if a.workload == "arith" and any(arm.startswith("trl") for arm in order):
        p.error("--order: the arith workload compares overlap and off only")
    if a.concurrent and any(arm.endswith("-mps") for arm in order):
        p.error("--concurrent: an -mps arm runs under an MPS daemon of its own (several on one GPU: untested)")
    if a.at_once < 1:
        p.error("--at-once: 1 or more")
    if a.concurrent and a.workload != "arith":
        p.error("--concurrent: only the arith workload (learning curves); timed workloads run one at a time")
    if a.concurrent:  # a fixed KV cache: vLLM then does not size it from a GPU the other runs are filling
        a.sets = [f"generation.kv_cache_memory={CONCURRENT_KV}", *a.sets]
    seeds = [int(x) for x in a.seeds.split(",")]
    a.out.mkdir(parents=True, exist_ok=True)
    model = a.model
    if a.workload == "d256" and not a.dry_run:
        model = build_1p7b(a.model, a.out / "smollm2-1.7b-shape")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    runs = []
    for k, (arm, seed) in enumerate([(arm, seed) for seed in seeds for arm in order], start=1):
        name = f"{a.workload}-{k}-{arm}" + (f"-s{seed}" if len(seeds) > 1 else "")
        runs.append(Run(k, arm, seed, name, a.out / name, command(arm, a.workload, model, a.data, a.out / name,
                                                                  a.steps, a.sets, seed)))  # fmt: skip
    for run in runs:
        print(f"[{run.order}/{len(runs)}] {shlex.join(run.argv)}", flush=True)
    if not a.dry_run and a.concurrent:  # the first alone until it trains (vLLM's compile cached), then in waves
        runs[0].start(a.out, env)
        runs[0].wait_for_first_step(a.timeout)
        for w in range(0, len(runs), a.at_once):
            wave = runs[w : w + a.at_once]
            for run in wave[1 if w == 0 else 0 :]:
                run.start(a.out, env)
            for run in wave:
                run.finish(a, results_file, concurrent=True)
    elif not a.dry_run:
        for run in runs:
            run.start(a.out, env)
            run.finish(a, results_file, concurrent=False)
    if not a.dry_run:
        results = [json.loads(x) for x in results_file.read_text().splitlines()]
        (a.out / "table.md").write_text(table(results))
        print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
