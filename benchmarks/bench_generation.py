#!/usr/bin/env python3
"""Generation efficiency: colocate-rl's colocated generate phase against standalone vLLM, same engine and requests.

Per workload, in order (each stage a subprocess; a failing one is recorded with its exit code):

1. colocated: `colocate-rl train` (its defaults: colocate-rl's engine, micro-batch auto) for --steps steps, with the
   probe (benchmarks/generation_probe) recording what each rank sends to vLLM. Figures from rank 0 over the steps
   after --warmup: `time/generate_s` of metrics.jsonl (the generate phase, exclusive of wake/weight sync/sleep:
   colocate_rl/rank/telemetry.py) and the completion tokens rank 0 generated (probe; else completions/mean_length ×
   completions per rank).
2. same: standalone vLLM in a separate process on the first GPU (benchmarks/generation_vllm.py) with the engine
   arguments the run's rank 0 passed to `vllm.LLM`, rebuilt from the run directory (launch.json's EngineOptions
   and TRL arguments, through colocate-rl's own `VLLMEngine.llm_kwargs`), the same prompt token ids (rank
   0's recorded generations, batch k = generation k) and the run's SamplingParams (variant `trl`), timed over the same
   number of batches after the same warm-up; other variants change one thing each (generation_vllm.VARIANTS).
3. timed: the colocated run again without the probe (run directory runs/NAME.timed): its generate phase is the
   ratio's numerator when it ran (tokens from completions/mean_length). The probe slows the phase it measures
   (docs/benchmarks/README.md, issue 28's generation efficiency unprobed).
4. mp: the same as same with vLLM's default engine-core process (no `distributed_executor_backend`).
5. trl: the colocated run again with TRL's engine and the micro-batch as written (TRL_ENGINE: what TRL's own colocate
   mode does with the recipe), run directory runs/NAME.trl; the row's `vs_trl_engine` = its s/step ÷ colocated's.

ratio = colocated tokens/s (the timed run's where it ran, else the probed run's) ÷ standalone (same engine, variant
trl) tokens/s: 1 is parity, 0.5 half the speed.

    python benchmarks/bench_generation.py --out OUT --workloads a16,a128 --devices 0
    python benchmarks/bench_generation.py --out OUT --workloads b256 --devices 0,1
    python benchmarks/bench_generation.py --out OUT --workloads c256 --devices 0 --model DIR --data FILE.jsonl
    python benchmarks/bench_generation.py --out OUT --table        # table.md from every results.jsonl row so far

`--dry-run` prints the commands and runs nothing. `--stages` runs part of it (e.g. `same,mp` on an existing run).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # colocate_rl from this checkout, installed or not
PROBE_PATH = ROOT / "benchmarks" / "generation_probe"
STANDALONE = ROOT / "benchmarks" / "generation_vllm.py"
STEPS, WARMUP = 12, 2  # 10 measured steps
STAGES = ("colocated", "timed", "same", "mp", "trl")
TRL_ENGINE = ["generation.engine=trl", "trainer.micro_batch_size=null"]  # stage trl: ≈ TRL's own colocate mode
TRAINING_STAGES, PROBED_STAGES = ("colocated", "timed", "trl"), ("colocated", "trl")  # `colocate-rl train` runs
SAME_VARIANTS, MP_VARIANTS = "trl,detok,lean", "trl,lean"
# 1 GPU: no DeepSpeed, as bench_engine.py; the layout recipe's sleep level 2 back to colocate-rl's default (auto)
PLAIN = ["distributed.deepspeed=null", "distributed.zero_stage=null", "generation.sleep_level=auto"]
WORKLOADS = {  # name: (GPUs, recipe, --set overrides); completions per rank = per_device_train_batch_size × GA
    "a16": (1, "recipes/gpu-0.5b-layout.yaml", PLAIN + ["distributed.nproc_per_node=1"]),
    "a128": (
        1,
        "recipes/gpu-0.5b-layout.yaml",
        PLAIN + ["distributed.nproc_per_node=1", "trainer.gradient_accumulation_steps=8"],
    ),
    "b256": (
        2,
        "recipes/gpu-1.5b-layout-zero3.yaml",
        [
            "distributed.nproc_per_node=2",
            "trainer.per_device_train_batch_size=16",
            "trainer.gradient_accumulation_steps=8",
            "trainer.max_completion_length=512",
            "generation.max_model_length=768",
        ],
    ),
    "c256": (
        1,
        "recipes/smollm2-135m-gsm8k.yaml",
        ["distributed.nproc_per_node=1", "trainer.gradient_accumulation_steps=8", "eval.every_steps=null"],
    ),
}
NEEDS_MODEL = {"c256"}  # a local model directory (--model) and GSM8K-style jsonl (--data: question, answer)


def run_dir(out: Path, name: str, stage: str = "colocated") -> Path:
    return out / "runs" / (name if stage == "colocated" else f"{name}.{stage}")


def standalone_out(out: Path, name: str, stage: str) -> Path:
    return out / "standalone" / f"{name}.{stage}.json"


def colocated_command(name: str, base: str, out: Path, args: argparse.Namespace, stage: str = "colocated") -> list[str]:
    """`colocate-rl train` of the workload; stage trl: with TRL_ENGINE, after the experiment's --set."""
    _, recipe, sets = WORKLOADS[base]
    # the engine in the rank, generating in turn with training (the engine process: --set generation.engine_process=true)
    sets = sets + [f"trainer.max_steps={args.steps}", "output.save_model=false", "generation.overlap=off"]
    if base in NEEDS_MODEL:
        sets += [f"model.name={Path(args.model).resolve()}", f"data.source={Path(args.data).resolve()}"]
    argv = [sys.executable, "-m", "colocate_rl", "train", recipe, "--run-dir", str(run_dir(out, name, stage))]
    for item in sets + list(args.set) + (TRL_ENGINE if stage == "trl" else []):
        argv += ["--set", item]
    return argv


