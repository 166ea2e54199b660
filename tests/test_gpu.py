"""GPU path through the real CLI: colocated vLLM on every rank, sleep mode, ZeRO-3, RLOO.

Skipped without CUDA + vLLM (CI never has them); run on the GPU machine with
`python -m pytest -m gpu tests/test_gpu.py -s`. Set GPU_REPORT_DIR to collect each run's figures
(s/step median over the steps after the first, GPU memory in use right after the optimizer step and
the step peak, from the driver's view) in `gpu_runs.jsonl`.
"""

import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from colocate_rl.rundir import read_metrics
from colocate_rl.telemetry import events

ROOT = Path(__file__).resolve().parent.parent


def _cuda_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:
        return 0


GPUS = _cuda_count()
HAS_VLLM = importlib.util.find_spec("vllm") is not None
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.timeout(3600),  # real runs on the GPUs, up to 500 steps
    pytest.mark.skipif(GPUS == 0 or not HAS_VLLM, reason="needs CUDA GPUs and vLLM"),
]
STEPS = 10


def cli(args: list[str], visible: str) -> subprocess.CompletedProcess:
    """`colocate-rl ARGS` on the GPUs in `visible`. The tests were written for the engine in the rank's process,
    generating in turn with training: `train` (not a resume), `validate` and `mem-probe` get `generation.overlap: off`
    unless the test sets it (overlap's own tests: from `test_overlap_on_the_real_model…` on)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": visible, "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "colocate_rl", *in_turns(args)], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=1200,
    )  # fmt: skip


def in_turns(args: list[str]) -> list[str]:
    """`args` of `train`, `validate` or `mem-probe` with `generation.overlap: off` unless they set it."""
    planned = args[0] in ("train", "validate", "mem-probe") and "--resume" not in args
    if planned and not any(a.startswith("generation.overlap=") for a in args):
        return [*args, "--set", "generation.overlap=off"]
    return args


def train(name: str, recipe: str, run_dir: Path, visible: str, *sets: str) -> dict:
    """Run `colocate-rl train` on the GPUs in `visible`; return the run's figures (and record them)."""
    args = ["train", recipe, "--run-dir", str(run_dir), "--set", f"trainer.max_steps={STEPS}"]
    for item in sets:
        args += ["--set", item]
    result = cli(args, visible)
    log = (run_dir / "train.log").read_text() if (run_dir / "train.log").exists() else ""
    assert result.returncode == 0, result.stdout[-3000:] + log[-8000:]
    steps = [r for r in read_metrics(run_dir) if "reward" in r]
    assert len(steps) == STEPS, f"{len(steps)} logged steps"
    walls = [r["wall_s"] for r in steps]
    figures = {
        "name": name,
        "command": "CUDA_VISIBLE_DEVICES=" + visible + " colocate-rl " + " ".join(args),
        "gpus": len(visible.split(",")),
        "s_per_step_median": round(statistics.median(b - a for a, b in zip(walls, walls[1:])), 3),
        "gpu_used_gib_at_step_end_median": statistics.median(r["mem/gpu_used_gib"] for r in steps[1:]),
        "gpu_peak_gib_max": max(r["mem/gpu_peak_gib"] for r in steps),
        "torch_allocated_gib_at_step_end_median": statistics.median(r["mem/torch_allocated_gib"] for r in steps[1:]),
        "torch_peak_gib_max": max(r["mem/torch_peak_gib"] for r in steps),
        "alloc_retries": sum(r["mem/alloc_retries"] for r in steps),
        "reward_first_last": [round(steps[0]["reward"], 4), round(steps[-1]["reward"], 4)],
        "exit_crash_tolerated": "torchrun exited" in result.stdout,
    }
    print(json.dumps(figures))
    if os.environ.get("GPU_REPORT_DIR"):
        with open(Path(os.environ["GPU_REPORT_DIR"]) / "gpu_runs.jsonl", "a") as f:
            f.write(json.dumps(figures) + "\n")
    assert (run_dir / "final" / "config.json").is_file()
    return figures


@pytest.mark.parametrize(
    "name, recipe, visible",
    [
        ("1gpu-0.5b", "recipes/gpu-0.5b-layout.yaml", "0"),
        pytest.param(
            "2gpu-1.5b-zero3",
            "recipes/gpu-1.5b-layout-zero3.yaml",
            "0,1",
            marks=pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs"),
        ),
    ],
)
def test_sleep_mode_frees_memory_at_the_optimizer_step(tmp_path, name, recipe, visible):
    off = train(f"{name}-sleep-off", recipe, tmp_path / "off", visible, "generation.sleep_level=0")
    on = train(f"{name}-sleep-on", recipe, tmp_path / "on", visible, "generation.sleep_level=2")
    # vLLM holds ~25 % of the GPU while awake; asleep (level 2) it keeps ~1 GiB per rank.
    assert on["gpu_used_gib_at_step_end_median"] < 0.5 * off["gpu_used_gib_at_step_end_median"]


def test_rloo_one_gpu(tmp_path):
    train(
        "1gpu-0.5b-rloo-sleep-on",
        "recipes/gpu-0.5b-layout.yaml",
        tmp_path / "rloo",
        "0",
        "algorithm=rloo",
        "trainer.extra_args={normalize_advantages: true}",
    )


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")
def test_two_gpus_zero3_optimizer_offload(tmp_path):
    """ZeRO-3 with the optimizer states on CPU (DeepSpeed's cpu_adam), from the same recipe."""
    offload = train(
        "2gpu-1.5b-zero3-offload-opt-sleep-on",
        "recipes/gpu-1.5b-layout-zero3.yaml",
        tmp_path / "offload",
        "0,1",
        "distributed.offload_optimizer=true",
    )
    run = tmp_path / "offload"
    config = json.loads((run / "deepspeed.json").read_text())
    assert config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    # Adam states of 1.5B params (~18 GiB in fp32 over 2 ranks) live on CPU: less GPU memory than without offload.
    assert offload["gpu_used_gib_at_step_end_median"] < 32


# ---------------------------------------------------------------------------------------------- colocate-rl's engine
# GPU_TEST_ONE picks the GPU of the one-GPU engine tests (default 0), so they can run beside a benchmark.
ONE = os.environ.get("GPU_TEST_ONE", "0")
PLAIN = ("distributed.deepspeed=null", "distributed.zero_stage=null")


