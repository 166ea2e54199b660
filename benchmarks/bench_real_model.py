#!/usr/bin/env python3
"""Training on a real pretrained model (issue 18): GRPO and RLOO, full fine-tuning and LoRA, 2 seeds, held-out eval on.

Every row is one `colocate-rl train` run of recipes/smollm2-135m-gsm8k.yaml (SmolLM2-135M-Instruct on GSM-Symbolic,
math_verify + 0.5 × hash_answer_format, 4 prompts × 8 completions of ≤ 256 tokens per step) with the local model
and data given by `--set` (no hub on the GPU machine): `--model DIR` (a transformers directory) and `--data DIR`
(holding gsm_symbolic_train.jsonl and gsm_symbolic_test.jsonl; eval on the first `--eval-samples` test rows,
greedy, every `--eval-every` steps and after the last). Rows `{grpo,rloo}-{full,lora}-s{0,1}`: LoRA is
`model.lora={r: 16, alpha: 32}` with learning rate 2e-4, full fine-tuning keeps the recipe's 1e-5.

Several runs at once: `--devices 0,1 --per-gpu K` makes K slots per GPU; each slot runs one row at a time with
CUDA_VISIBLE_DEVICES set to its GPU and takes the next row when its run ends. K runs share one GPU, so each gets the
vLLM share min(recipe share, --vllm-budget / K). A run starts only once the run started before it on the same GPU
and the very first run have their vLLM engines up (or ended; at most --start-wait s each): vLLM's start-up measures
the GPU's free memory, and the first run's vLLM compile is cached for the others. With a fixed KV pool
(`--set generation.kv_cache_memory=SIZE`) vLLM measures nothing at start-up, so only the first run is waited for. Runs on one GPU slow each other: the time and memory figures of the matrix
are marked with K, and `mem/gpu_peak_gib` is NVML's count for the whole GPU (all K runs). `--timing` runs the full
vs LoRA pair (grpo, seed 0) alone, one run per GPU, for the LoRA vs full table.

    python benchmarks/bench_real_model.py --out OUT --model M --data D --devices 0,1 --per-gpu 2
    python benchmarks/bench_real_model.py --out OUT --model M --data D --devices 0,1 --timing --steps 30
    python benchmarks/bench_real_model.py --out OUT --table          # table.md from results.jsonl

Per row, from the run's metrics.jsonl: eval/reward at every evaluation, first → last, the eval reward per reward
function at the last evaluation, training reward mean of the first 5 and last 5 steps, s/step (median of the wall_s
differences after step 1), time/weight_sync_s (median after step 1), mem/gpu_peak_gib (max), the size of final/,
exit code and wall time; per config (algorithm × full/lora), the mean over the seeds with min–max. Writes
OUT/results.jsonl (one line per row, appended as rows end) and OUT/table.md (the last result of each row). A row
that fails keeps its exit code and log tail and the others go on. `--deadline S` ends the rows still running S s
after the start (exit 124) and starts none after; they can be run again with `--rows` into the same OUT (a new run
directory, `<row>.2`). `--dry-run` prints the exact commands and the schedule; it runs and writes nothing.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import queue
import shlex
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from colocate_rl.errors import UserError  # noqa: E402
from colocate_rl.memory.autolayout import DEFAULT_SHARE  # noqa: E402
from colocate_rl.plan.launch_spec import LaunchSpec  # noqa: E402
from colocate_rl.recipe.load import apply_overrides, parse_recipe, parse_sets, read_yaml  # noqa: E402
from colocate_rl.rundir import RunDir, read_metrics, step_records  # noqa: E402
from colocate_rl.telemetry import events  # noqa: E402

RECIPE = "recipes/smollm2-135m-gsm8k.yaml"  # relative to ROOT, where every row runs
TRAIN_FILE, TEST_FILE = "gsm_symbolic_train.jsonl", "gsm_symbolic_test.jsonl"
ALGORITHMS, MODES, SEEDS = ("grpo", "rloo"), ("full", "lora"), (0, 1)
LORA = ["model.lora={r: 16, alpha: 32}", "trainer.learning_rate=2.0e-4"]  # full fine-tuning: the recipe's 1e-5
# seed, then full/lora, then algorithm: seed 0 of every config comes first, and with the slots interleaved over the
# GPUs (slots()) each GPU gets one full and one LoRA run of the same algorithm
ROWS = {f"{a}-{m}-s{s}": (a, m, s) for s in SEEDS for m in MODES for a in ALGORITHMS}
TIMING_ROWS = ["grpo-full-s0", "grpo-lora-s0"]
SHARE_KEY = "generation.vllm_gpu_memory_utilization"
VLLM_BUDGET = 0.4  # share of a GPU the vLLM engines of the runs on it take together (the rest: their trainers)
POLL_S = 2.0  # how often a waiting start looks at the run started before it
MIN_START_S = 120.0  # with --deadline: no row starts when less is left
ENV = {"HF_HUB_OFFLINE": "1"}  # model and data are local; no hub look-ups (the GPU machine reaches none)


# ---------------------------------------------------------------------------------------------- commands


def user_recipe(user_sets: list[str]):
    """The rows' recipe with the user's --set applied (schema defaults filled in)."""
    return parse_recipe(apply_overrides(read_yaml(ROOT / RECIPE), parse_sets(user_sets)))


def recipe_share(user_sets: list[str]) -> float:
    """The recipe's vLLM share (schema default when it has none), with the user's --set applied."""
    return user_recipe(user_sets).generation.vllm_gpu_memory_utilization


def fixed_kv_pool(user_sets: list[str]) -> bool:
    """The user's --set gives vLLM a fixed KV pool (generation.kv_cache_memory): its start-up then sizes nothing from
    the GPU's free memory, so runs on one GPU may start together."""
    return user_recipe(user_sets).generation.kv_cache_memory is not None