def standalone_command(name: str, stage: str, out: Path, args: argparse.Namespace) -> list[str]:
    argv = [
        sys.executable,
        str(STANDALONE.relative_to(ROOT)),
        "--run-dir",
        str(run_dir(out, name)),
        "--engine",
        stage,
        "--variants",
        args.variants if stage == "same" else args.mp_variants,
        "--warmup",
        str(args.warmup),
        "--batches",
        str(args.steps - args.warmup),
        "--out",
        str(standalone_out(out, name, stage)),
    ]
    for item in args.override:
        argv += ["--override", item]
    return argv


def stage_env(base: str, stage: str, args: argparse.Namespace) -> dict[str, str]:
    """Variables the stage adds: its GPUs, and for the colocated run the probe."""
    gpus = WORKLOADS[base][0]
    devices = args.devices.split(",")
    trains = stage in TRAINING_STAGES
    env = {"CUDA_VISIBLE_DEVICES": ",".join(devices[:gpus] if trains else devices[:1]), "PYTHONPATH": str(ROOT)}
    if stage in PROBED_STAGES:
        env.update(PYTHONPATH=os.pathsep.join([str(PROBE_PATH), str(ROOT)]), COLOCATE_BENCH_PROBE="1")
    for item in args.env:
        key, _, value = item.partition("=")
        env[key] = value
    return env


def shown(env: dict[str, str], argv: list[str]) -> str:
    return " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " + shlex.join(argv)