def run_cli(run_dir: Path, visible: str, recipe: str, steps: int, *sets: str) -> tuple[int, str]:
    """`colocate-rl train` → (exit code, console output + train.log)."""
    args = [
        "train",
        recipe,
        "--run-dir",
        str(run_dir),
        "--set",
        f"trainer.max_steps={steps}",
        "--set",
        "output.save_model=false",
    ]
    for item in sets:
        args += ["--set", item]
    result = cli(args, visible)
    log = (run_dir / "train.log").read_text(errors="replace") if (run_dir / "train.log").exists() else ""
    return result.returncode, result.stdout + result.stderr + log


def step_records(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir) if "time/step_s" in r]


def test_engine_options_reach_vllm(tmp_path):
    code, text = run_cli(
        tmp_path / "opts",
        ONE,
        "recipes/gpu-0.5b-layout.yaml",
        3,
        *PLAIN,
        "generation.enforce_eager=true",
        "generation.enable_prefix_caching=false",
        "generation.kv_cache_memory=4GiB",
        "generation.max_num_batched_tokens=8192",
        "generation.max_num_seqs=96",
    )
    assert code == 0, text[-6000:]
    [memory] = [e for e in events.read_events(tmp_path / "opts", events.ENGINE_MEMORY) if e["rank"] == 0]
    built = memory["config"]  # read back from vLLM's config
    print(json.dumps(built))
    assert built["enforce_eager"] is True and built["enable_prefix_caching"] is False
    assert built["kv_cache_memory_bytes"] == 4 * 2**30 and built["enable_sleep_mode"] is True
    assert built["max_num_seqs"] == 96 and built["max_num_batched_tokens"] == 8192


@pytest.mark.parametrize("level", [1, 2])
def test_engine_cycle_per_sleep_level(tmp_path, level):
    run = tmp_path / f"level{level}"
    code, text = run_cli(
        run,
        ONE,
        "recipes/gpu-0.5b-layout.yaml",
        4,
        *PLAIN,
        "generation.enforce_eager=true",
        f"generation.sleep_level={level}",
    )
    assert code == 0, text[-6000:]
    steps = step_records(run)
    assert len(steps) == 4
    for record in steps:  # every step woke, pushed, checked and slept
        for phase in ("wake", "sleep", "weight_sync", "weight_check", "generate"):
            assert record.get(f"time/{phase}_s", 0) > 0, (phase, record)
    [memory] = events.read_events(run, events.ENGINE_MEMORY)  # one rank
    awake, asleep = memory["awake_gib"], memory["asleep_gib"]
    assert memory["sleep_level"] == level
    print(
        json.dumps(
            {
                "level": level,
                "vllm_awake_gib": awake,
                "vllm_asleep_gib": asleep,
                "gpu_used_gib_at_step_end": [r["mem/gpu_used_gib"] for r in steps],
                "wake_s": [r["time/wake_s"] for r in steps],
                "sleep_s": [r["time/sleep_s"] for r in steps],
            }
        )
    )
    assert asleep < 0.1 * awake


FLAT_LOGPROBS_SCRIPT = """
import json, sys
from vllm import LLM, SamplingParams
from trl.generation.vllm_generation import extract_logprobs as trl_extract
from colocate_rl.rank import vllm_engine as E
from colocate_rl.rank.adapter import vllm as vl

llm = LLM(model=sys.argv[1], enforce_eager=True, gpu_memory_utilization=0.2, max_model_len=256, seed=0,
          logprobs_mode="processed_logprobs")
prompts = [{"prompt_token_ids": [10 + i, 20 + i, 30]} for i in range(16)]
kwargs = dict(temperature=1.0, max_tokens=48, logprobs=0, seed=3, detokenize=False)
flat = llm.generate(prompts, SamplingParams(**kwargs, flat_logprobs=True), use_tqdm=False)
nested = llm.generate(prompts, SamplingParams(**kwargs), use_tqdm=False)


def sampled(trl_result):  # what TRL's generation step keeps of extract_logprobs: the sampled token's, per position
    logprobs, token_ids = trl_result
    return [[lp[0] for lp in seq] for seq in logprobs], [[t[0] for t in seq] for seq in token_ids]


assert all(vl.flat_logprobs(o) is not None for r in flat for o in r.outputs), "flat outputs not read as flat lists"
ours, ours_nested = E.read_outputs(flat), E.read_outputs(nested)
assert (ours.logprobs, ours.completion_ids) == sampled(trl_extract(flat)), "flat: read_outputs differs from TRL's"
assert (ours_nested.logprobs, ours_nested.completion_ids) == sampled(trl_extract(nested)), "nested: differs from TRL's"
same_ids = ours.completion_ids == ours_nested.completion_ids
diff = max(abs(a - b) for s, t in zip(ours.logprobs, ours_nested.logprobs) for a, b in zip(s, t)) if same_ids else None
tokens = sum(len(s) for s in ours.completion_ids)
print(json.dumps({"tokens": tokens, "nested_same_tokens": same_ids, "nested_max_diff": diff}))
"""


