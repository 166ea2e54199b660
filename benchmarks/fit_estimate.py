"""Fit the memory estimate's training allowance (`colocate_rl.memory.allowance.ALLOWANCE`) to training peaks measured
on H200s, and print the estimate's error on each.

    python benchmarks/fit_estimate.py            # the rows, the fit, the errors; ALLOWANCE as Python to paste

No GPU needed. Each row is a run's recipe (the shipped file, with the run's `--set` options and vLLM share) and the
GPU peak it measured while training (GiB per GPU, NVML, max over ranks; with vLLM awake, the share is in it). The
estimate's other terms are taken as they are; the allowance is what the peak holds beyond them while training:

    allowance = activations × (a + b without DeepSpeed) + trainer gradients × c + LM-head tile × d

with the gradients as the estimate holds them on the GPU (sharded by ZeRO-2/3, a bucket copy with DDP) and the tile
4,096 tokens × vocabulary × 4 bytes (TRL 1.16's fused LM head works in fp32 tiles of 4,096 tokens). a, b, c, d are
least squares of the relative error over the rows (every row alike). What each stands for is not measured: beyond the
activations autograd saves (tests/test_estimate.py checks that term on CPU) the driver sees ~10 % more with
DeepSpeed's bf16 and more again with torch's autocast over fp32 weights.

The rows, by source:
- docs/benchmarks/results/raw-2026-12-04b/mp05-probe.json: gpu-0.5b-layout at 256 completions, share 0.09, sleep
  0 and 2 × micro-batches 64, 128, 256 (the sweep's `peak_gib`).
- raw-2026-12-04/mp17-probe.json and raw-2026-12-04b/ab17-*: the SmolLM2-1.7B shape at 256 completions (a random-init
  copy; here the hub id, whose layout is the same), share 0.24, prompts of 181 tokens at most, sleep 0 × 32 and 2 × 64.
- generation-results.jsonl: c256 (SmolLM2-135M, micro-batches 32 and 128, share 0.3) and a128 (gpu-0.5b-layout
  without DeepSpeed, micro-batches 16 and 64, share 0.25), vLLM awake.
- raw-2026-12-04c/b15-*: the Qwen2.5-1.5B layout (built-in, random init) on one H200 at 256 completions, share 0.1 (auto),
  ZeRO-2: sleep 0 × 64 (the plan's choice), 2 × 64 and 0 × 32 (train runs, 6 steps; `mem/gpu_peak_gib`, max over steps);
  raw-2026-12-04c/o05-auto: the 0.5B layout at full auto (share 0.08, sleep 0 × 128).
- mem-probe-results.jsonl: gpu-0.5b-layout at micro-batch 16 with vLLM asleep (share 0.9, eager vLLM); the 1.5B ZeRO-2
  run on 2 GPUs of docs/benchmarks/README.md session 5.
- docs/benchmarks/gpu-runs.md: gpu-0.5b-layout without DeepSpeed at micro-batch 16, TRL's engine, asleep and awake (the
  NVML reading right after the optimizer step, where the allocator still holds the training peak).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from colocate_rl.memory import estimate as E  # noqa: E402
from colocate_rl.memory.allowance import ALLOWANCE, LM_HEAD_TILE_TOKENS  # noqa: E402
from colocate_rl.memory.shapes import layout_for  # noqa: E402
from colocate_rl.pipeline import resolve  # noqa: E402
from colocate_rl.plan.deepspeed import ZeroLayout  # noqa: E402
from colocate_rl.plan.host import assumed_host  # noqa: E402
from colocate_rl.recipe.load import apply_overrides, parse_recipe, parse_sets, read_yaml  # noqa: E402
from colocate_rl.recipe.shipped import find_recipe  # noqa: E402

H200_GIB = 143_771 / 1024
ZERO2 = ("distributed.deepspeed=zero3", "distributed.zero_stage=2", "distributed.offload_optimizer=false",
         "distributed.offload_params=false")  # fmt: skip
SMOL = ("eval.every_steps=null", "trainer.gradient_accumulation_steps=8", *ZERO2)
A05 = ("trainer.gradient_accumulation_steps=16", *ZERO2, "trainer.gradient_checkpointing=false")
B15 = ("trainer.per_device_train_batch_size=16", "trainer.gradient_accumulation_steps=16", *ZERO2,
       "trainer.gradient_checkpointing=false")  # fmt: skip
DDP = ("distributed.deepspeed=null", "distributed.zero_stage=null", "generation.sleep_level=0",
       "trainer.gradient_accumulation_steps=8")  # fmt: skip


AS_WRITTEN = "trainer.micro_batch_size=null"  # rows run before `micro_batch_size: auto` existed


def _sweep(sleep: int, micro: int) -> tuple[str, ...]:
    return (f"generation.sleep_level={sleep}", f"trainer.micro_batch_size={micro}")


# (row, recipe, GPUs, --set options, vLLM share (None: the recipe's), prompt tokens (None: measured by the pre-flight),
# measured GiB)
ROWS = [
    *(
        (f"0.5B 256 sleep {s} x {m} (mp05)", "gpu-0.5b-layout", 1, (*A05, *_sweep(s, m)), 0.09, None, peak)
        for s, m, peak in [
            (0, 64, 52.881),
            (0, 128, 79.105),
            (0, 256, 132.111),
            (2, 64, 41.393),
            (2, 128, 67.865),
            (2, 256, 120.801),
        ]  # fmt: skip
    ),
    *(
        (
            f"1.7B 256 sleep {s} x {m} ({src})",
            "smollm2-135m-gsm8k",
            1,
            ("model.name=HuggingFaceTB/SmolLM2-1.7B-Instruct", *SMOL, *_sweep(s, m)),
            0.24,
            181,
            peak,
        )  # fmt: skip
        for s, m, peak, src in [(0, 32, 108.703, "mp17"), (2, 64, 117.033, "mp17")]
    ),
    *(
        (
            f"135M c256 x {m}",
            "smollm2-135m-gsm8k",
            1,
            ("model.name=HuggingFaceTB/SmolLM2-135M-Instruct", *SMOL, *_sweep(0, m)),
            0.3,
            181,
            peak,
        )  # fmt: skip
        for m, peak in [(32, 58.812), (128, 91.299)]
    ),
    *(
        (f"0.5B a128 DDP x {m}", "gpu-0.5b-layout", 1, (*DDP, f"trainer.micro_batch_size={m}"), 0.25, None, peak)
        for m, peak in [(16, 48.836), (64, 82.719)]
    ),
    (
        "0.5B x 16 asleep (eager)",
        "gpu-0.5b-layout",
        1,
        ("generation.enforce_eager=true", *ZERO2, "trainer.gradient_checkpointing=false", AS_WRITTEN),
        0.9,
        None,
        20.215,
    ),  # fmt: skip
    *(
        (
            f"0.5B x 16 DDP {name} (gpu-runs)",
            "gpu-0.5b-layout",
            1,
            (
                "distributed.zero_stage=null",
                "trainer.gradient_checkpointing=false",
                "generation.engine=trl",
                AS_WRITTEN,
                *sets,
            ),
            None,
            40,
            peak,
        )  # fmt: skip
        for name, sets, peak in [("asleep", (), 14.554), ("awake", ("generation.sleep_level=0",), 49.773)]
    ),
    *(
        (f"1.5B 256 sleep {s} x {m} (b15)", "gpu-1.5b-layout-zero3", 1, (*B15, *_sweep(s, m)), 0.1, None, peak)
        for s, m, peak in [(0, 64, 104.65), (2, 64, 95.385), (0, 32, 76.877)]
    ),
    ("0.5B 256 sleep 0 x 128 (auto run)", "gpu-0.5b-layout", 1, (*A05, *_sweep(0, 128)), 0.08, None, 77.699),
    (
        "1.5B ZeRO-2 2 GPUs (eager)",
        "gpu-1.5b-layout-zero3",
        2,
        ("generation.enforce_eager=true", "distributed.zero_stage=2", AS_WRITTEN),
        0.5,
        None,
        30.367,
    ),  # fmt: skip
]


EARLIER_DEFAULTS = "generation.overlap=off"  # every row ran before overlap: auto became the default (a row may set it)


def row_estimate(recipe: str, gpus: int, sets: tuple[str, ...], util: float | None, prompt: int | None) -> E.Estimate:
    data = read_yaml(find_recipe(recipe))
    util_set = [f"generation.vllm_gpu_memory_utilization={util}"] * (util is not None)
    overrides = parse_sets([EARLIER_DEFAULTS, *sets, *util_set])
    r = resolve(parse_recipe(apply_overrides(data, overrides)), assumed_host(gpus, H200_GIB))
    return E.estimate(r, H200_GIB, prompt)


def features(e: E.Estimate, util: float) -> tuple[float, list[float]]:
    """(the training peak less the allowance, the allowance's features in GiB: activations, activations without
    DeepSpeed, the trainer gradients on the GPU, LM-head tiles)."""
    act = next(v["training"] for k, v in e.terms.items() if k.startswith("activations"))
    allowance = e.terms.get("training allowance", {}).get("training", 0.0)
    lay = layout_for(e.resolved.recipe.model.name, config=e.resolved.preflight.model_config)
    plain = ZeroLayout.of(e.resolved.deepspeed).stage is None
    tile = LM_HEAD_TILE_TOKENS * lay.vocab * 4 / E.GIB
    grads = e.terms.get("trainer gradients", {}).get("training", 0.0)
    return e.total("training", util) - allowance, [act, act * plain, grads, tile]


def analysis() -> dict:
    data = []
    for name, recipe, gpus, sets, util, prompt, measured in ROWS:
        e = row_estimate(recipe, gpus, sets, util, prompt)
        rest, xs = features(e, util)
        data.append((name, measured, rest, xs, e.total("training", util)))
    measured = np.array([m for _, m, *_ in data])
    rest = np.array([r for _, _, r, *_ in data])
    X = np.array([xs for *_, xs, _ in data])
    coef = np.linalg.lstsq(X / measured[:, None], (measured - rest) / measured, rcond=None)[0]
    fitted = dict(zip(ALLOWANCE, (float(c) for c in coef)))
    errors = {name: 100 * (est - m) / m for name, m, _, _, est in data}
    return {"fitted": fitted, "errors": errors}


def main() -> None:
    a = analysis()
    for name, err in a["errors"].items():
        print(f"{name:36} {err:+6.1f} % (the estimate as it stands)")
    print("\nALLOWANCE = {")
    for name, value in a["fitted"].items():
        print(f'    "{name}": {value:.4g},')
    print("}")


if __name__ == "__main__":
    main()