def run_stage(argv: list[str], env: dict[str, str], log: Path, timeout: float | None) -> tuple[int, float]:
    """Run one stage in its own process group (a timeout stops torchrun's ranks too); (exit code, seconds)."""
    full = {**os.environ, **env, "COLUMNS": "200"}
    if "PYTHONPATH" in env and os.environ.get("PYTHONPATH"):
        full["PYTHONPATH"] = env["PYTHONPATH"] + os.pathsep + os.environ["PYTHONPATH"]
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.time()
    with log.open("w") as f:
        proc = subprocess.Popen(argv, cwd=ROOT, env=full, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            code = 124
    return code, time.time() - start


# ---------------------------------------------------------------------------------------------- figures


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def _rate(tokens: list[float], seconds: list[float]) -> float | None:
    return round(sum(tokens) / sum(seconds), 1) if tokens and sum(seconds) > 0 else None


def completions_per_rank(trl_args: dict) -> int:
    steps = trl_args.get("steps_per_generation") or trl_args.get("gradient_accumulation_steps", 1)
    return trl_args["per_device_train_batch_size"] * steps


def colocated_figures(path: Path, warmup: int) -> dict:
    """Rank 0's generate phase over the measured steps: seconds and tokens per batch, tokens/s; from the probe also
    the seconds inside `llm.generate`, in the engine's logprob extraction and in the garbage collector."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import generation_vllm as G
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    from colocate_rl.rundir import step_records

    steps = [r for r in step_records(path) if r.get("time/generate_s") is not None]
    engine, calls, extract = G.read_probe(path)
    measured = steps[warmup:]
    fig: dict = {"steps": len(steps), "measured": len(measured)}
    if not measured:
        return fig
    seconds = [r["time/generate_s"] for r in measured]
    if len(calls) >= len(steps):
        tokens = [c["completion_tokens"] for c in calls[warmup : len(steps)]]
        fig["tokens_from"] = "probe"
    else:
        spec = json.loads((path / "launch.json").read_text())
        per_rank = completions_per_rank(spec["trl_args"])
        tokens = [r["completions/mean_length"] * per_rank for r in measured]
        fig["tokens_from"] = "completions/mean_length"
    fig.update(
        s_per_batch=_median(seconds),
        tokens_per_batch=_median(tokens),
        tokens_per_s=_rate(tokens, seconds),
        completion_mean_length=_median(
            [r.get("completions/mean_length") for r in measured if "completions/mean_length" in r]
        ),
        telemetry_tokens_per_s=_median([r["gen/tokens_per_s"] for r in measured if "gen/tokens_per_s" in r]),
    )
    timed = calls[warmup : len(steps)]
    if timed:
        fig.update(
            requests=timed[0]["requests"],
            llm_generate_s=_median([c["llm_generate_s"] for c in timed]),
            extract_s=_median([extract[c["call"]] for c in timed if c["call"] in extract]),
            gc_s=_median([c.get("gc_s", 0.0) for c in timed]),
            gc_tracked_objects=calls[0].get("gc_tracked_objects"),
            sampling=timed[0].get("sampling"),
        )
    fig.update(step_figures(measured))
    if engine is not None:
        fig["config"] = engine.get("config")
        fig["gc_off"] = engine.get("gc_off")
    return fig


STEP_KEYS = ("time/train_s", "time/weight_sync_s", "time/wake_s", "time/sleep_s", "time/optimizer_s")


def step_figures(measured: list[dict]) -> dict:
    """The whole step over the measured steps: s/step (median of the wall_s differences, so the first measured step
    only opens the first difference), its phases (medians) and the GPU peak (max, NVML)."""
    walls = [r["wall_s"] for r in measured if "wall_s" in r]
    fig: dict = {"s_per_step": _median([b - a for a, b in zip(walls, walls[1:])])}
    for key in STEP_KEYS:
        fig[key.split("/")[1]] = _median([r[key] for r in measured if r.get(key) is not None])
    if fig["wake_s"] is not None or fig["sleep_s"] is not None:
        fig["wake_sleep_s"] = round((fig["wake_s"] or 0) + (fig["sleep_s"] or 0), 4)
    peaks = [r["mem/gpu_peak_gib"] for r in measured if r.get("mem/gpu_peak_gib") is not None]
    fig["gpu_peak_gib"] = max(peaks) if peaks else None
    return fig


def standalone_figures(path: Path, warmup: int) -> dict:
    data = json.loads(path.read_text())
    fig = {"config": data.get("config"), "llm_kwargs": data.get("llm_kwargs"), "variants": {}}
    for name, variant in data.get("variants", {}).items():
        rows = variant["batches"][warmup:]
        seconds, tokens = [r["s"] for r in rows], [r["tokens"] for r in rows]
        fig["variants"][name] = {
            "s_per_batch": _median(seconds),
            "tokens_per_batch": _median(tokens),
            "tokens_per_s": _rate(tokens, seconds),
            "post_s": _median([r["post_s"] for r in rows if "post_s" in r]),
            "gc_s": _median([r.get("gc_s", 0.0) for r in rows]),
            "sampling": variant.get("sampling"),
        }
        if "agreement" in variant:  # rescore: its second call's time and how its logprobs agree with the sampler's
            fig["variants"][name]["rescore_s"] = _median([r["rescore_s"] for r in rows])
            fig["variants"][name]["agreement"] = variant["agreement"]
    return fig


def figures(name: str, out: Path, warmup: int, exits: dict[str, int], commands: list[str]) -> dict:
    """One results row of a workload from the files its stages left (any stage may be missing)."""
    base = name.split("+")[0]
    row: dict = {"workload": name, "gpus": WORKLOADS[base][0], "exits": exits, "commands": commands}
    path = run_dir(out, name)
    if (path / "metrics.jsonl").exists():
        row["colocated"] = colocated_figures(path, warmup)
    for stage in ("same", "mp"):
        file = standalone_out(out, name, stage)
        if file.exists():
            row[stage] = standalone_figures(file, warmup)
    if (run_dir(out, name, "timed") / "metrics.jsonl").exists():
        row["timed"] = colocated_figures(run_dir(out, name, "timed"), warmup)
    if (run_dir(out, name, "trl") / "metrics.jsonl").exists():
        row["trl_engine"] = colocated_figures(run_dir(out, name, "trl"), warmup)
        ours, theirs = (row.get("colocated") or {}).get("s_per_step"), row["trl_engine"].get("s_per_step")
        if ours and theirs:
            row["vs_trl_engine"] = round(theirs / ours, 3)
    timed = (row.get("timed") or {}).get("tokens_per_s")
    colocated = timed or (row.get("colocated") or {}).get("tokens_per_s")
    same = ((row.get("same") or {}).get("variants") or {}).get("trl") or {}
    if colocated and same.get("tokens_per_s"):
        row["ratio"] = round(colocated / same["tokens_per_s"], 3)
        row["ratio_from"] = "timed" if timed else "colocated (probed)"
        row["sampling_match"] = row["colocated"].get("sampling") == same.get("sampling")
        config_c, config_s = row["colocated"].get("config") or {}, row["same"].get("config") or {}
        row["config_diff"] = {
            k: [config_c.get(k), config_s.get(k)] for k in config_c if config_c.get(k) != config_s.get(k)
        }
    return row


def _get(row: dict, key: str):
    value = row
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


TABLE_COLUMNS = [
    ("workload", "workload"),
    ("completions/rank", "colocated.requests"),
    ("s/step", "colocated.s_per_step"),
    ("TRL engine s/step", "trl_engine.s_per_step"),
    ("× vs TRL engine", "vs_trl_engine"),
    ("train s", "colocated.train_s"),
    ("weight sync s", "colocated.weight_sync_s"),
    ("wake+sleep s", "colocated.wake_sleep_s"),
    ("GPU peak GiB", "colocated.gpu_peak_gib"),
    ("colocated s/batch", "colocated.s_per_batch"),
    ("colocated tok/s", "colocated.tokens_per_s"),
    ("of which in LLM.generate s", "colocated.llm_generate_s"),
    ("TRL logprob extraction s", "colocated.extract_s"),
    ("GC s in LLM.generate", "colocated.gc_s"),
    ("unprobed s/batch", "timed.s_per_batch"),
    ("unprobed tok/s", "timed.tokens_per_s"),
    ("standalone s/batch", "same.variants.trl.s_per_batch"),
    ("standalone tok/s", "same.variants.trl.tokens_per_s"),
    ("ratio colocated/standalone", "ratio"),
    ("standalone detok tok/s", "same.variants.detok.tokens_per_s"),
    ("standalone lean tok/s", "same.variants.lean.tokens_per_s"),
    ("standalone rescore s/batch", "same.variants.rescore.s_per_batch"),
    ("rescore's prefill s", "same.variants.rescore.rescore_s"),
    ("rescore vs sampled logprobs, max abs diff", "same.variants.rescore.agreement.max_abs"),
    ("mp-engine trl tok/s", "mp.variants.trl.tokens_per_s"),
    ("mp-engine lean tok/s", "mp.variants.lean.tokens_per_s"),
    ("max_num_seqs", "colocated.config.max_num_seqs"),
    ("CUDA graph max size", "colocated.config.max_cudagraph_capture_size"),
    ("exits", "exits"),
]
TABLE_NOTE = (
    "ratio = colocated tokens/s (unprobed where the timed stage ran, else probed) ÷ standalone tokens/s (same engine "
    "arguments, prompts and TRL SamplingParams, one GPU; 1 = parity, 0.5 = half the speed). Per rank (rank 0), median "
    "over the measured batches; tok/s = tokens ÷ seconds summed over them. detok / lean / mp-engine: the standalone "
    "with detokenize=True (TRL's own engine) / with no logprobs and no detokenization / with vLLM's own engine-core "
    "process (benchmarks/generation_vllm.py); rescore: lean, then the sampled tokens' logprobs from one prefill of "
    "prompt + completion (both calls in its s/batch). TRL engine: the "
    "same run with generation.engine trl and the micro-batch as written (≈ TRL's own colocate mode); × = its s/step "
    "÷ colocate-rl's.\n"
)


def table(results: list[dict]) -> str:
    """The last row of each workload, in first-seen order."""
    last: dict[str, dict] = {}
    for r in results:
        last[r["workload"]] = r
    lines = ["| " + " | ".join(h for h, _ in TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
    for r in last.values():
        cells = []
        for _, key in TABLE_COLUMNS:
            value = _get(r, key)
            if isinstance(value, dict):
                value = " ".join(f"{k}:{v}" for k, v in value.items())
            cells.append("" if value is None else str(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\n" + TABLE_NOTE


# ---------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--workloads", default="a16,a128", help=f"comma-separated, of {', '.join(WORKLOADS)}, or all")
    parser.add_argument("--devices", default="0,1", help="GPU ids; a workload takes as many as it needs, first first")
    parser.add_argument("--steps", type=int, default=STEPS, help="training steps = generations (colocated)")
    parser.add_argument("--warmup", type=int, default=WARMUP, help="first generations left out of the figures")
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, of {','.join(STAGES)}")
    parser.add_argument("--variants", default=SAME_VARIANTS, help="standalone variants, same engine")
    parser.add_argument("--mp-variants", default=MP_VARIANTS, help="standalone variants, vLLM's engine-core process")
    parser.add_argument("--model", help="c256: local model directory (SmolLM2-135M-Instruct)")
    parser.add_argument("--data", help="c256: GSM8K-style jsonl (question, answer)")
    parser.add_argument("--set", action="append", default=[], help="extra recipe override for the colocated runs")
    parser.add_argument("--override", action="append", default=[], help="extra engine argument for the standalone")
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE for every stage (e.g. VLLM_GC_DEBUG=1)")
    parser.add_argument("--tag", help="suffix of the workload names (name+TAG) for an experiment with --set/--env")
    parser.add_argument("--timeout", type=float, help="seconds per stage")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--table", action="store_true", help="only rewrite table.md from results.jsonl")
    args = parser.parse_args(argv)
    bases = list(WORKLOADS) if args.workloads == "all" else [w for w in args.workloads.split(",") if w]
    stages = [s for s in args.stages.split(",") if s]
    problems = [f"unknown workload {w}; known: {', '.join(WORKLOADS)}" for w in bases if w not in WORKLOADS]
    problems += [f"unknown stage {s}; known: {', '.join(STAGES)}" for s in stages if s not in STAGES]
    if not args.table:
        if any(w in NEEDS_MODEL for w in bases) and not (args.model and args.data):
            problems.append("c256 needs --model DIR (SmolLM2-135M-Instruct) and --data FILE.jsonl (question, answer)")
        if not 0 <= args.warmup < args.steps:
            problems.append("--warmup must be below --steps")
        for w in bases:
            if w in WORKLOADS and WORKLOADS[w][0] > len(args.devices.split(",")):
                problems.append(f"{w} needs {WORKLOADS[w][0]} GPUs; --devices gives {args.devices}")
    if problems:
        for p in problems:
            print(f"error: {p}", file=sys.stderr)
        return 2
    results_file = args.out / "results.jsonl"
    if not args.table:
        for base in bases:
            name = f"{base}+{args.tag}" if args.tag else base
            exits, commands = {}, []
            for stage in stages:
                if stage in TRAINING_STAGES:
                    argv = colocated_command(name, base, args.out, args, stage)
                else:
                    argv = standalone_command(name, stage, args.out, args)
                env = stage_env(base, stage, args)
                commands.append(shown(env, argv))
                if args.dry_run:
                    print(commands[-1])
                    continue
                if stage in ("same", "mp") and not (run_dir(args.out, name) / "bench").is_dir():
                    exits[stage] = "skipped: no probe records of a colocated run"
                    continue
                log = args.out / "logs" / f"{name}.{stage}.log"
                code, seconds = run_stage(argv, env, log, args.timeout)
                exits[stage] = code
                print(json.dumps({"workload": name, "stage": stage, "exit": code, "s": round(seconds, 1)}), flush=True)
            if args.dry_run:
                continue
            row = figures(name, args.out, args.warmup, exits, commands)
            with results_file.open("a") as f:
                f.write(json.dumps(row) + "\n")
            summary = {k: row.get(k) for k in ("workload", "ratio", "vs_trl_engine", "sampling_match", "exits")}
            print(json.dumps(summary), flush=True)
    if args.dry_run:
        return 0
    from colocate_rl.rundir import read_jsonl

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text(table(read_jsonl(results_file)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
