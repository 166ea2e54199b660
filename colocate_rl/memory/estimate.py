"""`colocate-rl mem-probe --estimate`: GPU memory per rank and phase of a colocated run, by arithmetic on the model
layout (`colocate_rl.memory.shapes`) and the resolved recipe; no torch, transformers or vLLM.
A phase's total is what one GPU holds: the trainer's resident state, what the phase adds (activations, step
buffers) and vLLM: its whole share (vllm_gpu_memory_utilization × GPU) while awake, the sleep residue while asleep.
Compare them with real runs (docs/benchmarks/gpu-runs.md, `colocate-rl report`); changes tried when a recipe does
not fit, and the JSON output: `colocate_rl.memory.recommend`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from colocate_rl.errors import UserError
from colocate_rl.memory.allowance import training_allowance
from colocate_rl.memory.reward_models import reward_model_bytes, reward_model_notes
from colocate_rl.memory.shapes import Layout, layout_for, lora_params, lora_saved_per_token_layer
from colocate_rl.plan.deepspeed import ZeroLayout
from colocate_rl.plan.overlap import engine_copies, engine_in_process
from colocate_rl.recipe.values import parse_size

if TYPE_CHECKING:
    from colocate_rl.plan.resolved import Resolved
    from colocate_rl.recipe.generation import GenerationSection

GIB = 2**30
# Memory a rank holds besides tensors; how each was measured: docs/benchmarks/README.md, "mem-probe accuracy".
CUDA_CONTEXT_GIB = 1.25  # CUDA context, library workspaces and allocator slack of one process
SLEEP_RESIDUE_GIB = 0.28  # what vLLM keeps on the GPU asleep (level 2), per rank
NCCL_GIB = 2.7  # more than one rank: the NCCL communicators of vLLM and of the trainer (measured on 2 GPUs)
VLLM_ALLOWANCE_GIB = 2.0  # in vLLM's share besides weights and KV: CUDA graphs, the profile run's activation peak,
#                           sampler, NCCL/cuBLAS workspaces. An allowance, not calibrated on a measurement.
SHARE_MARGIN = 0.05  # of the GPU, kept free on each side of the chosen vLLM share (estimate error, allocator slack)
ASSUMED_PROMPT_TOKENS = 512  # prompt length when generation.max_model_length does not bound it (--prompt-tokens)
KV_BLOCK = 16  # vLLM's KV block size in tokens: a sequence takes whole blocks
MEMORY_PHASES = ("generation", "weight sync", "training", "optimizer step")
# vLLM's share while it is awake
SHARE_TERMS = (
    "vLLM weights",
    "vLLM KV cache (1 generation batch)",
    "vLLM graphs + workspace",
    "vLLM rest of its share",
)

Terms = dict[str, dict[str, float]]  # term → phase → GiB


@dataclass
class Estimate:
    """One configuration's memory per phase (GiB per GPU) and its window for the vLLM share."""

    resolved: Resolved
    layout: Layout
    gpu_gib: float
    terms: Terms  # at the recipe's vLLM share
    fixed: dict[str, float]  # phase → GiB besides vLLM's share (awake phases) or all of it (vLLM asleep)
    awake: tuple[str, ...]  # phases in which vLLM holds its whole share
    need_gib: float  # vLLM weights + KV for one generation batch + allowance
    kv: dict[str, Any]
    notes: list[str]
    kv_budget_gib: float | None = None  # generation.kv_cache_memory: vLLM's KV pool is this, whatever the share
    host: dict[str, float] = field(default_factory=dict)  # term → GiB of host memory per node (offload, sleep 1)
    # derived in __post_init__:
    util: float = field(init=False)  # the recipe's vLLM share
    lower: float = field(init=False)  # the smallest share that holds vLLM's weights, one batch's KV and allowance
    upper: float = field(init=False)  # the largest share the trainer leaves in upper_phase
    upper_phase: str = field(init=False)  # the awake phase that leaves vLLM the least
    asleep_fits: bool = field(init=False)  # every phase with vLLM asleep leaves the margin free
    chosen: float = field(init=False)  # the recommended share: lower + margin (or util with a KV budget)
    fits: bool = field(init=False)

    @property
    def host_gib(self) -> float:
        return sum(self.host.values())

    def __post_init__(self) -> None:
        G, fixed = self.gpu_gib, self.fixed
        self.util = self.resolved.recipe.generation.vllm_gpu_memory_utilization
        self.lower = self.need_gib / G  # vLLM's share must hold its weights, one batch's KV and the allowance
        self.upper_phase = max(self.awake, key=fixed.__getitem__)  # the awake phase that leaves vLLM the least
        self.upper = (G - fixed[self.upper_phase]) / G
        self.asleep_fits = all(fixed[p] <= G * (1 - SHARE_MARGIN) for p in MEMORY_PHASES if p not in self.awake)
        if self.kv_budget_gib is None:
            self.chosen = math.ceil(round((self.lower + SHARE_MARGIN) * 100, 6)) / 100  # lower + margin, to 1/100
            self.fits = self.asleep_fits and self.chosen <= self.upper - SHARE_MARGIN
        else:  # the share is fixed by the KV budget: it must hold one batch and leave the margin free
            self.chosen = self.util
            self.fits = (
                self.asleep_fits
                and self.kv_budget_gib >= self.kv["gib"]
                and self.share_gib() <= G * (self.upper - SHARE_MARGIN)
            )

    def share_gib(self, util: float | None = None) -> float:
        """vLLM's memory while awake: util × GPU, or weights + the KV budget + allowance (generation.kv_cache_memory)."""
        if self.kv_budget_gib is not None:
            return self.need_gib - self.kv["gib"] + self.kv_budget_gib
        return (self.util if util is None else util) * self.gpu_gib

    def total(self, phase: str, util: float | None = None) -> float:
        return self.fixed[phase] + (self.share_gib(util) if phase in self.awake else 0)

    def peak(self, util: float | None = None) -> tuple[str, float]:
        return max(((p, self.total(p, util)) for p in MEMORY_PHASES), key=lambda x: x[1])

    def max_seqs(self, util: float) -> int:  # sequences of kv['tokens'] tokens the KV pool holds at this share
        room = self.share_gib(util) - sum(self.terms[t]["generation"] for t in (SHARE_TERMS[0], SHARE_TERMS[2]))
        return max(0, int(room * GIB // (self.kv["bytes_per_token"] * self.kv["tokens"])))


@dataclass(frozen=True)
class _TrainerState:
    """Bytes per rank the trainer holds, and `param`: bytes per parameter of its weights and gradients."""

    param: int
    weights: float
    grads: float
    opt: float
    step: float  # optimizer step buffers
    ref: float  # the reference model
    trained: int  # parameters the optimizer updates (all, or the LoRA adapters)


@dataclass(frozen=True)
class _VllmShare:
    """vLLM's part: its terms per phase, the phases in which it is awake, and what it holds asleep."""

    terms: Terms
    awake: tuple[str, ...]
    asleep: dict[str, float]  # phase → GiB vLLM holds while asleep (0 in awake phases)
    need: float  # GiB: weights + one generation batch's KV + allowance
    gib: float  # GiB while awake at the recipe's share
    kv_budget: float | None  # GiB: generation.kv_cache_memory


def _terms(*rows: tuple[str, float, tuple[str, ...] | list[str]]) -> Terms:
    """(term, bytes, phases) rows as term → phase → GiB; zero terms are left out, a repeated term's phases merged."""
    terms: Terms = {}
    for name, value, phases in rows:
        if value:
            terms.setdefault(name, {}).update({ph: value / GIB for ph in phases})
    return terms


def _blocks(tokens: int) -> int:
    return -(-tokens // KV_BLOCK) * KV_BLOCK


def _layout_of(resolved: Resolved) -> Layout:
    """The model's layout, after the checks that make an estimate possible (UserError otherwise)."""
    g = resolved.recipe.generation
    if g.backend == "transformers":
        raise UserError(
            "generation.backend: 'transformers'; mem-probe --estimate plans the colocated vLLM layout, "
            "set generation.backend: auto or vllm"
        )
    if resolved.device != "cuda":
        raise UserError("--gpus: mem-probe --estimate plans a GPU run; pass --gpus N with N ≥ 1")
    lay = layout_for(resolved.recipe.model.name, config=resolved.preflight.model_config)
    if lay.heads % g.tensor_parallel_size:
        raise UserError(
            f"generation.tensor_parallel_size: {g.tensor_parallel_size} does not divide the model's {lay.heads} "
            "attention heads (vLLM needs that); choose a divisor of the head count"
        )
    return lay


def _kv_cache(resolved: Resolved, lay: Layout, prompt_tokens: int | None) -> dict[str, Any]:
    """vLLM's KV cache for one generation batch of this rank's engine (Estimate.kv)."""
    t, g = resolved.recipe.trainer, resolved.recipe.generation
    tp = g.tensor_parallel_size
    # Prompt: measured (pre-flight), else max_model_length less the completion, else assumed; mml bounds the sum
    comp, mml, measured = t.max_completion_length, g.max_model_length, resolved.preflight.longest_prompt
    prompt = prompt_tokens or (measured and measured.tokens) or (mml - comp if mml else ASSUMED_PROMPT_TOKENS)
    seq = min(prompt + comp, mml or prompt + comp)
    max_len = mml or lay.max_positions  # vLLM refuses to start without KV room for one sequence this long
    gbs, steps = t.extra_args.get("generation_batch_size"), t.extra_args.get("steps_per_generation")
    per_rank = (
        gbs // resolved.world_size
        if isinstance(gbs, int)
        else t.per_device_train_batch_size * (steps if isinstance(steps, int) else t.gradient_accumulation_steps)
    )
    seqs = per_rank * tp  # TRL gathers the prompts of a TP group: each engine generates for all of its ranks
    kv_token = 2 * lay.layers * -(-lay.kv_heads // tp) * lay.hd * 2  # K and V, bf16, this rank's KV heads
    kv_gib = max(seqs * _blocks(seq), _blocks(max_len)) * kv_token / GIB
    return dict(
        sequences=seqs,
        tokens=_blocks(seq),
        prompt_tokens=seq - comp,
        completion_tokens=comp,
        bytes_per_token=kv_token,
        gib=kv_gib,
        max_model_len=max_len,
    )


def _process_overheads(world: int) -> Terms:
    """Memory besides tensors, in every phase: the CUDA context and, with more than one rank, NCCL."""
    return _terms(
        ("CUDA context", CUDA_CONTEXT_GIB * GIB, MEMORY_PHASES),
        ("NCCL communicators (trainer and vLLM)", NCCL_GIB * GIB if world > 1 else 0, MEMORY_PHASES),
    )


def _trainer_state(resolved: Resolved, lay: Layout, zero: ZeroLayout) -> _TrainerState:
    """The trainer's weights, gradients, optimizer states, step buffers and reference model, by layout (with LoRA
    only the adapters train)."""
    world, stage, off_opt, off_par = resolved.world_size, zero.stage, zero.offload_optimizer, zero.offload_params
    n, lora = lay.params, resolved.recipe.model.lora
    if stage is None:  # DDP (or one process): torch AdamW on the params in their dtype, m and v in that dtype
        p = 4 if resolved.model_dtype == "float32" else 2
        weights, grads, opt = p * n, p * n * (2 if world > 1 else 1), 2 * p * n  # DDP keeps a bucket copy of grads
        step = p * n  # foreach AdamW intermediates: about one state-sized temporary
    else:  # DeepSpeed: 16-bit params and grads, fp32 master + Adam m/v (12 B/param), sharded by ZeRO stage
        p = 2 if resolved.precision in ("bf16", "fp16") else 4
        weights = 0 if off_par else p * n / (world if stage == 3 else 1)
        grads = p * n / (world if stage >= 2 else 1)
        opt = 0 if off_opt else (12 if p == 2 else 8) * n / (world if stage >= 1 else 1)
        # the step builds fp32 gradients: of one sub-group under ZeRO-3, of the whole partition below
        sub_group = zero.section.get("sub_group_size", 10**9)
        step = 0 if off_opt else 4 * (min(sub_group, n / world) if stage == 3 else n / (world if stage else 1))
    beta = resolved.recipe.trainer.beta
    ref = 0 if beta == 0 or off_par else p * n / (world if stage == 3 else 1)  # reference model (beta > 0)
    if lora is not None:  # frozen base; fp32 adapters carry the gradients, optimizer states and step buffers
        adapters = lora_params(lay, lora.r, lora.target_modules)
        weights += 4 * adapters / (world if stage == 3 else 1)
        grads = 4 * adapters / (world if stage is not None and stage >= 2 else 1)
        opt = 0 if off_opt else (12 if stage is not None else 8) * adapters / (world if stage is not None else 1)
        step, ref = 4 * adapters, 0  # the reference is the base model with the adapters off
    return _TrainerState(p, weights, grads, opt, step, ref, adapters if lora is not None else n)


def _trainer_terms(s: _TrainerState, stage: int | None, off_gen: bool) -> Terms:
    """The trainer's state per phase; with off_gen its gradients and optimizer states are on CPU in generation."""
    not_generating = [ph for ph in MEMORY_PHASES if ph != "generation"] if off_gen else MEMORY_PHASES
    return _terms(
        ("trainer weights", s.weights, MEMORY_PHASES),
        ("trainer gradients", s.grads, not_generating),
        ("reference model", s.ref, MEMORY_PHASES),
        ("optimizer states" + (" (AdamW)" if stage is None else " (fp32 master + Adam)"), s.opt, not_generating),
        ("optimizer step buffers", s.step, ["optimizer step"]),
    )


def _activations(resolved: Resolved, lay: Layout, kv: dict[str, Any], grads: float) -> Terms:
    """Training's activations of one micro-batch and the allowance beside them (`grads`: the trainer gradients'
    bytes on this GPU)."""
    t, h, lora = resolved.recipe.trainer, lay.hidden, resolved.recipe.model.lora
    seq = kv["prompt_tokens"] + kv["completion_tokens"]
    # Activations of one micro-batch (`Layout.saved_per_token_layer`, + LoRA's). Gradient checkpointing keeps layer
    # inputs and recomputes one layer at a time.
    a = 2 if resolved.precision in ("bf16", "fp16") else 4
    layer = lay.saved_per_token_layer(a) + a / 2 * lora_saved_per_token_layer(lay, lora, not resolved.deepspeed)
    tokens = t.per_device_train_batch_size * seq
    act = tokens * (lay.layers * a * h + layer if resolved.gradient_checkpointing else lay.layers * layer)
    allowance = training_allowance(act, grads, lay.vocab, ZeroLayout.of(resolved.deepspeed).stage is not None)
    return _terms(
        ("activations" + (" (checkpointed)" if resolved.gradient_checkpointing else ""), act, ["training"]),
        ("training allowance", allowance, ["training"]),
    )


def _zero3_gathers(resolved: Resolved, lay: Layout, zero: ZeroLayout) -> Terms:
    """ZeRO-3 gathers 16-bit params for forward/backward (up to stage3_max_live_parameters) and, for the weight
    push to vLLM, one parameter at a time with TRL's engine (the largest: the embedding or a MoE layer's experts),
    one bucket of generation.weight_sync_bucket_mb at a time with colocate-rl's (at least the largest parameter)."""
    g, n, stage = resolved.recipe.generation, lay.params, zero.stage
    live = zero.section.get("stage3_max_live_parameters", 10**9)
    gather = 2 * min(live if isinstance(live, int) else 10**9, n) if stage == 3 else 0
    largest = 2 * lay.largest_param
    sync_gather = (
        0 if stage != 3 else largest if g.engine == "trl" else max(largest, min(g.weight_sync_bucket_mb * 2**20, 2 * n))
    )
    return _terms(
        ("ZeRO-3 gathered params", gather, ["training"]), ("ZeRO-3 gathered params", sync_gather, ["weight sync"])
    )


def _allocator_cache(terms: Terms) -> Terms:
    """torch's allocator keeps backward's blocks reserved through the optimizer step (nothing empties the cache in
    between): the driver sees the training peak there too (H200, 1.5B ZeRO-3: 28.86 GiB in both phases)."""
    trainer = {ph: sum(v.get(ph, 0.0) for v in terms.values()) for ph in MEMORY_PHASES}
    if trainer["training"] > trainer["optimizer step"]:
        return {
            "allocator cache kept from backward": {"optimizer step": trainer["training"] - trainer["optimizer step"]}
        }
    return {}


def _vllm_share(g: GenerationSection, gpu_gib: float, vllm_w: float, kv_gib: float, copies: int) -> _VllmShare:
    """vLLM's share awake (util × GPU, or weights + generation.kv_cache_memory + allowance, each of its `copies`
    with weights and allowance of its own) and asleep the residue (sleep level 1 moves weights to CPU, 2 drops them)."""
    awake = MEMORY_PHASES if not g.sleep_level else ("generation",)
    vllm_w, allowance = copies * vllm_w, copies * VLLM_ALLOWANCE_GIB
    need = vllm_w + kv_gib + allowance
    kv_budget = parse_size(g.kv_cache_memory) / GIB if g.kv_cache_memory is not None else None  # instead of util
    gib = g.vllm_gpu_memory_utilization * gpu_gib if kv_budget is None else need - kv_gib + kv_budget
    share = (vllm_w, kv_gib, allowance, gib - need)
    terms, held_asleep = {}, {}
    # asleep: the residue, plus the weights TRL wakes to push the trainer's before the KV cache
    for ph in MEMORY_PHASES:
        asleep = {"vLLM sleep residue": copies * SLEEP_RESIDUE_GIB}
        asleep.update({"vLLM weights": vllm_w} if ph == "weight sync" else {})
        for name, value in zip(SHARE_TERMS, share) if ph in awake else asleep.items():
            terms.setdefault(name, {})[ph] = value
        held_asleep[ph] = 0 if ph in awake else sum(asleep.values())
    return _VllmShare(terms, awake, held_asleep, need, gib, kv_budget)


def _host_offload(
    resolved: Resolved, n: int, s: _TrainerState, zero: ZeroLayout, off_gen: bool, vllm_w: float
) -> dict[str, float]:
    """Host memory per node, GiB by term, for what lives on the CPU: the ranks on a node × each rank's part (the
    processes' own memory comes on top)."""
    world, ranks, p, stage = resolved.world_size, resolved.nproc_per_node, s.param, zero.stage
    host: dict[str, float] = {}
    if stage is not None and zero.offload_optimizer:
        host["offloaded optimizer (fp32 master + Adam + fp32 gradients)"] = (
            ((12 if p == 2 else 8) + 4) * s.trained / world * ranks
        )
    if stage == 3 and zero.offload_params:
        host["offloaded parameters"] = p * n / world * ranks
    if off_gen:
        host["trainer states during generation (offload_trainer_during_generation)"] = (s.opt + s.grads) * ranks
    if resolved.recipe.generation.sleep_level == 1:
        host["vLLM weights while asleep (sleep level 1)"] = vllm_w * GIB * ranks
    return {k: v / GIB for k, v in host.items() if v}


def _notes(
    resolved: Resolved, kv: dict[str, Any], share: _VllmShare, off_gen: bool, prompt_tokens: int | None, trained: int
) -> list[str]:
    """What the estimate assumed or left out, one line each."""
    notes = (
        []
        if resolved.recipe.generation.max_model_length or prompt_tokens or resolved.preflight.longest_prompt
        else [
            f"prompt length assumed to be {ASSUMED_PROMPT_TOKENS} tokens (no "
            "generation.max_model_length); --prompt-tokens sets it"
        ]
    )
    if share.kv_budget is not None:
        notes.append(
            f"generation.kv_cache_memory sets vLLM's KV pool to {share.kv_budget:.2f} GiB (a generation batch "
            f"needs {kv['gib']:.2f}): its share is weights + KV + allowance = {share.gib:.2f} GiB, whatever "
            "vllm_gpu_memory_utilization says"
        )
    if off_gen:
        notes.append(
            "generation.offload_trainer_during_generation: optimizer states and gradients are on CPU "
            "while vLLM generates (not counted in generation)"
        )
    if (lora := resolved.recipe.model.lora) is not None:
        notes.append(
            f"LoRA {lora.summary()}: {trained:,} trainable parameters (fp32); the base weights stay frozen and "
            "vLLM gets them merged with the adapters"
        )
    return notes


def _engine_process(resolved: Resolved, weight_bytes: float) -> Terms:
    """`generation.engine_process`: a CUDA context per engine process (two with `vllm_multiprocessing`), the push's
    staging buffer (its largest bucket)."""
    if not engine_in_process(resolved.recipe):
        return {}
    g = resolved.recipe.generation
    contexts = engine_copies(resolved.recipe) * (2 if g.vllm_multiprocessing else 1) * CUDA_CONTEXT_GIB * GIB
    staging = min(g.weight_sync_bucket_mb * 2**20, weight_bytes)
    return _terms(("engine process (CUDA context, staging buffer)", contexts + staging, MEMORY_PHASES))


def estimate(resolved: Resolved, gpu_gib: float, prompt_tokens: int | None = None) -> Estimate:
    """Memory per GPU and phase for `resolved` (a GPU plan) on GPUs of `gpu_gib` GiB: the terms of the trainer
    (fixed per phase) and of vLLM (its share while awake, the residue while asleep)."""
    g = resolved.recipe.generation
    lay = _layout_of(resolved)
    n = lay.params
    kv = _kv_cache(resolved, lay, prompt_tokens)
    zero = ZeroLayout.of(resolved.deepspeed)
    state = _trainer_state(resolved, lay, zero)
    # generation.offload_trainer_during_generation: DeepSpeed's optimizer states, fp32 master weights and
    # gradients are on CPU while vLLM generates (colocate-rl's engine, after the weight push)
    off_gen = g.offload_trainer_during_generation and zero.stage is not None
    terms = {
        **_process_overheads(resolved.world_size),
        **_trainer_terms(state, zero.stage, off_gen),
        **_activations(resolved, lay, kv, state.grads),
        **_zero3_gathers(resolved, lay, zero),
        **_terms(("reward models", reward_model_bytes(resolved, state.param, zero), MEMORY_PHASES)),
        **_engine_process(resolved, 2 * n / g.tensor_parallel_size),
    }
    terms.update(_allocator_cache(terms))
    vllm_w = 2 * n / g.tensor_parallel_size / GIB  # bf16, this rank's tensor-parallel part
    copies = engine_copies(resolved.recipe)
    share = _vllm_share(g, gpu_gib, vllm_w, kv["gib"], copies)
    fixed = {ph: sum(v.get(ph, 0.0) for v in terms.values()) + share.asleep[ph] for ph in MEMORY_PHASES}
    terms.update(share.terms)
    notes = _notes(resolved, kv, share, off_gen, prompt_tokens, state.trained) + reward_model_notes(resolved)
    host = _host_offload(resolved, n, state, zero, off_gen, copies * vllm_w)
    return Estimate(resolved, lay, gpu_gib, terms, fixed, share.awake, share.need, kv, notes, share.kv_budget, host)