def test_flat_logprobs_read_as_trl_does(tmp_path):
    """vLLM 0.26's real flat logprobs (what colocate-rl's engine asks for) read by `read_outputs` from the flat lists
    give what TRL's `extract_logprobs` gives on the same outputs (the sampled token's logprob and id per position),
    and so do nested logprobs read per position; flat against nested of the same seeded requests is printed."""
    from colocate_rl.builtin_model import build_model_in_subprocess

    model = build_model_in_subprocess("qwen2.5-0.5b", tmp_path / "model", dtype="bfloat16")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ONE}
    done = subprocess.run(
        [sys.executable, "-c", FLAT_LOGPROBS_SCRIPT, str(model)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-6000:]
    figures = json.loads([line for line in done.stdout.splitlines() if line.startswith('{"tokens"')][-1])
    print(figures)
    assert figures["tokens"] > 0


def test_sleep_level_auto_runs_the_level_the_plan_chose(tmp_path):
    """`generation.sleep_level: auto` on the 0.5B layout (one GPU): `validate` names the level (0 on an H200: the
    trainer and vLLM's 25 % fit together), the run writes it into its recipe.yaml, the engine started at it, and the
    run finished."""
    from colocate_rl.recipe.load import load_recipe

    recipe, sets = "recipes/gpu-0.5b-layout.yaml", ("generation.sleep_level=auto", "generation.enforce_eager=true")
    planned = cli(["validate", recipe, *(x for s in sets for x in ("--set", s))], ONE)
    assert planned.returncode == 0, planned.stdout + planned.stderr
    [line] = [x for x in planned.stdout.splitlines() if x.startswith("generation.sleep_level auto: ")]
    level = int(line.split(": ", 1)[1].split()[0])
    run = tmp_path / "auto"
    code, text = run_cli(run, ONE, recipe, 3, *sets)
    assert code == 0, text[-6000:]
    assert len(step_records(run)) == 3 and (run / "DONE").exists()
    assert load_recipe(run / "recipe.yaml").generation.sleep_level == level
    [memory] = events.read_events(run, events.ENGINE_MEMORY)  # one rank
    assert memory["sleep_level"] == level
    print(json.dumps({"line": line, "asleep_gib": memory["asleep_gib"]}))


def test_micro_batch_auto_runs_the_size_the_plan_chose(tmp_path):
    """`trainer.micro_batch_size: auto` on the 0.5B layout (one GPU), a step of 8 × 4 completions: `validate` names
    the size, TRL trains with it (launch.json), the run finishes with the step's completions unchanged."""
    recipe = "recipes/gpu-0.5b-layout.yaml"
    sets = (
        "trainer.per_device_train_batch_size=8",
        "trainer.gradient_accumulation_steps=4",
        "trainer.micro_batch_size=auto",
        "generation.enforce_eager=true",
    )
    planned = cli(["validate", recipe, *(x for s in sets for x in ("--set", s))], ONE)
    assert planned.returncode == 0, planned.stdout + planned.stderr
    [line] = [x for x in planned.stdout.splitlines() if x.startswith("trainer.micro_batch_size auto: ")]
    size = int(line.split(": ", 1)[1].split()[0])
    assert size in (8, 16, 32)
    run = tmp_path / "micro"
    code, text = run_cli(run, ONE, recipe, 3, *sets)
    assert code == 0, text[-6000:]
    trl = json.loads((run / "launch.json").read_text())["trl_args"]
    assert (trl["per_device_train_batch_size"], trl["gradient_accumulation_steps"]) == (size, 32 // size)
    assert len(step_records(run)) == 3 and (run / "DONE").exists()
    print(json.dumps({"line": line, "s_per_step": [r.get("time/step_s") for r in step_records(run)]}))


STALE_REWARD = """
import colocate_rl.rank.vllm_engine as E

_push, _calls = E.VLLMEngine._push, []


def _push_only_once(self):  # fault injected by the test: after the first push, vLLM never gets new weights
    _calls.append(1)
    if len(_calls) == 1:
        _push(self)


E.VLLMEngine._push = _push_only_once


def reward(completions, **kwargs):  # random: non-zero advantages, so the trainer's weights do move
    import random

    return [random.random() for _ in completions]
"""


def test_stale_weights_stop_the_run(tmp_path):
    reward = tmp_path / "stale_reward.py"
    reward.write_text(STALE_REWARD)
    code, text = run_cli(
        tmp_path / "stale",
        ONE,
        "recipes/gpu-0.5b-layout.yaml",
        4,
        *PLAIN,
        "generation.enforce_eager=true",
        "generation.sleep_level=1",
        "trainer.learning_rate=1e-3",
        f"rewards=[{{name: '{reward}:reward'}}]",
    )
    assert code != 0
    assert "vLLM is not generating from the trainer's current weights" in text, text[-6000:]
    assert "model.layers.23.mlp.down_proj.weight differs" in text
    [stale] = events.read_events(tmp_path / "stale", events.STALE_WEIGHTS)  # one rank
    assert "vLLM is not generating from the trainer's current weights" in stale["message"]


def test_trainer_offload_lets_a_larger_kv_cache_fit(tmp_path):
    """1.5B layout, ZeRO-2 on one GPU. During generation the trainer holds ~24 GiB without offload (bf16 weights
    2.9, fp32 master 5.7, Adam 11.5, gradients 2.9, context) and ~4.5 GiB with it; vLLM needs its weights (2.9),
    ~2 GiB of buffers and the KV cache. A 120 GiB KV budget fits the 139.8 GiB H200 only with the offload."""
    sets = (
        "distributed.deepspeed=zero3",
        "distributed.zero_stage=2",
        "generation.enforce_eager=true",
        "generation.kv_cache_memory=120GiB",
        "trainer.per_device_train_batch_size=8",
    )
    code_off, text_off = run_cli(tmp_path / "no-offload", ONE, "recipes/gpu-1.5b-layout-zero3.yaml", 4, *sets)
    code_on, text_on = run_cli(
        tmp_path / "offload",
        ONE,
        "recipes/gpu-1.5b-layout-zero3.yaml",
        4,
        *sets,
        "generation.offload_trainer_during_generation=true",
    )
    steps = step_records(tmp_path / "offload")
    print(
        json.dumps(
            {
                "without_offload_exit": code_off,
                "without_offload_steps": len(step_records(tmp_path / "no-offload")),
                "with_offload_exit": code_on,
                "offload_s": [r.get("time/offload_s") for r in steps],
                "reload_s": [r.get("time/reload_s") for r in steps],
                "gpu_peak_gib": [r.get("mem/gpu_peak_gib") for r in steps],
            }
        )
    )
    assert code_on == 0, text_on[-6000:]
    assert code_off != 0 and "out of memory" in text_off.lower(), text_off[-6000:]
    assert all(r.get("time/offload_s", 0) > 0 and r.get("time/reload_s", 0) > 0 for r in steps[1:])


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")
def test_zero3_bucketed_sync_delivers_the_trainer_weights(tmp_path):
    """Small buckets (64 MiB: many coalesced gathers per sync) and the weight check on every step."""
    run = tmp_path / "z3"
    code, text = run_cli(
        run,
        "0,1",
        "recipes/gpu-1.5b-layout-zero3.yaml",
        4,
        "generation.enforce_eager=true",
        "generation.weight_sync_bucket_mb=64",
        "trainer.learning_rate=1e-4",
    )
    assert code == 0, text[-6000:]
    assert all(r.get("time/weight_check_s", 0) > 0 for r in step_records(run))


def test_mem_probe_measures_with_the_recipes_layout(tmp_path):
    """The measuring probe on one GPU, coarse (resolution 0.1, 2 steps a trial): it finds a passing share, every trial
    trains with the ZeRO-2 layout auto picks at the recipe's share (not the offload layout auto would pick at a
    large share), and the measured generation peak is within 10 % of the estimate."""
    probe_dir = tmp_path / "probe"
    result = cli(
        [
            "mem-probe",
            "recipes/gpu-0.5b-layout.yaml",
            "--json",
            "--probe-dir",
            str(probe_dir),
            "--steps",
            "2",
            "--resolution",
            "0.1",
            "--set",
            "generation.enforce_eager=true",
        ],
        ONE,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    data = json.loads(result.stdout.strip().splitlines()[-1])
    print(json.dumps({k: data[k] for k in ("largest_passing", "recommended", "phases", "layout_check", "pinned_sets")}))
    assert data["largest_passing"] is not None and "distributed.zero_stage=2" in data["pinned_sets"]
    for trial in data["trials"]:
        config = json.loads((probe_dir / trial["run_dir"].rsplit("/", 1)[-1] / "deepspeed.json").read_text())
        assert config["zero_optimization"]["stage"] == 2, trial["run_dir"]
    generation = next(p for p in data["phases"] if p["phase"] == "generation")
    assert abs(generation["error_pct"]) <= 10, generation
    assert data["layout_check"]["confirmed"] is True, data["layout_check"]


@pytest.mark.parametrize(
    "recipe, visible, sets",
    [
        ("recipes/gpu-0.5b-layout.yaml", ONE, PLAIN),
        pytest.param(
            "recipes/gpu-1.5b-layout-zero3.yaml",
            "0,1",
            (),
            marks=pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs"),
        ),
    ],
    ids=["1gpu", "2gpus-zero3"],
)
def test_stop_and_resume_with_the_colocated_engine(tmp_path, recipe, visible, sets):
    """SIGTERM mid-run: the ranks save a checkpoint and stop (exit 143); `train --resume` continues to max_steps with
    every step recorded once, vLLM generating from the resumed weights (the weight check runs on every resumed step
    and would stop the run otherwise)."""
    import signal
    import time

    from colocate_rl.rundir import RunDir, step_records

    run = tmp_path / "run"
    args = ["train", recipe, "--run-dir", str(run)]
    for item in (*sets, "generation.enforce_eager=true", "trainer.max_steps=24", "output.save_model=false"):
        args += ["--set", item]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": visible, "COLUMNS": "200"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "colocate_rl", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    guard = time.monotonic() + 900
    while len(step_records(run)) < 8:
        assert proc.poll() is None and time.monotonic() < guard, proc.stdout.read()[-6000:]
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 143, out[-6000:]
    [stopped] = events.read_events(run, events.STOPPED)
    resumed = cli(["train", "--resume", str(run)], visible)
    log = (run / "train.log").read_text(errors="replace")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + log[-6000:]
    steps = step_records(run)
    assert [r["step"] for r in steps] == list(range(1, 25))
    after = [r for r in steps if r["step"] > stopped["step"]]
    assert after and all(r.get("time/weight_check_s", 0) > 0 for r in after)
    assert RunDir(run).done.exists()
    print(
        json.dumps(
            {
                "gpus": visible,
                "recipe": recipe,
                "stopped_at": stopped["step"],
                "reward": [round(r["reward"], 4) for r in steps],
                "s_per_step_after_resume": statistics.median(r["time/step_s"] for r in after[1:]),
                "gpu_used_gib_at_step_end": [r["mem/gpu_used_gib"] for r in steps],
            }
        )
    )


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")
def test_two_gpus_as_two_nodes_stop_together_and_resume(tmp_path):
    """Two nodes of one GPU each through scripts/multinode.sh (c10d on localhost, NCCL, one shared run dir):
    SIGTERM to node 1 alone stops both with one checkpoint; resuming on both nodes reaches max_steps, every step
    once, the weight check on every resumed step."""
    import signal
    import socket
    import time

    from colocate_rl.rundir import RunDir, step_records

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = tmp_path / "run"

    def node(rank: int, *args: str) -> subprocess.Popen:
        env = {
            **os.environ,
            "CUDA_VISIBLE_DEVICES": str(rank),
            "COLUMNS": "200",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "NNODES": "2",
            "NODE_RANK": str(rank),
            "COLOCATE_RL": f"{sys.executable} -m colocate_rl",
        }
        return subprocess.Popen(
            ["bash", "scripts/multinode.sh", *args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    sets = []
    for item in (*PLAIN, "generation.enforce_eager=true", "trainer.max_steps=16", "output.save_model=false"):
        sets += ["--set", item]
    nodes = [node(k, "recipes/gpu-0.5b-layout.yaml", "--run-dir", str(run), *sets) for k in (0, 1)]
    guard = time.monotonic() + 900
    while len(step_records(run)) < 5:
        assert all(p.poll() is None for p in nodes) and time.monotonic() < guard, [
            p.stdout.read()[-4000:] for p in nodes if p.poll() is not None
        ]
        time.sleep(0.5)
    t0 = time.monotonic()
    nodes[1].send_signal(signal.SIGTERM)
    outs = [p.communicate(timeout=600)[0] for p in nodes]
    stop_s = time.monotonic() - t0
    assert [p.returncode for p in nodes] == [143, 143], [o[-4000:] for o in outs]
    [stopped] = events.read_events(run, events.STOPPED)
    assert RunDir(run).complete_checkpoints()[-1].name == f"checkpoint-{stopped['step']}"
    resumed = [node(k, "--resume", str(run)) for k in (0, 1)]
    outs = [p.communicate(timeout=900)[0] for p in resumed]
    assert [p.returncode for p in resumed] == [0, 0], [o[-4000:] for o in outs]
    steps = step_records(run)
    assert [r["step"] for r in steps] == list(range(1, 17))
    after = [r for r in steps if r["step"] > stopped["step"]]
    assert after and all(r.get("time/weight_check_s", 0) > 0 for r in after)
    print(
        json.dumps(
            {
                "stopped_at": stopped["step"],
                "both_nodes_stopped_s": round(stop_s, 1),
                "reward": [round(r["reward"], 4) for r in steps],
                "s_per_step_after_resume": statistics.median(r["time/step_s"] for r in after[1:]),
            }
        )
    )


def test_gpu_memory_at_the_step_end_does_not_grow_over_500_steps(tmp_path):
    """500 steps of the full engine cycle (generate, sleep, train, wake, sync, weight check): the least-squares slope
    of the GPU memory in use at the step end, over steps 50-500, stays under 1 MiB per step (0.5 GiB over the run)."""
    from colocate_rl.rundir import step_records

    run = tmp_path / "run"
    sets = (
        *PLAIN,
        "generation.enforce_eager=true",
        "trainer.max_steps=500",
        "trainer.max_completion_length=16",
        "trainer.per_device_train_batch_size=16",
        "output.save_model=false",
    )
    args = ["train", "recipes/gpu-0.5b-layout.yaml", "--run-dir", str(run)]
    for item in sets:
        args += ["--set", item]
    result = cli(args, ONE)
    log = (run / "train.log").read_text(errors="replace") if (run / "train.log").exists() else ""
    assert result.returncode == 0, result.stdout[-3000:] + log[-6000:]
    steps = step_records(run)
    assert len(steps) == 500
    xs = [r["step"] for r in steps[49:]]
    ys = [r["mem/gpu_used_gib"] for r in steps[49:]]
    slope = statistics.linear_regression(xs, ys).slope
    figures = {
        "slope_mib_per_step": round(slope * 1024, 4),
        "gpu_used_gib_at_step_end": {s: steps[s - 1]["mem/gpu_used_gib"] for s in (1, 50, 100, 200, 300, 400, 500)},
        "torch_allocated_gib_at_step_end": {s: steps[s - 1]["mem/torch_allocated_gib"] for s in (1, 50, 500)},
        "s_per_step_median": statistics.median(r["time/step_s"] for r in steps[1:]),
    }
    print(json.dumps(figures))
    assert slope * 1024 < 1.0, figures


REAL_MODEL = os.environ.get("REAL_MODEL_DIR")  # SmolLM2-135M-Instruct as a transformers directory
REAL_DATA = os.environ.get("REAL_DATA_DIR")  # gsm_symbolic_{train,test}.jsonl (../shared/real-model/data)


@pytest.mark.skipif(not (REAL_MODEL and REAL_DATA), reason="needs REAL_MODEL_DIR and REAL_DATA_DIR")
@pytest.mark.parametrize("lora", [True], ids=["lora"])
def test_real_model_with_eval(tmp_path, lora):
    """recipes/smollm2-135m-gsm8k.yaml on the real model and data: GRPO with held-out greedy evaluation through the
    colocated engine; with LoRA vLLM generates from base + adapter (the weight check compares the adapted weights
    on every step), final/ holds the adapter and merged/ the merged model."""
    from colocate_rl.rundir import step_records

    run = tmp_path / "run"
    steps = int(os.environ.get("REAL_STEPS", "30"))
    sets = [
        f"model.name={REAL_MODEL}",
        f"data.source={REAL_DATA}/gsm_symbolic_train.jsonl",
        f"eval.source={REAL_DATA}/gsm_symbolic_test.jsonl",
        f"trainer.max_steps={steps}",
        "eval.every_steps=10",
        "eval.num_samples=64",
        "generation.enforce_eager=true",
    ]
    if lora:
        sets += ["model.lora={r: 16, alpha: 32, save_merged: true}", "trainer.learning_rate=2.0e-4"]
    args = ["train", "recipes/smollm2-135m-gsm8k.yaml", "--run-dir", str(run)]
    for item in sets:
        args += ["--set", item]
    result = cli(args, ONE)
    log = (run / "train.log").read_text(errors="replace") if (run / "train.log").exists() else ""
    assert result.returncode == 0, result.stdout[-3000:] + log[-8000:]
    records = read_metrics(run)
    train_steps = step_records(run)
    evals = [r for r in records if "eval/reward" in r]
    assert len(train_steps) == steps and [r["step"] for r in evals] == list(range(0, steps + 1, 10))
    # every push is checked; the step after an evaluation pushes nothing (the evaluation pushed these weights)
    after_eval = {r["step"] + 1 for r in evals}
    assert all(r.get("time/weight_check_s", 0) > 0 for r in train_steps if r["step"] not in after_eval)
    final = run / "final"
    if lora:
        assert (final / "adapter_model.safetensors").is_file() and (final / "merged" / "config.json").is_file()
    print(
        json.dumps(
            {
                "lora": lora,
                "eval_reward": [(r["step"], round(r["eval/reward"], 4)) for r in evals],
                "eval_by_reward": {k: v for k, v in evals[-1].items() if k.startswith("eval/")},
                "reward_first_last5": [
                    round(statistics.mean(r["reward"] for r in train_steps[:5]), 4),
                    round(statistics.mean(r["reward"] for r in train_steps[-5:]), 4),
                ],
                "s_per_step_median": statistics.median(r["time/step_s"] for r in train_steps[1:]),
                "sync_s_median": statistics.median(r.get("time/weight_sync_s", 0) for r in train_steps[1:]),
                "gpu_peak_gib_max": max(r["mem/gpu_peak_gib"] for r in train_steps),
                "final_mib": round(sum(f.stat().st_size for f in final.rglob("*") if f.is_file()) / 2**20, 1),
            }
        )
    )


def _tool_figures(run) -> dict:
    """What a tool run did, step by step and on the held-out prompts."""
    from colocate_rl.rundir import step_records

    steps, records = step_records(run), read_metrics(run)
    evals = [r for r in records if "eval/reward" in r]

    def mean(key, part):
        values = [r.get(key, 0.0) for r in part]
        return round(statistics.mean(values), 4) if values else None

    tenth = max(len(steps) // 10, 1)
    return {
        "steps": len(steps),
        "tool_calls_per_episode_first_last_tenth": [
            mean("tools/call_frequency", steps[:tenth]),
            mean("tools/call_frequency", steps[-tenth:]),
        ],
        "failure_frequency_first_last_tenth": [
            mean("tools/failure_frequency", steps[:tenth]),
            mean("tools/failure_frequency", steps[-tenth:]),
        ],
        "turns_per_episode_first_last_tenth": [
            mean("tools/turns_per_episode", steps[:tenth]),
            mean("tools/turns_per_episode", steps[-tenth:]),
        ],
        "reward_first_last_tenth": [mean("reward", steps[:tenth]), mean("reward", steps[-tenth:])],
        "eval": [
            (r["step"], r["eval/reward"], r.get("eval/tool_calls_per_episode"), r.get("eval/answer_match"))
            for r in evals
        ],
        "s_per_step_median": statistics.median(r["time/step_s"] for r in steps[1:]),
        "tools_s_median": statistics.median(r.get("time/tools_s", 0.0) for r in steps[1:]),
        "gpu_peak_gib_max": max(r["mem/gpu_peak_gib"] for r in steps),
    }


@pytest.mark.skipif(not REAL_MODEL, reason="needs REAL_MODEL_DIR")
def test_calculator_tool_on_the_real_model(tmp_path):
    """recipes/smollm2-135m-calculator.yaml on SmolLM2-135M-Instruct: episodes that call the built-in calculator,
    generated by the colocated vLLM engine (held awake over the turns), the weight check on every step, held-out
    episodes scored every eval.every_steps. Prints tool calls per episode and the held-out reward over the steps."""
    run = tmp_path / "run"
    steps = int(os.environ.get("TOOL_STEPS", "100"))
    sets = [f"model.name={REAL_MODEL}", f"trainer.max_steps={steps}", "generation.enforce_eager=true"]
    sets += os.environ.get("TOOL_SETS", "").split()
    args = ["train", "recipes/smollm2-135m-calculator.yaml", "--run-dir", str(run)]
    for item in sets:
        args += ["--set", item]
    result = cli(args, ONE)
    log = (run / "train.log").read_text(errors="replace") if (run / "train.log").exists() else ""
    assert result.returncode == 0, result.stdout[-3000:] + log[-8000:]
    figures = _tool_figures(run)
    print(json.dumps(figures))
    (Path(os.environ.get("GPU_FIGURES", tmp_path)) / "calculator.json").write_text(json.dumps(figures))
    assert figures["steps"] == steps and figures["eval"][0][0] == 0


def test_quickstart_tools_through_the_colocated_engine(tmp_path):
    """recipes/quickstart-tools.yaml with vLLM: the built-in tiny-calc model calls the calculator, so vLLM generates
    second turns (after the tool's result) under one hold; the weight check on every step; held-out tool calls per
    episode and right answers rise as on CPU (tests/test_e2e.py)."""
    from colocate_rl.rundir import step_records

    run = tmp_path / "run"
    steps = int(os.environ.get("QT_STEPS", "30"))
    args = ["train", "recipes/quickstart-tools.yaml", "--run-dir", str(run), "--set", f"trainer.max_steps={steps}"]
    args += ["--set", "generation.enforce_eager=true"]
    result = cli(args, ONE)
    log = (run / "train.log").read_text(errors="replace") if (run / "train.log").exists() else ""
    assert result.returncode == 0, result.stdout[-3000:] + log[-8000:]
    figures = _tool_figures(run)
    figures["s_per_step_median"] = statistics.median(r["time/step_s"] for r in step_records(run)[1:])
    print(json.dumps(figures))
    (Path(os.environ.get("GPU_FIGURES", tmp_path)) / "quickstart_tools.json").write_text(json.dumps(figures))
    evals = [r for r in read_metrics(run) if "eval/reward" in r]
    assert evals[0]["eval/tool_calls_per_episode"] < 0.5 < evals[-1]["eval/tool_calls_per_episode"], evals
    assert evals[-1]["eval/turns_per_episode"] > 1.5 and evals[-1]["eval/answer_match"] > evals[0]["eval/answer_match"]
    # every push is checked; the step after an evaluation pushes nothing (the evaluation pushed these weights)
    after_eval = {r["step"] + 1 for r in evals}
    assert all(r.get("time/weight_check_s", 0) > 0 for r in step_records(run) if r["step"] not in after_eval)


def train_recipe(tmp_path: Path, recipe: dict) -> Path:
    """`colocate-rl train` of a recipe given as a mapping, on the one-GPU tests' GPU; returns its run directory."""
    path, run = tmp_path / f"{recipe['name']}.yaml", tmp_path / "run"
    path.write_text(json.dumps(recipe))
    result = cli(["train", str(path), "--run-dir", str(run)], ONE)
    log = (run / "train.log").read_text(errors="replace") if (run / "train.log").exists() else ""
    assert result.returncode == 0, result.stdout[-3000:] + log[-8000:]
    return run


def test_an_environment_the_model_calls_through_the_engine(tmp_path):
    """An `environment_factory` environment (tests/envs/calculator_env.py: the calculator as its method, its own
    `get_reward`) on builtin:tiny-calc, which calls it: TRL resets one environment per episode and vLLM generates the
    turn after each call; the environment's reward and the tool calls rise on the held-out episodes."""
    from colocate_rl.rundir import step_records

    recipe = {
        "name": "calculator-env",
        "model": {"name": "builtin:tiny-calc"},
        "data": {"source": "builtin:arithmetic", "chat": True},
        "rewards": [{"name": "answer_match"}],
        "tools": {"environment": f"{ROOT}/tests/envs/calculator_env.py:CalculatorEnv", "max_turns": 2, "max_calls": 1},
        "trainer": {
            "learning_rate": 5e-4,
            "per_device_train_batch_size": 16,
            "num_generations": 8,
            "max_completion_length": 64,
            "max_steps": int(os.environ.get("ENV_STEPS", "10")),
        },
        "eval": {"every_steps": int(os.environ.get("ENV_STEPS", "10")), "num_samples": 64, "temperature": 0.0},
        "generation": {"vllm_gpu_memory_utilization": 0.2, "enforce_eager": True},
    }
    run = train_recipe(tmp_path, recipe)
    evals = [r for r in read_metrics(run) if "eval/reward" in r]
    figures = {
        "eval": [[r["step"], r["eval/CalculatorEnv"], r["eval/tool_calls_per_episode"]] for r in evals],
        "s_per_step_median": statistics.median(r["time/step_s"] for r in step_records(run)[1:]),
    }
    print(json.dumps(figures))
    (Path(os.environ.get("GPU_FIGURES", tmp_path)) / "calculator_env.json").write_text(json.dumps(figures))
    assert (
        evals[-1]["eval/CalculatorEnv"] > evals[0]["eval/CalculatorEnv"] and evals[-1]["eval/turns_per_episode"] > 1.5
    )
    assert all("rewards/CalculatorEnv/mean" in r for r in step_records(run))


@pytest.mark.skipif(not REAL_MODEL, reason="needs REAL_MODEL_DIR")
def test_trls_environment_example_through_the_engine(tmp_path):
    """TRL's own environment example (`IncrementEnv`, tests/envs/increment_env.py) trained a few steps on the real
    model through colocate-rl's vLLM engine: TRL resets one environment per episode, its `increment` method is the
    tool, its `get_reward` scores the episode (logged as rewards/IncrementEnv)."""
    from colocate_rl.rundir import step_records

    recipe = {
        "name": "increment-env",
        "model": {"name": REAL_MODEL, "chat_template": "qwen2_5"},
        "data": {"source": str(ROOT / "tests/envs/increment.jsonl")},
        "rewards": [{"name": "tool_call_ok", "weight": 0.2}],
        "tools": {"environment": f"{ROOT}/tests/envs/increment_env.py:IncrementEnv", "max_turns": 3},
        "trainer": {
            "learning_rate": 1e-5,
            "per_device_train_batch_size": 16,
            "num_generations": 8,
            "max_completion_length": 256,
            "max_steps": int(os.environ.get("ENV_STEPS", "8")),
        },
        "generation": {"vllm_gpu_memory_utilization": 0.3, "enforce_eager": True},
        "distributed": {"deepspeed": None, "zero_stage": None},
    }
    run = train_recipe(tmp_path, recipe)
    steps = step_records(run)
    assert len(steps) == recipe["trainer"]["max_steps"]
    assert all("rewards/IncrementEnv/mean" in r and r.get("time/weight_check_s", 0) > 0 for r in steps)
    figures = {
        "call_frequency": [r.get("tools/call_frequency") for r in steps],
        "failure_frequency": [r.get("tools/failure_frequency") for r in steps],
        "increment_env_reward": [r["rewards/IncrementEnv/mean"] for r in steps],
        "s_per_step_median": statistics.median(r["time/step_s"] for r in steps[1:]),
    }
    print(json.dumps(figures))
    (Path(os.environ.get("GPU_FIGURES", tmp_path)) / "increment_env.json").write_text(json.dumps(figures))


@pytest.mark.skipif(not (REAL_MODEL and REAL_DATA), reason="needs REAL_MODEL_DIR and REAL_DATA_DIR")
def test_overlap_on_the_real_model_generates_a_step_ahead_through_the_engine_process(tmp_path):
    """recipes/smollm2-135m-gsm8k.yaml at 256 completions per step, A-B-A-B: the engine in the rank (overlap off) and
    in its own process with `generation.overlap: one_step`. With overlap every step after the first takes the batch
    generated while the step before trained, from weights pushed through the CUDA IPC staging buffer and checked
    there; TRL's importance-sampling correction logs sampling/*. Prints each run's median s/step and phases."""
    from colocate_rl.rundir import step_records

    steps = int(os.environ.get("OVERLAP_STEPS", "12"))
    base = [
        f"model.name={REAL_MODEL}",
        f"data.source={REAL_DATA}/gsm_symbolic_train.jsonl",
        "eval.every_steps=null",
        "trainer.gradient_accumulation_steps=8",
        f"trainer.max_steps={steps}",
        "generation.sleep_level=0",
    ]
    figures = []
    order = os.environ.get("OVERLAP_ORDER", "off,one_step,off,one_step").split(",")
    for k, overlap in enumerate(order):
        run = tmp_path / f"run{k}-{overlap}"
        args = ["train", "recipes/smollm2-135m-gsm8k.yaml", "--run-dir", str(run)]
        for item in [*base, f"generation.overlap={overlap}"]:
            args += ["--set", item]
        result = cli(args, ONE)
        log = (run / "train.log").read_text(errors="replace") if (run / "train.log").exists() else ""
        assert result.returncode == 0, result.stdout[-3000:] + log[-8000:]
        rows = step_records(run)
        assert len(rows) == steps
        later = rows[2:]

        def median(key, part=later):
            return round(statistics.median(r.get(key, 0.0) for r in part), 4)

        figures.append(
            {
                "run": k + 1,
                "overlap": overlap,
                "s_per_step_median": median("time/step_s"),
                **{p: median(f"time/{p}_s") for p in ("generate", "train", "weight_sync", "prepare", "reward")},
                "gpu_peak_gib_max": max(r["mem/gpu_peak_gib"] for r in rows),
                "reward_first_last": [round(rows[0]["reward"], 4), round(rows[-1]["reward"], 4)],
            }
        )
        if overlap == "one_step":
            assert [r["overlap/ahead"] for r in rows] == [0.0] + [1.0] * (steps - 1)
            assert all(r.get("time/weight_check_s", 0) > 0 for r in rows)  # every push checked in the engine process
            assert any(k.startswith("sampling/") for k in rows[-1]), sorted(rows[-1])
            assert log.count("(vllm) ready; staging buffer") == 1
            assert "engine core runs in process" not in log  # vllm_multiprocessing: false (the default)
    print(json.dumps(figures))
    (Path(os.environ.get("GPU_FIGURES", tmp_path)) / "overlap.json").write_text(json.dumps(figures))


def overlapped_real_run(run: Path, steps: int, *sets: str) -> tuple[subprocess.CompletedProcess, str, list[dict]]:
    """recipes/smollm2-135m-gsm8k.yaml on the real model at 256 completions per step with overlap and `sets`, for
    `steps` steps: (the `train` result, train.log, the step records); every step after the first generated ahead."""
    from colocate_rl.rundir import step_records

    args = ["train", "recipes/smollm2-135m-gsm8k.yaml", "--run-dir", str(run)]
    for item in (
        f"model.name={REAL_MODEL}", f"data.source={REAL_DATA}/gsm_symbolic_train.jsonl", "eval.every_steps=null",
        "trainer.gradient_accumulation_steps=8", f"trainer.max_steps={steps}", "generation.overlap=one_step",
        "output.save_model=false", *sets,
    ):  # fmt: skip
        args += ["--set", item]
    result = cli(args, ONE)
    log = (run / "train.log").read_text(errors="replace") if (run / "train.log").exists() else ""
    assert result.returncode == 0, result.stdout[-3000:] + log[-8000:]
    rows = step_records(run)
    assert len(rows) == steps and [r["overlap/ahead"] for r in rows] == [0.0] + [1.0] * (steps - 1)
    return result, log, rows


@pytest.mark.skipif(not (REAL_MODEL and REAL_DATA), reason="needs REAL_MODEL_DIR and REAL_DATA_DIR")
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_default_plan_overlaps_the_real_model_with_two_engine_processes_and_forecasts_it(tmp_path, lora):
    """recipes/smollm2-135m-gsm8k.yaml at 256 completions per step with overlap, the engine process and their count
    left to auto (the defaults), fully fine-tuned and with LoRA (merged into each push): the plan overlaps with two
    engine processes (a 135M model), every step after the first is generated ahead (and checked), and the run's
    forecast.json holds the overlapped forecast (on an H200: its rows were measured there). Prints forecast against
    measured (the overlapped rows' leave-one-out error: 5.5 % median, 49 % largest; LoRA is not modelled)."""
    import yaml

    run = tmp_path / "run"
    result, log, rows = overlapped_real_run(run, 8, "generation.overlap=auto", *["model.lora=true"] * lora)
    assert all(r.get("time/weight_check_s", 0) > 0 for r in rows)
    recorded = yaml.safe_load((run / "recipe.yaml").read_text())["generation"]
    assert (recorded["overlap"], recorded["engine_process"], recorded["engine_processes"]) == ("one_step", True, 2)
    assert "overlap one_step (auto)" in result.stdout and log.count("vLLM awake") == 2  # train's summary table
    forecast = json.loads((run / "forecast.json").read_text())
    measured = statistics.median(r["time/step_s"] for r in rows[2:])
    figures = {
        "s_per_step_median": round(measured, 4),
        "engine_generate_s": [round(r["engine_process/generate_s"], 3) for r in rows],
        "gpu_peak_gib_max": max(r["mem/gpu_peak_gib"] for r in rows),
    }
    if forecast["available"]:
        assert forecast["overlap"] == "2 engine processes"
        figures["forecast_s_per_step"] = forecast["s_per_step"]
        figures["forecast_error_pct"] = round(100 * (forecast["s_per_step"] - measured) / measured, 1)
    else:  # a GPU other than the H200s its rows were measured on (an H100 gave this): forecast.json says so instead
        reason = r"this machine's GPUs are (?!.*H200).+ and the rows were measured on H200s"
        assert re.fullmatch(reason, forecast["reason"]), forecast
    print(json.dumps(figures))
    name = f"default_overlap{'_lora' * lora}.json"
    (Path(os.environ.get("GPU_FIGURES", tmp_path)) / name).write_text(json.dumps(figures))


@pytest.mark.skipif(not (REAL_MODEL and REAL_DATA), reason="needs REAL_MODEL_DIR and REAL_DATA_DIR")
@pytest.mark.skipif(shutil.which("nvidia-cuda-mps-control") is None, reason="needs nvidia-cuda-mps-control")
def test_an_overlapped_run_under_its_own_mps_daemon(tmp_path):
    """recipes/smollm2-135m-gsm8k.yaml at 256 completions per step with overlap and `generation.mps: on`: torchrun,
    the trainer and its engine process run as clients of the daemon `colocate_rl.launch.mps` starts (its server
    starts for them, its logs in run/mps/), every step after the first generated ahead, and the daemon quits after the
    run. Prints the figures (at 135M MPS is not expected to be faster: auto turns it on from 1.7B)."""
    run = tmp_path / "run"
    result, log, rows = overlapped_real_run(run, 6, "generation.mps=on")
    assert "CUDA MPS daemon" in log and "under CUDA MPS" in result.stdout
    # the daemon's own log (control.log; in the foreground it may print to daemon.out instead) and the server's
    logs = {p.name: p.read_text(errors="replace") for p in sorted((run / "mps").rglob("*")) if p.is_file()}
    assert re.search(r"(?i)server", "\n".join(logs.values())), logs  # a server started for the run's clients
    assert not subprocess.run(["pgrep", "-f", "nvidia-cuda-mps"], capture_output=True).stdout  # none left
    figures = {
        "s_per_step_median": round(statistics.median(r["time/step_s"] for r in rows[2:]), 4),
        "train_s_median": round(statistics.median(r["time/train_s"] for r in rows[2:]), 4),
        "engine_generate_s": [round(r["engine_process/generate_s"], 3) for r in rows],
        "gpu_peak_gib_max": max(r["mem/gpu_peak_gib"] for r in rows),
        "mps_log_tails": {name: text.strip().splitlines()[-3:] for name, text in logs.items()},
    }
    print(json.dumps(figures))
    (Path(os.environ.get("GPU_FIGURES", tmp_path)) / "mps.json").write_text(json.dumps(figures))


@pytest.mark.skipif(not (REAL_MODEL and REAL_DATA), reason="needs REAL_MODEL_DIR and REAL_DATA_DIR")
def test_two_vllm_engine_processes_per_rank_share_each_overlapped_batch(tmp_path):
    """recipes/smollm2-135m-gsm8k.yaml at 256 completions per step with overlap and `generation.engine_processes: 2`:
    two vLLM engine processes on the rank's GPU, each with half of the share, each generating half of every batch,
    both loaded from the one CUDA IPC staging buffer and both checked after every push. Prints the figures."""
    _, log, rows = overlapped_real_run(tmp_path / "run", 6, "generation.engine_processes=2")
    assert all(r.get("time/weight_check_s", 0) > 0 for r in rows)
    assert re.search(r"engine processes \d+, \d+ \(vllm\) ready", log), log[-3000:]
    assert log.count("vLLM awake") == 2  # one vLLM engine in each engine process
    figures = {
        "s_per_step_median": round(statistics.median(r["time/step_s"] for r in rows[2:]), 4),
        "engine_generate_s": [round(r["engine_process/generate_s"], 3) for r in rows],
        "engine_cpu_s": [round(r["engine_process/cpu_s"], 3) for r in rows],
        "gpu_peak_gib_max": max(r["mem/gpu_peak_gib"] for r in rows),
    }
    print(json.dumps(figures))
    (Path(os.environ.get("GPU_FIGURES", tmp_path)) / "engine_processes.json").write_text(json.dumps(figures))