def vllm_share(per_gpu: int, budget: float, user_sets: list[str]) -> tuple[float, str | None]:
    """(each run's vLLM share, how it was found); None as the second when --set gives it (then nothing is added)."""
    if SHARE_KEY in parse_sets(user_sets):
        return recipe_share(user_sets), None
    base = recipe_share([])
    base = DEFAULT_SHARE if base == "auto" else base  # auto sizes for one run alone: the rows keep the default
    return round(min(base, budget / per_gpu), 3), f"min(recipe {base:g}, {budget:g} / {per_gpu} runs per GPU)"


def row_sets(
    row: str, model: Path, data: Path, steps: int, eval_every: int, eval_samples: int, share: float | None, user: list
) -> list[str]:
    """The --set items of one row, in order: paths, algorithm, seed, steps, eval, LoRA, vLLM share, the user's last."""
    algorithm, mode, seed = ROWS[row]
    sets = [
        f"model.name={model}",
        f"data.source={data / TRAIN_FILE}",
        f"eval.source={data / TEST_FILE}",
        f"algorithm={algorithm}",
        f"trainer.seed={seed}",
        f"trainer.max_steps={steps}",
        f"eval.every_steps={eval_every}",
        f"eval.num_samples={eval_samples}",
    ]
    if mode == "lora":
        sets += LORA
    if share is not None:
        sets.append(f"{SHARE_KEY}={share:g}")
    return sets + list(user)


def command(run_dir: Path, sets: list[str]) -> list[str]:
    argv = [sys.executable, "-m", "colocate_rl", "train", RECIPE, "--run-dir", str(run_dir)]
    for item in sets:
        argv += ["--set", item]
    return argv


