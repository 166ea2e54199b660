"""The step-time forecast: seconds per step by phase, and the run's total, of a GPU run with colocate-rl's vLLM
engine on H200s, from a small model fitted to the measured rows of docs/benchmarks/results/.

A pure function of the resolved recipe and its host (like `colocate_rl.memory.estimate.estimate`). Per rank, with L =
trainer.max_completion_length (every row: 256; SmolLM2's mean completion, 216, as L fit no better, and is not known
before the run: a batch decodes until its longest completion ends, training pads each micro-batch to its longest), C =
completions per step, M = micro-batches per step, N = parameters in billions (a mixture of experts: those a token goes
through), V = the vocabulary:

    generation  = L · (decode step + C · (per sequence + N · per B params + V · per 100k vocabulary + KV · per MB
                  of KV read)), KV = the KV cache's bytes per token × L/2: what attention reads per decode step
                  half-way through the completion (the prompt not counted; SmolLM2-1.7B has 32 KV heads and 7× the
                  KV bytes per token of Qwen2.5-1.5B's 2)
    training    = max(M · (floor per micro-batch (by layout) + N · per B params with DeepSpeed), C · L · (N · per B
                  params + per token) (× 4/3 with checkpointing)) + optimizer step: a micro-batch takes the longer of
                  its floor (launches, DeepSpeed's per-pass work, which grows with the gradients it handles) and its
                  compute
    weight push = fixed + N · (woken weights when asleep + ZeRO-3 gathers)
    sleep/wake  = per step with vLLM asleep (levels 1 and 2)
    rest        = fixed + C · per completion + M · per micro-batch (by layout) + C · per completion of TRL's no-grad
                  forward for the old log-probabilities where it runs one (RLOO; GRPO's are formed in the loss since
                  colocate-rl e3de169: overlap-results' F, the mem-probe rows and the train runs ran without it):
                  TRL's preparation of the batch, the rewards and what no phase times (the step's time less the four
                  phases above)

Overlapped (`generation.overlap: one_step`), the rank's work runs beside the engine generating the next batch: by the
regime (`OVERLAP_FITTED`'s keys: engine processes, under CUDA MPS or not, MPS at NVIDIA's default client settings),
training and the rest take their in-turn time × a factor, and generation is the wait for the batch generated ahead:
the in-turn generation × a factor less the rank's training and rest, or none; the factors fit the overlapped rows
(relative least squares per regime), `OVERLAP_LEAVE_ONE_OUT` holds that fit's errors.

`FITTED` holds the constants least-squares fitted (relative error; training's by the side of the max each row is on)
by `benchmarks/fit_forecast.py` to the rows it lists (H200, vLLM 0.26, TRL 1.16; colocate-rl's engine alone on the GPU
with CUDA graphs), none below 0 (a term the fit would make negative is held at 0: generation's per B params is, as a
256-sequence batch's decode took no longer at 1.5B than at 0.5B, so a model beyond the rows' 1.7B is forecast to
generate too fast, and is named as beyond them), `LEAVE_ONE_OUT` the errors of that fit with each row left out in
turn; `tests/test_forecast.py` checks that both are what the script computes. A recipe the rows say nothing about
where a step spends its time differently (another GPU or the CPU, TRL's engine, eager vLLM, offload, tools, several
nodes, tensor parallelism, an overlap regime no row ran, vLLM's engine core apart, the engine process alone) gets no
forecast and the reason; what is beyond the rows but modelled (size, length, batch, GPUs, checkpointing) is named.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from colocate_rl import algorithms
from colocate_rl.errors import UserError
from colocate_rl.memory.forecast_fitted import (  # the fitted constants, here as forecast's own
    COVERED,
    FITTED,
    LEAVE_ONE_OUT,
    OVERLAP_COVERED,
    OVERLAP_FITTED,
    OVERLAP_LEAVE_ONE_OUT,
    STARTUP_S,
)
from colocate_rl.memory.shapes import layout_for
from colocate_rl.plan.deepspeed import ZeroLayout
from colocate_rl.plan.overlap import engine_copies

if TYPE_CHECKING:
    from colocate_rl.plan.host import Host
    from colocate_rl.plan.resolved import Resolved
    from colocate_rl.recipe.schema import Recipe

PHASES = ("generation", "training", "weight push", "sleep/wake", "rest")
# The timed phases (metrics.jsonl time/<name>_s) each forecast phase sums; "rest" is the step less all of them.
PHASE_METRICS = {
    "generation": ("generate",),
    "training": ("train", "optimizer"),
    "weight push": ("weight_sync", "weight_check"),
    "sleep/wake": ("wake", "sleep"),
    "rest": (),
}
H200_RANGE_GIB = (135.0, 145.0)  # GPU memory taken as an H200 (NVML reports 143,771 MiB = 140.4 GiB)
CHECKPOINTING = 4 / 3  # recomputing the forward adds 1 to forward + backward's 3 parts (no row measured it)
DOC = "docs/guide/memory.md#step-time-forecast"


@dataclass(frozen=True)
class Shape:
    """What the step-time model reads from a resolved recipe (one rank's step)."""

    params_b: float  # N: parameters in billions (a mixture of experts: those one token goes through)
    completions: int  # C: completions per step
    micro_batches: int  # M: forward/backward passes per step
    tokens: int  # L: trainer.max_completion_length
    stage: int | None  # ZeRO stage; None without DeepSpeed
    sleep_level: int
    checkpointing: bool
    gpus: int  # ranks per node
    vocab: int = 0  # the model's vocabulary (vLLM's sampler works over all of it for every sequence and token)
    kv_bytes: int = 0  # KV cache bytes per token, all layers (bf16): what attention reads per token of context
    old_forward: bool = False  # TRL's own no-grad forward for the old log-probabilities (RLOO; see the docstring)
    overlap: str | None = None  # overlapped: its regime (`overlap_regime`, a key of OVERLAP_FITTED); None: in turn

    @property
    def layout(self) -> str:
        return "plain" if self.stage is None else "zero3" if self.stage == 3 else "zero"


def overlap_regime(recipe: Recipe) -> str | None:
    """How an overlapped run of `recipe` shares the GPU, as OVERLAP_FITTED names it; None when it runs in turn."""
    g, n = recipe.generation, engine_copies(recipe)
    engines = "one engine process" if n == 1 else f"{n} engine processes"
    return engines + " under MPS" * (g.mps == "on") if g.overlap == "one_step" else None


def shape_of(resolved: Resolved) -> Shape:
    """The Shape of a GPU plan (UserError for a model whose layout is unknown)."""
    t = resolved.recipe.trainer
    lay = layout_for(resolved.recipe.model.name, config=resolved.preflight.model_config)
    return Shape(
        params_b=lay.active_params / 1e9,
        completions=t.step_completions,
        micro_batches=t.gradient_accumulation_steps,
        tokens=t.max_completion_length,
        stage=ZeroLayout.of(resolved.deepspeed).stage,
        sleep_level=int(resolved.recipe.generation.sleep_level),
        checkpointing=resolved.gradient_checkpointing,
        gpus=resolved.nproc_per_node,
        vocab=lay.vocab,
        kv_bytes=2 * lay.layers * lay.kv_heads * lay.hd * 2,
        old_forward=algorithms.get(resolved.recipe.algorithm).trainer == "rloo",
        overlap=overlap_regime(resolved.recipe),
    )


def _micro(layout: str) -> Callable[[Shape], float]:
    return lambda s: s.micro_batches * (s.layout == layout)


def _kv_read_mb(s: Shape) -> float:
    """MB of KV cache a sequence's decode step reads, at the completion's middle (the prompt not counted)."""
    return s.kv_bytes * s.tokens / 2 / 1e6


def _trained_tokens(s: Shape) -> float:
    return s.completions * s.tokens * (CHECKPOINTING if s.checkpointing else 1)


# phase → (constant, what it multiplies); FITTED holds the constants
TERMS: dict[str, tuple[tuple[str, Callable[[Shape], float]], ...]] = {
    "generation": (
        ("decode step", lambda s: s.tokens),
        ("decode step, per sequence", lambda s: s.tokens * s.completions),
        ("decode step, per sequence and B params", lambda s: s.tokens * s.completions * s.params_b),
        ("decode step, per sequence and 100k vocabulary", lambda s: s.tokens * s.completions * s.vocab / 1e5),
        ("decode step, per sequence and MB of KV read", lambda s: s.tokens * s.completions * _kv_read_mb(s)),
    ),
    "training": (
        ("micro-batch, no DeepSpeed", _micro("plain")),
        ("micro-batch, ZeRO-0/1/2", _micro("zero")),
        ("micro-batch, ZeRO-3", _micro("zero3")),
        ("micro-batch, DeepSpeed, per B params", lambda s: s.micro_batches * s.params_b * (s.stage is not None)),
        ("per B params and token trained", lambda s: s.params_b * _trained_tokens(s)),
        ("per token trained", _trained_tokens),
        ("DeepSpeed optimizer step", lambda s: s.stage is not None),
    ),
    "weight push": (
        ("push", lambda s: 1),
        ("push, per B params woken from sleep", lambda s: s.params_b * (s.sleep_level > 0)),
        ("push, per B params gathered (ZeRO-3)", lambda s: s.params_b * (s.stage == 3)),
    ),
    "sleep/wake": (("wake and sleep", lambda s: s.sleep_level > 0),),
    "rest": (
        ("rest", lambda s: 1),
        ("rest, per completion", lambda s: s.completions),
        ("rest, per micro-batch with DeepSpeed", lambda s: s.micro_batches * (s.stage is not None)),
        ("rest, per micro-batch under ZeRO-3", _micro("zero3")),
        ("rest, TRL's old-logprob forward per completion", lambda s: s.completions * s.old_forward),
    ),
}
# Training is not a sum: a micro-batch takes the longer of its floor (the CPU's launches and DeepSpeed's per-pass
# work, which the GPU's compute hides once a micro-batch is large) and its compute; the optimizer step adds.
FLOOR = ("micro-batch, no DeepSpeed", "micro-batch, ZeRO-0/1/2", "micro-batch, ZeRO-3",
         "micro-batch, DeepSpeed, per B params")  # fmt: skip
COMPUTE = ("per B params and token trained", "per token trained")


def phase_seconds(
    shape: Shape, fitted: dict[str, float] | None = None, overlap_fitted: dict[str, dict[str, float]] | None = None
) -> dict[str, float]:
    """Seconds per step of each phase for `shape`, with `fitted` constants (default FITTED) and, overlapped, the
    factors of its regime in `overlap_fitted` (default OVERLAP_FITTED): training and the rest beside the engine,
    and generation the wait for the batch generated ahead (none when the rank's work takes longer)."""
    turns = _in_turn(shape, FITTED if fitted is None else fitted)
    if shape.overlap is None:
        return turns
    f = (OVERLAP_FITTED if overlap_fitted is None else overlap_fitted)[shape.overlap]
    training, rest = turns["training"] * f["training"], turns["rest"] * f["rest"]
    ahead = turns["generation"] * f["generation"]  # the engine's batch, generated beside the rank's work
    return {**turns, "generation": max(0.0, ahead - training - rest), "training": training, "rest": rest}


def _in_turn(shape: Shape, fitted: dict[str, float]) -> dict[str, float]:
    """Seconds per step of each phase with generation and training in turn."""
    out = {}
    for phase in PHASES:
        parts = {name: fitted[name] * float(x(shape)) for name, x in TERMS[phase]}
        if phase == "training":
            floor, compute = (sum(parts.pop(name) for name in names) for names in (FLOOR, COMPUTE))
            parts["micro-batches"] = max(floor, compute)
        out[phase] = sum(parts.values())
    return out


def _gpu_problem(host: Host) -> tuple[str | None, str]:
    """(why these GPUs get no forecast, or None; how the forecast names them)."""
    gib = host.gpus[0].memory_gib
    if host.assumed:
        if H200_RANGE_GIB[0] <= gib <= H200_RANGE_GIB[1]:
            return None, f"{gib:g} GiB GPUs taken as H200s"
        return (
            f"the assumed GPUs have {gib:g} GiB and the rows were measured on H200s (140 GiB); --gpu-memory 140 plans "
            "for H200s",
            "",
        )
    names = sorted({g.name for g in host.gpus})
    if not all("H200" in name for name in names):
        return f"this machine's GPUs are {', '.join(names)} and the rows were measured on H200s", ""
    return None, "H200"


def refusal(resolved: Resolved) -> str | None:
    """Why `resolved` gets no forecast (one clause), or None."""
    r, g = resolved.recipe, resolved.recipe.generation
    zero = ZeroLayout.of(resolved.deepspeed)
    fixed = [
        k for k in ("steps_per_generation", "generation_batch_size", "num_iterations") if k in r.trainer.extra_args
    ]
    if r.distributed.nnodes > 1:  # first: every node writes the same forecast.json, whatever its GPUs
        return "several nodes; the rows ran on one"
    if resolved.device != "cuda" or not resolved.host.gpus:
        return "a CPU run; the step-time model is fitted to H200 GPU runs with vLLM"
    if resolved.backend != "vllm":
        return "generation with transformers; the step-time model is fitted to H200 GPU runs with vLLM"
    problem, _ = _gpu_problem(resolved.host)
    regime = overlap_regime(r)
    reasons = [
        (problem is not None, problem),
        (g.engine != "colocate-rl", "generation.engine: trl; the rows ran colocate-rl's engine"),
        (g.enforce_eager, "generation.enforce_eager; the rows ran vLLM with CUDA graphs"),
        (
            zero.offload_optimizer or zero.offload_params or g.offload_trainer_during_generation,
            "offload to CPU memory; no row offloaded",
        ),
        (r.tools.active, "tools (multi-turn episodes); no row used tools alone on a GPU"),
        (g.tensor_parallel_size > 1, "generation.tensor_parallel_size > 1; the rows ran 1"),
        (
            regime is not None and regime not in OVERLAP_FITTED,
            f"overlap with {regime}; the overlapped rows ran {', '.join(OVERLAP_FITTED)}",
        ),
        (g.vllm_multiprocessing, "generation.vllm_multiprocessing; no fitted row ran vLLM's engine core apart"),
        (
            g.engine_process is True and regime is None,
            "generation.engine_process without overlap; the rows generated in the rank's own process",
        ),
        (bool(fixed), f"trainer.extra_args.{fixed[0] if fixed else ''}; the rows generate once per step"),
    ]
    return next((why for bad, why in reasons if bad), None)


def _beyond(value: float, span: tuple, what: str, unit: str = "") -> list[str]:
    """`what value (rows: low–high)` when `value` is outside `span` by more than rounding."""
    low, high = span
    if low * 0.99 <= value <= high * 1.01:
        return []
    spec = ".3g" if unit else "d"  # parameters in billions, else whole numbers
    rows = f"{low:{spec}}" if low == high else f"{low:{spec}}–{high:{spec}}"
    return [f"{what} {value:{spec}}{unit} (rows: {rows}{unit})"]


def beyond_rows(resolved: Resolved, shape: Shape) -> list[str]:
    """What of `resolved` the fitted rows do not span, one phrase each."""
    r, c = resolved.recipe, COVERED
    notes = (
        _beyond(shape.params_b, c["params_b"], "parameters", "B")
        + _beyond(shape.tokens, c["tokens"], "max_completion_length")
        + _beyond(shape.completions, c["completions"], "completions per rank")
        + _beyond(shape.micro_batches, c["micro_batches"], "micro-batches per step")
        + _beyond(shape.gpus, c["gpus"], "GPUs")
    )
    notes += ["gradient checkpointing (no row; its recompute taken as 1/3 more compute)"] * shape.checkpointing
    notes += [f"ZeRO-{shape.stage} (rows: no DeepSpeed, ZeRO-2, ZeRO-3; taken as ZeRO-2)"] * (shape.stage in (0, 1))
    notes += ["sleep level 1 (rows: 0 and 2; taken as 2)"] * (shape.sleep_level == 1)
    notes += ["LoRA (not modelled; the one LoRA row took 1.22× its full fine-tuning row)"] * (r.model.lora is not None)
    notes += ["beta > 0 (the reference model's forward is not modelled)"] * (r.trainer.beta > 0)
    notes += ["reward models (their forward is not modelled)"] * any(x.model for x in r.rewards)
    mps = resolved.host.mps_settings if shape.overlap is not None and r.generation.mps == "on" else ()
    notes += [f"MPS client settings {' '.join(mps)} (rows: NVIDIA's defaults)"] * bool(mps)
    if shape.overlap is not None:
        o, what = OVERLAP_COVERED[shape.overlap], f"overlapped with {shape.overlap}"  # its regime's rows
        notes += _beyond(shape.params_b, o["params_b"], f"{what}, parameters", "B")
        notes += _beyond(shape.completions, o["completions"], f"{what}, completions per rank")
        notes += _beyond(shape.gpus, o["gpus"], f"{what}, GPUs")
    return notes


@dataclass(frozen=True)
class Forecast:
    """A forecast (`phases` set) or the reason there is none (`reason`)."""

    phases: dict[str, float] = field(default_factory=dict)  # phase → s/step
    max_steps: int = 0
    gpu: str = ""  # how the GPUs were taken ("H200", "140 GiB GPUs taken as H200s")
    beyond: tuple[str, ...] = ()  # what the rows do not span
    evaluation: bool = False  # the recipe evaluates: not in the forecast
    reason: str | None = None
    overlap: str | None = None  # overlapped: its regime (the errors are then OVERLAP_LEAVE_ONE_OUT's)

    @property
    def errors(self) -> dict[str, tuple[float, float, int]]:
        """The leave-one-out errors of the rows this forecast's model was fitted to."""
        return LEAVE_ONE_OUT if self.overlap is None else OVERLAP_LEAVE_ONE_OUT

    @property
    def s_per_step(self) -> float:
        return sum(self.phases.values())

    @property
    def total_s(self) -> float:
        return self.max_steps * self.s_per_step + STARTUP_S[0]


def forecast(resolved: Resolved) -> Forecast:
    """The step-time forecast of `resolved`, or a Forecast whose `reason` says why there is none."""
    why = refusal(resolved)
    if why is None:
        try:
            shape = shape_of(resolved)
        except UserError as e:
            why = e.lines[0]
    if why is not None:
        return Forecast(reason=why)
    return Forecast(
        phases=phase_seconds(shape),
        max_steps=resolved.recipe.trainer.max_steps,
        gpu=_gpu_problem(resolved.host)[1],
        beyond=tuple(beyond_rows(resolved, shape)),
        evaluation=resolved.recipe.eval.every_steps is not None,
        overlap=shape.overlap,
    )


def duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def forecast_lines(f: Forecast) -> list[str]:
    """What validate, train --dry-run and mem-probe --estimate print: a few lines, or one saying why none."""
    if f.reason is not None:
        return [f"forecast: none — {f.reason}"]
    parts = " + ".join(f"{p} {s:.2f}" for p, s in f.phases.items())
    steps = f.max_steps * f.s_per_step
    start, low, high = STARTUP_S
    lines = [
        f"forecast ({f.gpu}): {f.s_per_step:.2f} s/step = {parts}; {f.max_steps} steps {duration(steps)} + start-up "
        f"{duration(start)} = {duration(f.total_s)}" + (" (held-out evaluation not included)" if f.evaluation else ""),
    ]
    median, largest, rows = f.errors["s/step"]
    which = f"overlapped rows ({f.overlap})" if f.overlap else "measured rows"
    lines.append(
        f"forecast error on its {rows} {which}, each left out of the fit in turn: s/step median {median:.1f} %, "
        f"largest {largest:.0f} %; start-up {low:.0f}–{high:.0f} s ({DOC})"
    )
    if f.beyond:
        lines.append("forecast beyond the rows: " + "; ".join(f.beyond))
    return lines


def forecast_json(f: Forecast) -> str:
    """The run directory's forecast.json (`colocate_rl.rundir.FORECAST`): what `report` sets against the run."""
    if f.reason is not None:
        return json.dumps({"available": False, "reason": f.reason}, indent=2, ensure_ascii=False) + "\n"
    record = {
        "available": True,
        "gpu": f.gpu,
        "s_per_step": round(f.s_per_step, 4),
        "phases": {p: {"s": round(s, 4), "metrics": list(PHASE_METRICS[p])} for p, s in f.phases.items()},
        "rest": "the step's time (time/step_s) less the other phases' metrics",
        "max_steps": f.max_steps,
        "startup_s": STARTUP_S[0],
        "total_s": round(f.total_s, 1),
        "evaluation_included": False,
        "beyond_rows": list(f.beyond),
        "overlap": f.overlap,
        "leave_one_out_pct": {k: {"median": m, "largest": x, "rows": n} for k, (m, x, n) in f.errors.items()},
        "model": "colocate_rl.memory.forecast, fitted by benchmarks/fit_forecast.py to docs/benchmarks/results",
    }
    return json.dumps(record, indent=2, ensure_ascii=False) + "\n"
