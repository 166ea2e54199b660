#!/usr/bin/env python3
"""Benchmark of trainer layouts on one node of 2 GPUs (issue #8): `zero_stage: auto` against forced ZeRO-3, forced
ZeRO-2, plain DDP and TRL's server mode, on the random-init Qwen2.5-1.5B layout (recipes/gpu-1.5b-layout-zero3.yaml
with --set overrides), digits task, sleep mode on.

Per step: 32 completions of up to 256 tokens (`--completion-length`, vLLM's `--max-model-len` 512;
per_device_train_batch_size 16 × 2 ranks, num_generations 8); the
larger-batch rows take 256 completions per step (the same micro-batch, gradient_accumulation_steps 8, one
generation per optimizer step). Server mode: `trl vllm-serve` on GPU 1 and TRL's GRPOTrainer on GPU 0 with
vllm_mode="server", micro-batch 16 × gradient_accumulation_steps 2 = the same 32 completions per optimizer step
(server-256: × 16 = 256).

Use a fresh --out directory (a run directory that holds a finished run is refused). Each row runs with a timeout; a failing row is recorded and the next one runs. s/step is the median of the
differences of `wall_s` in the run's metrics.jsonl over the steps after the first (the first holds the warm-up);
`time/*_s` medians come from the same steps. Writes OUT/results.jsonl (one object per row) and OUT/results.md.

    python benchmarks/bench_layouts.py --out bench-out                 # all rows, 12 steps each (2 GPUs)
    python benchmarks/bench_layouts.py --out bench-out --rows auto,zero3 --steps 20
    python benchmarks/bench_layouts.py --out bench-out --dry-run       # print the exact commands, run nothing
    python benchmarks/bench_layouts.py --out bench-out --rows server-256 --completion-length 512 --max-model-len 768
                                         # TRL's server mode on issue 19's workload (b) (bench_generation.py b256)
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
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "gpu-1.5b-layout-zero3.yaml"
LAYOUT, SEED, MAX_MODEL_LEN, COMPLETION, GROUP, MICRO = "qwen2.5-1.5b", 0, 512, 256, 8, 16
AUTO = ["distributed.deepspeed=null", "distributed.zero_stage=auto", "trainer.gradient_checkpointing=auto"]
ZERO3 = ["distributed.deepspeed=zero3", "distributed.zero_stage=3"]
BIG = ["trainer.gradient_accumulation_steps=8"]  # 16 × 2 ranks × 8 = 256 completions per step
# row → (--set overrides of the colocated run, completions per step); "server…" rows are TRL's server mode
ROWS: dict[str, tuple[list[str], int]] = {
    "auto": (AUTO, 32),
    "zero3": (ZERO3, 32),
    "zero2": (["distributed.deepspeed=zero3", "distributed.zero_stage=2"], 32),
    "ddp": (["distributed.deepspeed=null", "distributed.zero_stage=null"], 32),
    "server": ([], 32),
    "auto-256": (AUTO + BIG, 256),
    "zero3-256": (ZERO3 + BIG, 256),
    "server-256": ([], 256),  # one trainer rank: micro-batch 16 × 16 accumulation steps
}

SERVER_TRAINER = '''"""TRL GRPOTrainer in server mode (written by benchmarks/bench_layouts.py): one rank, vLLM served elsewhere."""
import json, sys, time
from pathlib import Path

from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from colocate_rl.builtin_model import load_tokenizer
from colocate_rl.prompts import load_prompts
from colocate_rl.rewards import digit_share

model, run_dir, base_url, steps = sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
metrics = run_dir / "metrics.jsonl"


class Metrics(TrainerCallback):  # the same records as colocate-rl's metrics.jsonl: step, wall_s, TRL's values
    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.time()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            record = {"step": state.global_step, "wall_s": round(time.time() - self.start, 3),
                      **{k: v for k, v in logs.items() if isinstance(v, (int, float, str))}}
            with metrics.open("a") as f:
                f.write(json.dumps(record) + "\\n")


config = GRPOConfig(
    output_dir=str(run_dir / "checkpoints"), learning_rate=1e-6, per_device_train_batch_size=%(micro)d,
    gradient_accumulation_steps=%(accum)d, num_generations=%(group)d, max_completion_length=%(completion)d,
    max_steps=steps, beta=0.0, temperature=1.0, seed=%(seed)d, data_seed=%(seed)d, logging_steps=1,
    save_strategy="no", report_to="none", disable_tqdm=True, bf16=True, model_init_kwargs={"dtype": "bfloat16"},
    use_vllm=True, vllm_mode="server", vllm_server_base_url=base_url, vllm_server_timeout=600,
)
dataset = load_prompts("builtin:digits", seed=%(seed)d)
trainer = GRPOTrainer(model=model, reward_funcs=[digit_share], args=config, train_dataset=dataset,
                      processing_class=load_tokenizer(model), callbacks=[Metrics()])
trainer.train()
(run_dir / "DONE").write_text(json.dumps({"global_step": trainer.state.global_step}) + "\\n")
'''


def colocated_command(
    row: str, run_dir: Path, steps: int, completion: int = COMPLETION, max_model_len: int = MAX_MODEL_LEN
) -> tuple[list[str], dict[str, str]]:
    sets = [
        f"trainer.max_steps={steps}",
        f"trainer.per_device_train_batch_size={MICRO}",
        f"trainer.num_generations={GROUP}",
        f"trainer.max_completion_length={completion}",
        f"generation.max_model_length={max_model_len}",
        f"trainer.seed={SEED}",
        "distributed.nproc_per_node=2",
        "output.save_model=false",
        "generation.overlap=off",  # the rows measure generation and training in turn (overlap: bench_overlap.py)
        *ROWS[row][0],
    ]
    argv = [sys.executable, "-m", "colocate_rl", "train", str(RECIPE), "--run-dir", str(run_dir)]
    for s in sets:
        argv += ["--set", s]
    return argv, {"CUDA_VISIBLE_DEVICES": "0,1"}


def server_commands(out: Path, run_dir: Path, model: Path, steps: int, port: int, max_model_len: int = MAX_MODEL_LEN):
    """(vllm-serve argv, env), (trainer argv, env) for the server-mode row."""
    trl = Path(sys.executable).with_name("trl")  # the venv's console script, else TRL's module entry point
    trl_cmd = (
        [str(trl)] if trl.exists() else [sys.executable, "-c", "import sys; from trl.cli import main; sys.exit(main())"]
    )
    serve = [
        *trl_cmd,
        "vllm-serve",
        "--model",
        str(model),
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--max-model-len",
        str(max_model_len),
        "--gpu-memory-utilization",
        "0.9",
    ]
    train = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "1",
        str(out / "server_trainer.py"),
        str(model),
        str(run_dir),
        f"http://127.0.0.1:{port}",
        str(steps),
    ]
    return (serve, {"CUDA_VISIBLE_DEVICES": "1"}), (train, {"CUDA_VISIBLE_DEVICES": "0", "HF_HUB_OFFLINE": "1"})


def shown(argv: list[str], env: dict[str, str]) -> str:
    return " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " + shlex.join(argv)


def run(argv: list[str], env: dict[str, str], log: Path, timeout: float) -> int:
    """Run to the end or the timeout (then the whole process tree is ended); 124 on timeout."""
    from colocate_rl.launch.supervise import run_supervised

    log.unlink(missing_ok=True)
    outcome = run_supervised(argv, {**os.environ, **env}, log, timeout_s=timeout, cwd=ROOT)
    return 124 if outcome.timed_out else outcome.returncode


def stop(proc: subprocess.Popen) -> None:
    """End a process started here and every process it started, politely first."""
    from colocate_rl.launch.supervise import end_tree

    if proc.poll() is None:
        end_tree(proc, {}, grace_s=30)


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(2)
    return False


def step_stats(run_dir: Path) -> dict:
    """Median s/step (wall_s differences after the first step) and median time/*_s over the same steps."""
    from colocate_rl.rundir import read_metrics

    records = [r for r in read_metrics(run_dir) if "wall_s" in r and "train_runtime" not in r]
    by_step = {r["step"]: r for r in records}
    steps = sorted(by_step)
    diffs = [by_step[b]["wall_s"] - by_step[a]["wall_s"] for a, b in zip(steps, steps[1:]) if b == a + 1]
    later = [by_step[s] for s in steps[1:]]
    times = {
        k: round(statistics.median(r[k] for r in later if k in r), 3)
        for k in sorted({k for r in later for k in r if k.startswith("time/")})
    }
    return {
        "steps_logged": len(steps),
        "median_s_per_step": round(statistics.median(diffs), 3) if diffs else None,
        "times": times,
        "reward_last": later[-1].get("reward") if later else None,
    }


def layout_of(run_dir: Path) -> str:
    """The layout a colocated run used, from its run directory (what auto chose), labelled as auto labels it."""
    from colocate_rl.errors import UserError
    from colocate_rl.memory.autolayout import Candidate
    from colocate_rl.plan.launch_spec import LaunchSpec
    from colocate_rl.rundir import RunDir

    paths = RunDir(run_dir)
    try:
        spec = LaunchSpec.read(paths.launch_spec)
        config = json.loads(paths.deepspeed.read_text()) if paths.deepspeed.exists() else None
    except (UserError, OSError, ValueError):
        return "?"
    return Candidate.of(config, bool(spec.trl_args.get("gradient_checkpointing"))).label


def model_dir(out: Path, dry_run: bool) -> Path:
    """A built 1.5B layout: an earlier row's run-dir model (built by `colocate-rl train`), else built here."""
    from colocate_rl.rundir import RunDir

    for row in ROWS:
        model = RunDir(out / "runs" / row).model
        if (model / "config.json").exists():
            return model
    path = out / "model"
    if not dry_run and not (path / "config.json").exists():
        from colocate_rl.builtin_model import build_model_in_subprocess  # this process must stay off GPU 0

        build_model_in_subprocess(LAYOUT, path, seed=SEED, dtype="bfloat16")
    return path


def bench_row(
    row: str,
    out: Path,
    steps: int,
    timeout: float,
    port: int,
    dry_run: bool,
    completion: int = COMPLETION,
    max_model_len: int = MAX_MODEL_LEN,
) -> dict:
    run_dir = out / "runs" / row
    result: dict = {
        "row": row,
        "completions_per_step": ROWS[row][1],
        "max_completion_length": completion,
        "steps": steps,
        "run_dir": str(run_dir),
    }
    if not row.startswith("server"):
        argv, env = colocated_command(row, run_dir, steps, completion, max_model_len)
        result["command"] = shown(argv, env)
        if dry_run:
            print(f"# {row}\n{result['command']}")
            return result
        start = time.time()
        result["rc"] = run(argv, env, out / f"{row}.log", timeout)
        result["layout"] = layout_of(run_dir)
    else:
        (serve, serve_env), (train, train_env) = server_commands(
            out, run_dir, model_dir(out, dry_run), steps, port, max_model_len
        )
        result["command"] = shown(serve, serve_env) + "  &&  " + shown(train, train_env)
        result["layout"] = "server: vLLM on GPU 1, trainer (1 rank, no DeepSpeed) on GPU 0"
        if dry_run:
            print(
                f"# {row} (vLLM server, wait for http://127.0.0.1:{port}/health, then the trainer)\n"
                f"{shown(serve, serve_env)} &\n{shown(train, train_env)}"
            )
            return result
        (out / "server_trainer.py").write_text(
            SERVER_TRAINER
            % dict(micro=MICRO, accum=ROWS[row][1] // MICRO, group=GROUP, completion=completion, seed=SEED)
        )
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "metrics.jsonl").unlink(missing_ok=True)
        start = time.time()
        with (out / f"{row}-vllm.log").open("w") as f:
            server = subprocess.Popen(
                serve,
                env={**os.environ, **serve_env},
                stdout=f,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                start_new_session=True,
            )
        try:
            if wait_healthy(f"http://127.0.0.1:{port}/health", server, min(600, timeout)):
                left = max(60, timeout - (time.time() - start))
                result["rc"] = run(train, train_env, out / f"{row}.log", left)
            else:
                result["rc"], result["error"] = -1, f"vLLM server did not become healthy (see {row}-vllm.log)"
        finally:
            stop(server)
    result["elapsed_s"] = round(time.time() - start, 1)
    result.update(step_stats(run_dir))
    result["ok"] = result["rc"] == 0 and result["median_s_per_step"] is not None
    return result


def markdown(results: list[dict]) -> str:
    base = {r["row"]: r.get("median_s_per_step") for r in results if r.get("ok")}
    phases = sorted({k for r in results for k in r.get("times", {})})
    head = ["row", "completions/step", "layout", "median s/step", "× vs zero3", "× vs server", *phases, "status"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        s = r.get("median_s_per_step")
        big = r["completions_per_step"] == 256
        ref3, refs = base.get("zero3-256" if big else "zero3"), base.get("server-256" if big else "server")

        def ratio(ref, s=s):
            return f"{ref / s:.2f}" if s and ref else ""

        status = "ok" if r.get("ok") else f"failed (rc {r.get('rc')}{', ' + r['error'] if r.get('error') else ''})"
        lines.append(
            "| "
            + " | ".join(
                [
                    r["row"],
                    str(r["completions_per_step"]),
                    r.get("layout", ""),
                    f"{s:.3f}" if s else "",
                    ratio(ref3),
                    ratio(refs),
                    *(str(r.get("times", {}).get(p, "")) for p in phases),
                    status,
                ]
            )
            + " |"
        )
    lines.append("")
    for suffix, n in (("", 32), ("-256", 256)):
        auto, z3, srv = (base.get(name + suffix) for name in ("auto", "zero3", "server"))
        if auto and z3:
            lines.append(f"- auto vs forced ZeRO-3 ({n} completions/step): {z3 / auto:.2f}× (target ≥ 2×)")
        if auto and srv:
            lines.append(f"- auto vs server mode ({n} completions/step): {srv / auto:.2f}× (target ≥ 1.7×)")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="output directory (runs, logs, results)")
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of: {', '.join(ROWS)}")
    p.add_argument("--steps", type=int, default=12, help="optimizer steps per row (≥ 3; default 12)")
    p.add_argument("--timeout", type=float, default=1200, help="seconds per row (default 1200)")
    p.add_argument("--port", type=int, default=8765, help="port of the vLLM server (server row)")
    p.add_argument(
        "--completion-length", type=int, default=COMPLETION, help=f"max completion tokens (default {COMPLETION})"
    )
    p.add_argument(
        "--max-model-len", type=int, default=MAX_MODEL_LEN, help=f"vLLM's max_model_len (default {MAX_MODEL_LEN})"
    )
    p.add_argument("--dry-run", action="store_true", help="print the commands; run nothing, write nothing")
    args = p.parse_args(argv)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown or args.steps < 3:
        p.error(f"unknown rows {unknown}; choose from {', '.join(ROWS)}" if unknown else "--steps: at least 3")
    if not 0 < args.completion_length < args.max_model_len:
        p.error(
            f"--completion-length {args.completion_length} must be positive and below --max-model-len "
            f"{args.max_model_len} (the prompt needs room too)"
        )
    out = args.out.absolute()
    if not args.dry_run:
        out.mkdir(parents=True, exist_ok=True)
    results = []
    for row in rows:
        if not args.dry_run:
            print(f"[bench] {row} …", flush=True)
        try:
            result = bench_row(
                row, out, args.steps, args.timeout, args.port, args.dry_run, args.completion_length, args.max_model_len
            )
        except Exception as e:  # one broken row must not stop the others
            result = {"row": row, "completions_per_step": ROWS[row][1], "ok": False, "rc": None, "error": repr(e)}
        if args.dry_run:
            continue
        results.append(result)
        print(
            f"[bench] {row}: {'ok' if result.get('ok') else 'FAILED'} median s/step "
            f"{result.get('median_s_per_step')} ({result.get('layout', '')})",
            flush=True,
        )
        with (out / "results.jsonl").open("a") as f:
            f.write(json.dumps(result) + "\n")
    if not args.dry_run:
        (out / "results.md").write_text(markdown(results))
        print((out / "results.md").read_text())
    return 0 if all(r.get("ok") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