def row_env(device: str, n_slots: int) -> dict[str, str]:
    """The GPU of the row's slot; the host's CPU cores split over the runs at once (colocate-rl would give each run
    all of them), counted on the machine the driver runs on."""
    threads = max(1, (os.cpu_count() or 1) // n_slots)
    return {"CUDA_VISIBLE_DEVICES": device, "OMP_NUM_THREADS": str(threads), **ENV}


def shown(argv: list[str], env: dict[str, str]) -> str:
    return " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " + shlex.join(argv)


def run_dir_for(out: Path, mode: str, row: str) -> Path:
    """OUT/runs/<row> (OUT/timing/<row> with --timing); `<row>.2`, `.3`, ... when taken by an earlier attempt (a run
    directory that holds a run is refused)."""
    base = out / ("timing" if mode == "timing" else "runs")
    path, n = base / row, 1
    while os.path.lexists(path):
        n += 1
        path = base / f"{row}.{n}"
    return path


def slots(devices: list[str], per_gpu: int) -> list[str]:
    """The GPU of each slot, interleaved over the GPUs (0, 1, 0, 1 for two GPUs with two runs each), so that the first
    rows spread over the GPUs."""
    return [d for _ in range(per_gpu) for d in devices]


def planned_schedule(rows: list[str], n_slots: int) -> list[list[str]]:
    """The rows each slot runs if every row takes the same time (the run-time order: a slot takes the next row when
    its run ends, and the starts are staggered, so the first slot to start is the first to be free again)."""
    return [rows[i::n_slots] for i in range(n_slots)]


# ---------------------------------------------------------------------------------------------- scheduling


@dataclass
class Job:
    row: str
    run_dir: Path
    argv: list[str]
    started: float | None = None  # time.monotonic() at the start
    ended: threading.Event = field(default_factory=threading.Event)


def engine_up(run_dir: Path) -> bool:
    """The run's colocated vLLM engine has started (its engine_memory event), or a step is logged."""
    return bool(events.read_events(run_dir, events.ENGINE_MEMORY)) or bool(step_records(run_dir))


def schedule(
    jobs: list[Job],
    devices: list[str],
    launch: Callable[[Job, str, float | None], dict],
    *,
    start_wait: float,
    deadline: float | None = None,
    stop: threading.Event | None = None,
    ready: Callable[[Path], bool] = engine_up,
    after_previous: bool = True,
) -> tuple[list[dict], list[str]]:
    """Run `jobs` in order over slots, slot i on the GPU `devices[i]`: the first jobs fill the slots in turn, then the
    slot that is free first takes the next job. A job starts once the job started before it on the same GPU (only
    with `after_previous`) and the first job are each `ready` (the vLLM engine is up), ended, or started `start_wait`
    s ago. `launch(job, device, timeout_s)` runs one job to
    its end (in a thread of its own) and returns its result; `deadline` (time.monotonic()) bounds every run, and no
    job starts less than MIN_START_S before it or once `stop` is set. Returns (the results in the order the jobs
    ended, the rows never started)."""
    stop = stop or threading.Event()
    free: queue.Queue[int] = queue.Queue()  # slots in the order they became free
    for i in range(len(devices)):
        free.put(i)
    results: list[dict] = []
    threads: list[threading.Thread] = []
    first: Job | None = None
    last_on: dict[str, Job] = {}  # GPU → the job started last on it

    def run(job: Job, slot: int, left: float | None) -> None:
        try:
            results.append(launch(job, devices[slot], left))
        finally:
            job.ended.set()
            free.put(slot)

    def settled(job: Job | None) -> bool:
        return job is None or job.ended.is_set() or time.monotonic() - job.started >= start_wait or ready(job.run_dir)

    skipped: list[str] = []
    for n, job in enumerate(jobs):
        slot = None
        while slot is None and not stop.is_set():
            try:
                slot = free.get(timeout=POLL_S)
            except queue.Empty:
                pass
        while not stop.is_set() and not (
            settled(first) and (not after_previous or settled(last_on.get(devices[slot])))
        ):
            time.sleep(POLL_S)
        left = None if deadline is None else deadline - time.monotonic()
        if stop.is_set() or (left is not None and left < MIN_START_S):
            skipped = [j.row for j in jobs[n:]]
            break
        job.started, first = time.monotonic(), first or job
        last_on[devices[slot]] = job
        threads.append(threading.Thread(target=run, args=(job, slot, left), daemon=True))
        threads[-1].start()
    for t in threads:
        while t.is_alive():
            t.join(timeout=0.5)  # the main thread stays responsive to signals
    return results, skipped


# ---------------------------------------------------------------------------------------------- figures


def median_after_first(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records[1:] if isinstance(r.get(key), (int, float))]
    return round(statistics.median(values), 4) if values else None


def tail(path: Path, n: int) -> str | None:
    return path.read_text(errors="replace")[-n:] if path.is_file() else None


def figures(run_dir: Path, code: int, log: Path | None = None) -> dict:
    """What one run's directory says: eval rewards, training reward, time and memory, final/, the launched settings;
    the log tails when it failed."""
    rd = RunDir(run_dir)
    row: dict = {"exit": code}
    try:
        spec = LaunchSpec.read(rd.launch_spec)
        row["launched"] = {
            "vllm_share": spec.trl_args.get("vllm_gpu_memory_utilization"),
            "learning_rate": spec.trl_args.get("learning_rate"),
            "sleep_level": spec.engine.sleep_level if spec.engine else None,
            "enforce_eager": spec.engine.enforce_eager if spec.engine else None,
            "world_size": spec.world_size,
        }
    except UserError:
        pass  # the run did not get as far as writing its run directory
    steps = step_records(run_dir)
    row["steps"] = len(steps)
    evals = {r["step"]: r for r in read_metrics(run_dir) if isinstance(r.get("eval/reward"), (int, float))}
    row["eval_reward"] = [[s, evals[s]["eval/reward"]] for s in sorted(evals)]
    if evals:
        last = evals[max(evals)]
        row["eval_first"], row["eval_last"] = row["eval_reward"][0][1], row["eval_reward"][-1][1]
        row["eval_last_by_reward"] = {
            k[len("eval/") :]: v
            for k, v in last.items()
            if k.startswith("eval/") and k not in ("eval/reward", "eval/completion_length")
        }
        row["eval_last_completion_length"] = last.get("eval/completion_length")
    if steps:
        row["reward_first5"] = round(statistics.mean(r["reward"] for r in steps[:5]), 4)
        row["reward_last5"] = round(statistics.mean(r["reward"] for r in steps[-5:]), 4)
        # every step: the area under the learning curve, what "same learning" compares
        row["reward_mean"] = round(statistics.mean(r["reward"] for r in steps), 4)
    if len(steps) >= 2:
        diffs = [b["wall_s"] - a["wall_s"] for a, b in zip(steps, steps[1:]) if b["step"] == a["step"] + 1]
        row["s_per_step"] = round(statistics.median(diffs), 4) if diffs else None
        row["step_s"] = median_after_first(steps, "time/step_s")
        row["weight_sync_s"] = median_after_first(steps, "time/weight_sync_s")
        peaks = [r["mem/gpu_peak_gib"] for r in steps if isinstance(r.get("mem/gpu_peak_gib"), (int, float))]
        row["gpu_peak_gib"] = max(peaks) if peaks else None
    memory = events.read_events(run_dir, events.ENGINE_MEMORY)
    if memory:
        row["vllm_awake_gib"] = min(memory, key=lambda e: e.get("rank") or 0).get("awake_gib")
    if rd.final.is_dir():
        files = [f for f in rd.final.rglob("*") if f.is_file()]
        row["final_mib"] = round(sum(f.stat().st_size for f in files) / 2**20, 1)
        row["final_kind"] = "adapter" if (rd.final / "adapter_model.safetensors").is_file() else "model"
    if code:
        row["log_tail"] = tail(rd.log(), 3000)
        if log is not None:
            row["cli_tail"] = tail(log, 1500)
    return row


# ---------------------------------------------------------------------------------------------- tables


def fmt(value, digits: int = 3) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def spread(values: list[float], signed: bool = False) -> str:
    """mean (min–max) of the seeds' values."""
    f = "{:+.3f}" if signed else "{:.3f}"
    mean = f.format(statistics.mean(values))
    return mean if len(values) == 1 else f"{mean} ({f.format(min(values))}–{f.format(max(values))})"


def latest(results: list[dict]) -> list[dict]:
    """The last result of each (mode, row), in the order of their first appearance."""
    by: dict[tuple, dict] = {}
    for r in results:
        by.pop((r.get("mode"), r["row"]), None)
        by[(r.get("mode"), r["row"])] = r
    return list(by.values())


def md(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *("| " + " | ".join(r) + " |" for r in rows)]


def eval_cell(r: dict) -> str:
    return ", ".join(f"{s}: {v:.3f}" for s, v in r.get("eval_reward") or [])


def first_last(r: dict, a: str, b: str) -> str:
    return f"{r[a]:.3f} → {r[b]:.3f}" if r.get(a) is not None and r.get(b) is not None else ""


def ok(r: dict) -> bool:
    return r.get("exit") == 0


def timing_rows(rows: list[dict]) -> list[list[str]]:
    out = []
    for r in rows:
        launched = r.get("launched") or {}
        final = f"{r['final_mib']} ({r.get('final_kind')})" if r.get("final_mib") is not None else ""
        out.append(
            [
                r["row"],
                str(r.get("per_gpu", "")),
                fmt(launched.get("vllm_share", r.get("vllm_share"))),
                fmt(launched.get("sleep_level")),
                fmt(launched.get("enforce_eager")),
                fmt(r.get("s_per_step")),
                fmt(r.get("step_s")),
                fmt(r.get("weight_sync_s"), 4),
                fmt(r.get("gpu_peak_gib"), 2),
                fmt(r.get("vllm_awake_gib"), 2),
                final,
                fmt(r.get("exit")),
            ]
        )
    return out


TIMING_HEAD = [
    "row",
    "runs/GPU",
    "vLLM share",
    "sleep level",
    "eager",
    "s/step (median after step 1)",
    "time/step_s (median)",
    "weight sync s (median)",
    "GPU peak GiB (max)",
    "vLLM awake GiB",
    "final/ MiB",
    "exit",
]


def table(results: list[dict]) -> str:
    rows = latest(results)
    matrix = [r for r in rows if r.get("mode") != "timing"]
    timing = [r for r in rows if r.get("mode") == "timing"]
    lines = ["# Real-model training: SmolLM2-135M-Instruct on GSM-Symbolic (`bench_real_model.py`)", ""]
    if matrix:
        lines += ["## Held-out eval reward per row", ""]
        lines += md(
            [
                "row",
                "exit",
                "wall s",
                "steps",
                "GPU",
                "runs/GPU",
                "eval/reward by step",
                "eval first → last",
                "eval per reward (last)",
                "eval completion length (last)",
                "train reward first 5 → last 5 steps",
            ],
            [
                [
                    r["row"],
                    fmt(r.get("exit")),
                    fmt(r.get("wall_s"), 1),
                    fmt(r.get("steps")),
                    fmt(r.get("device")),
                    fmt(r.get("per_gpu")),
                    eval_cell(r),
                    first_last(r, "eval_first", "eval_last"),
                    ", ".join(f"{k} {v:.3f}" for k, v in (r.get("eval_last_by_reward") or {}).items() if v is not None),
                    fmt(r.get("eval_last_completion_length"), 1),
                    first_last(r, "reward_first5", "reward_last5"),
                ]
                for r in matrix
            ],
        )
        lines += [
            "",
            "## Per config: mean over the seeds (min–max)",
            "",
            "Eval first is the first evaluation: step 0, before training (`eval.before_training`). Only rows that "
            "exited 0 count.",
            "",
        ]
        configs: dict[str, list[dict]] = {}
        for r in matrix:
            configs.setdefault(r["row"].rpartition("-s")[0], []).append(r)
        body = []
        for name, runs in configs.items():
            done = [r for r in runs if ok(r) and r.get("eval_first") is not None]
            if not done:
                body.append([name, f"0 of {len(runs)}", "", "", "", "", "", ""])
                continue
            deltas = [r["eval_last"] - r["eval_first"] for r in done]
            trained = [r for r in done if r.get("reward_first5") is not None]
            body.append(
                [
                    name,
                    f"{len(done)} of {len(runs)} ({', '.join(str(r.get('seed')) for r in done)})",
                    spread([r["eval_first"] for r in done]),
                    spread([r["eval_last"] for r in done]),
                    spread(deltas, signed=True),
                    f"{sum(d > 0 for d in deltas)} of {len(done)}",
                    (
                        f"{statistics.mean(r['reward_first5'] for r in trained):.3f} → "
                        f"{statistics.mean(r['reward_last5'] for r in trained):.3f}"
                        if trained
                        else ""
                    ),
                    spread([r["reward_mean"] for r in done if r.get("reward_mean") is not None]),
                ]
            )
        lines += md(
            [
                "config",
                "seeds that finished",
                "eval first",
                "eval last",
                "eval last − first",
                "eval rose in",
                "train reward first 5 → last 5",
                "train reward, mean of every step",
            ],
            body,
        )
        ks = sorted({r.get("per_gpu") for r in matrix if r.get("per_gpu") is not None})
        lines += [
            "",
            f"## Time and memory, measured with {' / '.join(map(str, ks)) or '?'} run(s) per GPU",
            "",
            "Runs that share a GPU slow each other: s/step and weight sync are not what a run alone takes, and the GPU "
            "peak is NVML's count for the whole GPU, so it includes the other runs on it (and each run's vLLM share "
            "was cut to fit them); vLLM awake is the drop in the GPU's free memory across the engine's start-up, "
            "which runs starting beside it inflate. For a run alone on its GPU see the `--timing` table.",
            "",
        ]
        lines += md(TIMING_HEAD, timing_rows(matrix))
    if timing:
        lines += ["", "## Time and memory, one run per GPU (`--timing`): LoRA vs full fine-tuning", ""]
        lines += md(TIMING_HEAD, timing_rows(timing))
        by = {(r.get("algorithm"), r.get("seed"), r.get("lora")): r for r in timing if ok(r)}
        lines.append("")
        for (algorithm, seed, lora), lo in by.items():
            full = by.get((algorithm, seed, False))
            if not lora or full is None:
                continue
            parts = []
            for label, key in (("s/step", "s_per_step"), ("weight sync", "weight_sync_s")):
                if lo.get(key) and full.get(key):
                    parts.append(f"{label} {lo[key] / full[key]:.2f}×")
            for label, key, unit in (("GPU peak", "gpu_peak_gib", "GiB"), ("final/", "final_mib", "MiB")):
                if lo.get(key) is not None and full.get(key) is not None:
                    parts.append(f"{label} {lo[key]} vs {full[key]} {unit}")
            lines.append(f"- {algorithm} seed {seed}, LoRA vs full: " + ", ".join(parts))
    return "\n".join(lines) + "\n"


def read_results(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


# ---------------------------------------------------------------------------------------------- main


def select_rows(spec: str | None, timing: bool) -> list[str]:
    """Row names from a comma-separated list of names or patterns (`grpo-*`, `*-s0`), in ROWS order."""
    if not spec:
        return list(TIMING_ROWS if timing else ROWS)
    patterns = [p.strip() for p in spec.split(",") if p.strip()]
    unknown = [p for p in patterns if not fnmatch.filter(ROWS, p)]
    if unknown:
        raise ValueError(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
    return [r for r in ROWS if any(fnmatch.fnmatch(r, p) for p in patterns)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="output directory (runs, logs, results)")
    p.add_argument("--model", type=Path, help="SmolLM2-135M-Instruct as a transformers directory")
    p.add_argument("--data", type=Path, help=f"directory holding {TRAIN_FILE} and {TEST_FILE}")
    p.add_argument(
        "--rows", help=f"comma-separated names or patterns (default: all; --timing: {','.join(TIMING_ROWS)})"
    )
    p.add_argument("--steps", type=int, help="optimizer steps per row (default 100; --timing: 30)")
    p.add_argument("--eval-every", type=int, default=20, help="eval.every_steps (default 20)")
    p.add_argument("--eval-samples", type=int, default=200, help="eval.num_samples (default 200)")
    p.add_argument("--devices", default="0", help="comma-separated GPUs (default 0)")
    p.add_argument("--per-gpu", type=int, default=1, help="runs sharing one GPU at a time (default 1)")
    p.add_argument(
        "--vllm-budget",
        type=float,
        default=VLLM_BUDGET,
        help=f"share of a GPU the vLLM engines on it take together: each run's share is min(recipe share, this / "
        f"--per-gpu) (default {VLLM_BUDGET})",
    )
    p.add_argument("--timing", action="store_true", help="the full vs LoRA pair alone, one run per GPU")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE", help="to every row, last")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per row (default 3600)")
    p.add_argument("--deadline", type=float, help="seconds from the start: rows still running then are ended")
    p.add_argument(
        "--start-wait",
        type=float,
        default=600,
        help="a run starts once the one started before it on its GPU and the first run have their vLLM engines up, "
        "waiting at most this for each (default 600)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the commands and the schedule; run nothing")
    p.add_argument("--table", action="store_true", help="only rewrite table.md from results.jsonl")
    args = p.parse_args(argv)
    out = args.out.absolute()
    results_file = out / "results.jsonl"
    if args.table:
        if not results_file.exists():
            p.error(f"{results_file} does not exist")
        (out / "table.md").write_text(table(read_results(results_file)))
        print((out / "table.md").read_text())
        return 0
    try:
        rows = select_rows(args.rows, args.timing)
    except ValueError as e:
        p.error(str(e))
    if args.model is None or args.data is None:
        p.error("--model and --data are needed (except with --table)")
    if args.timing and args.per_gpu != 1:
        p.error("--timing runs one run per GPU; leave out --per-gpu")
    steps = args.steps if args.steps is not None else (30 if args.timing else 100)
    if args.per_gpu < 1 or steps < 2 or not 1 <= args.eval_every <= steps or args.eval_samples < 1:
        p.error("need --per-gpu ≥ 1, --steps ≥ 2, 1 ≤ --eval-every ≤ --steps, --eval-samples ≥ 1")
    if not 0 < args.vllm_budget <= 1:
        p.error("--vllm-budget: a share of the GPU, in (0, 1]")
    devices = [d.strip() for d in args.devices.split(",") if d.strip()]
    model, data = args.model.absolute(), args.data.absolute()
    if not args.dry_run:
        missing = [str(f) for f in (model / "config.json", data / TRAIN_FILE, data / TEST_FILE) if not f.is_file()]
        if missing:
            p.error(f"not found: {', '.join(missing)}")
    try:
        share, how = vllm_share(args.per_gpu, args.vllm_budget, args.sets)
    except UserError as e:
        p.error(str(e))
    mode = "timing" if args.timing else "matrix"
    try:
        together = fixed_kv_pool(args.sets)
    except UserError as e:
        p.error(str(e))
    jobs = []
    for row in rows:
        run_dir = run_dir_for(out, mode, row)
        sets = row_sets(row, model, data, steps, args.eval_every, args.eval_samples, share if how else None, args.sets)
        jobs.append(Job(row, run_dir, command(run_dir, sets)))
    lanes = slots(devices, args.per_gpu)
    header = (
        f"# {len(jobs)} row(s) ({mode}, {steps} steps) on {len(lanes)} slot(s): "
        + ", ".join(f"GPU {d} × {args.per_gpu}" for d in devices)
        + f"; vLLM share {share:g} per run"
        + (f" = {how}" if how else " (given by --set)")
        + "; a slot takes the next row when its run ends, and a run starts once "
        + (
            "the first run has its vLLM engine up (a fixed KV pool: start-ups measure nothing)"
            if together
            else "the run started before it on its GPU and the first run have their vLLM engines up"
        )
        + f" (at most {args.start_wait:g} s)"
    )
    if args.dry_run:
        plan = planned_schedule([j.row for j in jobs], len(lanes))
        slot_of = {row: i for i, rows_ in enumerate(plan) for row in rows_}
        print(header)
        for job in jobs:
            i = slot_of[job.row]
            print(f"# {job.row}: slot {i} (GPU {lanes[i]})")
            print(shown(job.argv, row_env(lanes[i], len(lanes))))
        print("# schedule if every row takes the same time:")
        for i, rows_ in enumerate(plan):
            print(f"#   slot {i} (GPU {lanes[i]}): {', '.join(rows_) or '-'}")
        return 0

    out.mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    print(header, flush=True)
    stop, write = threading.Event(), threading.Lock()
    begin = time.monotonic()
    deadline = begin + args.deadline if args.deadline is not None else None

    def launch(job: Job, device: str, left: float | None) -> dict:
        from colocate_rl.launch.supervise import run_supervised

        env = row_env(device, len(lanes))
        log = out / "logs" / f"{job.run_dir.name}.log"
        timeout = args.timeout if left is None else min(args.timeout, left)
        print(f"[bench] {job.row}: start on GPU {device} → {job.run_dir}", flush=True)
        start = time.time()
        try:
            outcome = run_supervised(
                job.argv,
                {**os.environ, "COLUMNS": "200", **env},
                log,
                timeout_s=timeout,
                cwd=ROOT,
                check=lambda: "stopped by the benchmark driver" if stop.is_set() else None,
            )
            code, error = (124 if outcome.timed_out else outcome.returncode), outcome.error
        except Exception as e:  # one broken row must not stop the others
            code, error = -1, repr(e)
        algorithm, kind, seed = ROWS[job.row]
        result = {
            "row": job.row,
            "mode": mode,
            "algorithm": algorithm,
            "lora": kind == "lora",
            "seed": seed,
            "device": device,
            "per_gpu": args.per_gpu,
            "vllm_share": share,
            "steps_asked": steps,
            "wall_s": round(time.time() - start, 1),
            "run_dir": str(job.run_dir),
            "command": shown(job.argv, env),
        }
        try:
            result.update(figures(job.run_dir, code, log))
        except Exception as e:  # a run directory this version cannot read: keep the exit code
            result.update(exit=code, figures_error=repr(e))
        if error:
            result["error"] = error
        elif code == 124:
            result["error"] = "timed out (--timeout or --deadline)"
        with write:
            with results_file.open("a") as f:
                f.write(json.dumps(result) + "\n")
            (out / "table.md").write_text(table(read_results(results_file)))
        brief = {k: result.get(k) for k in ("row", "exit", "wall_s", "steps", "eval_first", "eval_last", "s_per_step")}
        print(f"[bench] {json.dumps(brief)}", flush=True)
        return result

    def on_signal(signum, _frame) -> None:
        print(f"[bench] signal {signum}: ending the running rows, starting no more", flush=True)
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        results, skipped = schedule(
            jobs, lanes, launch, start_wait=args.start_wait, deadline=deadline, stop=stop, after_previous=not together
        )
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if skipped:
        print(f"[bench] not started: {','.join(skipped)} (run them with --rows into the same --out)", flush=True)
    print(f"[bench] {len(results)} row(s) in {time.monotonic() - begin:.0f} s; {out / 'table.md'}", flush=True)
    return 0 if results and all(ok(r) for r in results) and not skipped else 1


if __name__ == "__main__":
    sys.exit(main())
