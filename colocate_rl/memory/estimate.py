"""`colocate-rl mem-probe --estimate`: GPU memory per rank and phase of a colocated run, by arithmetic on the model
layout (built-in, a local config.json or HUB_LAYOUTS) and the resolved recipe; no torch, transformers or vLLM.
A phase's total is what one GPU holds: the trainer's resident state, what the phase adds (activations, step
buffers) and vLLM: its whole share (vllm_gpu_memory_utilization × GPU) while awake, the sleep residue while asleep.
Estimates: compare them with real runs (docs/gpu-runs.md, `colocate-rl report`)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from colocate_rl.errors import UserError
from colocate_rl.plan.deepspeed import zero_settings

GIB = 2**30
# Memory a rank holds besides tensors, measured on H200s (docs/benchmarks.md, mem-probe accuracy, session 5):
CUDA_CONTEXT_GIB = 1.25  # CUDA context, library workspaces, allocator slack of one process: 1.53 GiB besides tensors in
#                          the 0.5B weight sync on one GPU (9.81 measured, 8.28 of tensors), less vLLM's asleep 0.28
SLEEP_RESIDUE_GIB = 0.28  # what vLLM 0.26 keeps asleep (level 2), by the engine's own count on one rank (0.277 GiB)
NCCL_GIB = 2.7  # more than one rank: NCCL communicators of vLLM (its asleep count is 1.97-2.20 GiB on 2 ranks, +1.8)
#                 and of the trainer (2.0-2.3 GiB besides tensors and vLLM on 2 ranks, +0.9); 2 GPUs only, not more
#                 ranks or nodes
VLLM_ALLOWANCE_GIB = 2.0  # in vLLM's share besides weights and KV: CUDA graphs, the profile run's activation peak,
#                           sampler, NCCL/cuBLAS workspaces. An allowance, not calibrated on a measurement.
MARGIN = 0.05  # of the GPU, kept free on each side of the chosen vLLM share (estimate error, allocator slack)
ASSUMED_PROMPT_TOKENS = 512  # prompt length when generation.max_model_length does not bound it (--prompt-tokens)
KV_BLOCK = 16  # vLLM's KV block size in tokens: a sequence takes whole blocks
PHASES = ("generation", "weight sync", "training", "optimizer step")
SHARE_TERMS = (
    "vLLM weights",
    "vLLM KV cache (1 generation batch)",
    "vLLM graphs + workspace",
    "vLLM rest of its share",
)  # vLLM's share while it is awake


@dataclass(frozen=True)
class Layout:
    """A dense decoder (Qwen2 / Llama shapes)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tie: bool
    max_positions: int = 32768
    qkv_bias: bool = True  # Qwen2 has q/k/v biases, Llama none
    head_dim: int | None = None

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def params(self) -> int:
        """Exact: embeddings (+ lm_head unless tied); per layer q/k/v/o (+ biases), SwiGLU MLP, 2 norms; final norm."""
        q, kv, h = self.heads * self.hd, self.kv_heads * self.hd, self.hidden
        attn = 2 * h * q + 2 * h * kv + ((q + 2 * kv) if self.qkv_bias else 0)
        return self.vocab * h * (1 if self.tie else 2) + self.layers * (attn + 3 * h * self.intermediate + 2 * h) + h


def _hub_table() -> dict[str, Layout]:
    """Published config.json values (keys lower case); every Qwen2.5 -Instruct lists 32768 positions."""
    qwen = {  # hidden, layers, heads, kv heads, intermediate, vocab, tied, max positions of the base model
        "0.5b": (896, 24, 14, 2, 4864, 151936, True, 32768),
        "1.5b": (1536, 28, 12, 2, 8960, 151936, True, 131072),
        "3b": (2048, 36, 16, 2, 11008, 151936, True, 32768),
        "7b": (3584, 28, 28, 4, 18944, 152064, False, 131072),
        "14b": (5120, 48, 40, 8, 13824, 152064, False, 131072),
        "32b": (5120, 64, 40, 8, 27648, 152064, False, 131072),
        "72b": (8192, 80, 64, 8, 29568, 152064, False, 131072),
    }
    table = {}
    for size, (*shape, positions) in qwen.items():
        table[f"qwen/qwen2.5-{size}"] = Layout(*shape, max_positions=positions)
        table[f"qwen/qwen2.5-{size}-instruct"] = Layout(*shape, max_positions=32768)
    for size, shape in {"8b": (4096, 32, 32, 8, 14336), "70b": (8192, 80, 64, 8, 28672)}.items():
        for suffix in ("", "-instruct"):
            table[f"meta-llama/meta-llama-3-{size}{suffix}"] = Layout(*shape, 128256, False, 8192, qkv_bias=False)
    return table


HUB_LAYOUTS = _hub_table()


def layout_from_config(cfg: dict[str, Any], source: str) -> Layout:
    """A Layout from a Hugging Face config.json mapping (its `text_config` when it has one)."""
    cfg = cfg.get("text_config") or cfg
    missing = [
        k
        for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
        if not isinstance(cfg.get(k), int)
    ]
    if missing or any(k in cfg for k in ("num_experts", "num_local_experts", "n_routed_experts")):
        raise UserError(
            f"model.name: {source} is not a dense decoder's config ("
            + (f"no {', '.join(missing)}" if missing else "mixture of experts")
            + "); mem-probe --estimate handles dense decoders only"
        )
    return Layout(
        cfg["hidden_size"],
        cfg["num_hidden_layers"],
        cfg["num_attention_heads"],
        cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
        cfg["intermediate_size"],
        cfg["vocab_size"],
        bool(cfg.get("tie_word_embeddings", False)),
        cfg.get("max_position_embeddings") or 32768,
        qkv_bias=cfg.get("model_type") == "qwen2" or bool(cfg.get("attention_bias", False)),
        head_dim=cfg.get("head_dim"),
    )


def layout_for(name: str) -> Layout:
    """`builtin:<layout>`, a local model directory (its config.json) or a hub id of HUB_LAYOUTS."""
    if name.startswith("builtin:"):
        from colocate_rl.builtin_model import LAYOUTS

        if name.removeprefix("builtin:") not in LAYOUTS:
            raise UserError(
                f"model.name: unknown built-in layout '{name}'; choose one of: "
                + ", ".join(f"builtin:{k}" for k in LAYOUTS)
            )
        return layout_from_config(dict(LAYOUTS[name.removeprefix("builtin:")], model_type="qwen2"), name)
    config = Path(name).expanduser() / "config.json"
    if config.is_file():
        try:
            return layout_from_config(json.loads(config.read_text()), str(config))
        except (OSError, ValueError) as e:
            raise UserError(f"model.name: cannot read {config} ({e}); fix it or pass another model directory")
    if name.lower() in HUB_LAYOUTS:
        return HUB_LAYOUTS[name.lower()]
    raise UserError(
        f"model.name: no layout known for '{name}'; pass a local model directory (with config.json), "
        "or add the layout to HUB_LAYOUTS in colocate_rl/estimate.py"
    )


@dataclass
class Estimate:
    """One configuration's memory per phase (GiB per GPU) and its window for the vLLM share."""

    resolved: Any  # colocate_rl.plan.resolve.Resolved
    layout: Layout
    gpu_gib: float
    terms: dict[str, dict[str, float]]  # term → phase → GiB, at the recipe's vLLM share
    fixed: dict[str, float]  # phase → GiB besides vLLM's share (awake phases) or all of it (vLLM asleep)
    awake: tuple[str, ...]  # phases in which vLLM holds its whole share
    need_gib: float  # vLLM weights + KV for one generation batch + allowance
    kv: dict[str, Any]
    notes: list[str]
    kv_budget_gib: float | None = None  # generation.kv_cache_memory: vLLM's KV pool is this, whatever the share
    host: dict[str, float] = field(default_factory=dict)  # term → GiB of host memory per node (offload, sleep 1)

    @property
    def host_gib(self) -> float:
        return sum(self.host.values())

    def __post_init__(self) -> None:
        G, fixed = self.gpu_gib, self.fixed
        self.util = self.resolved.recipe.generation.vllm_gpu_memory_utilization
        self.lower = self.need_gib / G  # vLLM's share must hold its weights, one batch's KV and the allowance
        self.upper_phase = max(self.awake, key=fixed.__getitem__)  # the awake phase that leaves vLLM the least
        self.upper = (G - fixed[self.upper_phase]) / G
        self.asleep_fits = all(fixed[p] <= G * (1 - MARGIN) for p in PHASES if p not in self.awake)
        if self.kv_budget_gib is None:
            self.chosen = math.ceil(round((self.lower + MARGIN) * 100, 6)) / 100  # lower + margin, to a hundredth
            self.fits = self.asleep_fits and self.chosen <= self.upper - MARGIN
        else:  # the share is fixed by the KV budget: it must hold one batch and leave the margin free
            self.chosen = self.util
            self.fits = (
                self.asleep_fits
                and self.kv_budget_gib >= self.kv["gib"]
                and self.share_gib() <= G * (self.upper - MARGIN)
            )

    def share_gib(self, util: float | None = None) -> float:
        """vLLM's memory while awake: util × GPU, or weights + the KV budget + allowance (generation.kv_cache_memory)."""
        if self.kv_budget_gib is not None:
            return self.need_gib - self.kv["gib"] + self.kv_budget_gib
        return (self.util if util is None else util) * self.gpu_gib

    def total(self, phase: str, util: float | None = None) -> float:
        return self.fixed[phase] + (self.share_gib(util) if phase in self.awake else 0)

    def peak(self, util: float | None = None) -> tuple[str, float]:
        return max(((p, self.total(p, util)) for p in PHASES), key=lambda x: x[1])

    def max_seqs(self, util: float) -> int:  # sequences of kv['tokens'] tokens the KV pool holds at this share
        room = self.share_gib(util) - self.terms["vLLM weights"]["generation"] - VLLM_ALLOWANCE_GIB
        return max(0, int(room * GIB // (self.kv["bytes_per_token"] * self.kv["tokens"])))


def zero_of(resolved) -> tuple[dict[str, Any], int | None, bool, bool]:
    """The ZeRO section, its stage (None without DeepSpeed), and whether optimizer states / params are on CPU."""
    return zero_settings(resolved.deepspeed)


def estimate(resolved, gpu_gib: float, prompt_tokens: int | None = None) -> Estimate:
    """Memory per GPU and phase for `resolved` (a GPU plan) on GPUs of `gpu_gib` GiB."""
    t, g = resolved.recipe.trainer, resolved.recipe.generation
    if g.backend == "transformers":
        raise UserError(
            "generation.backend: 'transformers'; mem-probe --estimate plans the colocated vLLM layout, "
            "set generation.backend: auto or vllm"
        )
    if resolved.device != "cuda":
        raise UserError("--gpus: mem-probe --estimate plans a GPU run; pass --gpus N with N ≥ 1")
    lay = layout_for(resolved.recipe.model.name)
    n, world, tp, h = lay.params, resolved.world_size, g.tensor_parallel_size, lay.hidden
    if lay.heads % tp:
        raise UserError(
            f"generation.tensor_parallel_size: {tp} does not divide the model's {lay.heads} attention "
            "heads (vLLM needs that); choose a divisor of the head count"
        )

    def blocks(tokens):
        return -(-tokens // KV_BLOCK) * KV_BLOCK

    # Sequences: generation.max_model_length bounds prompt + completion; without it the prompt length is assumed.
    comp, mml = t.max_completion_length, g.max_model_length
    prompt = prompt_tokens or (mml - comp if mml else ASSUMED_PROMPT_TOKENS)
    seq = min(prompt + comp, mml or prompt + comp)
    max_len = mml or lay.max_positions  # vLLM refuses to start without KV room for one sequence this long
    gbs, steps = t.extra_args.get("generation_batch_size"), t.extra_args.get("steps_per_generation")
    per_rank = (
        gbs // world
        if isinstance(gbs, int)
        else t.per_device_train_batch_size * (steps if isinstance(steps, int) else t.gradient_accumulation_steps)
    )
    seqs = per_rank * tp  # TRL gathers the prompts of a TP group: each engine generates for all of its ranks
    kv_token = 2 * lay.layers * -(-lay.kv_heads // tp) * lay.hd * 2  # K and V, bf16, this rank's KV heads
    kv_gib = max(seqs * blocks(seq), blocks(max_len)) * kv_token / GIB

    zero, stage, off_opt, off_par = zero_of(resolved)
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
        sub_group = zero.get("sub_group_size", 10**9)
        step = 0 if off_opt else 4 * (min(sub_group, n / world) if stage == 3 else n / (world if stage else 1))
    ref = 0 if t.beta == 0 or off_par else p * n / (world if stage == 3 else 1)  # reference model (beta > 0)
    # Activations of one micro-batch, per token and layer saved for backward (SDPA: no seq² scores): 2 RMSNorms ×
    # 3h (fp32 input + 16-bit output), attention h + 3q + 2kv (input, q, output, o_proj input; k, v), MLP h + 4·ff
    # (input, gate, up, silu, product). Gradient checkpointing keeps layer inputs and recomputes one layer at a time.
    a = 2 if resolved.precision in ("bf16", "fp16") else 4
    layer = a * (8 * h + 3 * lay.heads * lay.hd + 2 * lay.kv_heads * lay.hd + 4 * lay.intermediate)
    tokens = t.per_device_train_batch_size * seq
    act = tokens * (lay.layers * a * h + layer if resolved.gradient_checkpointing else lay.layers * layer)
    # TRL computes logits for the completion tokens only (logits_to_keep); 4 B each: the 16-bit logits plus the
    # temperature-scaled copy / their gradient in backward. With Qwen's 152k vocab this dominates.
    logits = t.per_device_train_batch_size * (comp + 1) * lay.vocab * 4
    # ZeRO-3 gathers 16-bit params for forward/backward (up to stage3_max_live_parameters) and, for the weight
    # push to vLLM, one parameter at a time with TRL's engine (the largest: the embedding), one bucket of
    # generation.weight_sync_bucket_mb at a time with colocate-rl's (at least the largest parameter)
    live = zero.get("stage3_max_live_parameters", 10**9)
    gather = 2 * min(live if isinstance(live, int) else 10**9, n) if stage == 3 else 0
    largest = 2 * lay.vocab * h
    sync_gather = (
        0 if stage != 3 else largest if g.engine == "trl" else max(largest, min(g.weight_sync_bucket_mb * 2**20, 2 * n))
    )
    # generation.offload_trainer_during_generation: DeepSpeed's optimizer states, fp32 master weights and
    # gradients are on CPU while vLLM generates (colocate-rl's engine, after the weight push)
    off_gen = g.offload_trainer_during_generation and stage is not None
    not_generating = [ph for ph in PHASES if ph != "generation"] if off_gen else PHASES
    vllm_w = 2 * n / tp / GIB

    terms: dict[str, dict[str, float]] = {}  # term → phase → GiB
    for name, value, phases in [
        ("CUDA context", CUDA_CONTEXT_GIB * GIB, PHASES),
        ("NCCL communicators (trainer and vLLM)", NCCL_GIB * GIB if world > 1 else 0, PHASES),
        ("trainer weights", weights, PHASES),
        ("trainer gradients", grads, not_generating),
        ("reference model", ref, PHASES),
        ("optimizer states" + (" (AdamW)" if stage is None else " (fp32 master + Adam)"), opt, not_generating),
        ("optimizer step buffers", step, ["optimizer step"]),
        ("activations" + (" (checkpointed)" if resolved.gradient_checkpointing else ""), act, ["training"]),
        ("logits", logits, ["training"]),
        ("ZeRO-3 gathered params", gather, ["training"]),
        ("ZeRO-3 gathered params", sync_gather, ["weight sync"]),
    ]:
        if value:
            terms.setdefault(name, {}).update({ph: value / GIB for ph in phases})
    # torch's allocator keeps backward's blocks reserved through the optimizer step (nothing empties the cache in
    # between): the driver sees the training peak there too (H200, 1.5B ZeRO-3: 28.86 GiB in both phases)
    trainer = {ph: sum(v.get(ph, 0.0) for v in terms.values()) for ph in PHASES}
    if trainer["training"] > trainer["optimizer step"]:
        terms["allocator cache kept from backward"] = {
            "optimizer step": trainer["training"] - trainer["optimizer step"]
        }
    # sleep level 1 copies vLLM's weights to CPU memory and level 2 drops them: on the GPU both leave the residue
    awake = PHASES if not g.sleep_level else ("generation",)
    fixed = {ph: sum(v.get(ph, 0.0) for v in terms.values()) for ph in PHASES}
    need = vllm_w + kv_gib + VLLM_ALLOWANCE_GIB
    kv_budget = None
    if g.kv_cache_memory is not None:  # an absolute KV pool instead of util × GPU
        from colocate_rl.recipe.schema import parse_size

        kv_budget = parse_size(g.kv_cache_memory) / GIB
    vllm_share = g.vllm_gpu_memory_utilization * gpu_gib if kv_budget is None else need - kv_gib + kv_budget
    share = (vllm_w, kv_gib, VLLM_ALLOWANCE_GIB, vllm_share - need)
    for ph in PHASES:  # asleep: the residue, plus the weights TRL wakes to push the trainer's before the KV cache
        asleep = {"vLLM sleep residue": SLEEP_RESIDUE_GIB, **({"vLLM weights": vllm_w} if ph == "weight sync" else {})}
        for name, value in zip(SHARE_TERMS, share) if ph in awake else asleep.items():
            terms.setdefault(name, {})[ph] = value
        fixed[ph] += 0 if ph in awake else sum(asleep.values())
    kv = dict(
        sequences=seqs,
        tokens=blocks(seq),
        prompt_tokens=seq - comp,
        completion_tokens=comp,
        bytes_per_token=kv_token,
        gib=kv_gib,
        max_model_len=max_len,
    )
    notes = (
        []
        if mml or prompt_tokens
        else [
            f"prompt length assumed to be {ASSUMED_PROMPT_TOKENS} tokens (no "
            "generation.max_model_length); --prompt-tokens sets it"
        ]
    )
    if kv_budget is not None:
        notes.append(
            f"generation.kv_cache_memory sets vLLM's KV pool to {kv_budget:.2f} GiB (a generation batch "
            f"needs {kv_gib:.2f}): its share is weights + KV + allowance = {vllm_share:.2f} GiB, whatever "
            "vllm_gpu_memory_utilization says"
        )
    if off_gen:
        notes.append(
            "generation.offload_trainer_during_generation: optimizer states and gradients are on CPU "
            "while vLLM generates (not counted in generation)"
        )
    # Host memory per node for what lives on the CPU (ranks on a node × each rank's part). H200, 7B on one GPU with
    # optimizer offload: 113.5 GiB estimated, 152 GiB in use on the host (processes, libraries and buffers on top).
    ranks = resolved.nproc_per_node
    host = {
        "offloaded optimizer (fp32 master + Adam + fp32 gradients)": ((12 if p == 2 else 8) + 4) * n / world * ranks
        if stage is not None and off_opt
        else 0,
        "offloaded parameters": p * n / world * ranks if stage == 3 and off_par else 0,
        "trainer states during generation (offload_trainer_during_generation)": (opt + grads) * ranks if off_gen else 0,
        "vLLM weights while asleep (sleep level 1)": vllm_w * GIB * ranks if g.sleep_level == 1 else 0,
    }
    host = {k: v / GIB for k, v in host.items() if v}
    return Estimate(resolved, lay, gpu_gib, terms, fixed, awake, need, kv, notes, kv_budget, host)


CHANGES = (
    "sleep on",
    "gradient checkpointing",
    "ZeRO-3",
    "optimizer offload",
    "param offload",
    "TP",
    "shorter completions",
)  # tried in this order (cheapest first) when a recipe does not fit


def _alternatives(name: str, e: Estimate) -> list[dict[str, Any]]:
    """Overrides that make change `name` to e's recipe, mildest first ([] when it does not apply)."""
    g, t = e.resolved.recipe.generation, e.resolved.recipe.trainer
    _, stage, off_opt, off_par = zero_of(e.resolved)
    to_ds = {"distributed.deepspeed": "zero3"} if stage is None else {}
    if name == "sleep on":
        return [] if g.sleep_level else [{"generation.sleep_level": 2}]
    if name == "gradient checkpointing":
        return [] if e.resolved.gradient_checkpointing else [{"trainer.gradient_checkpointing": True}]
    if name == "ZeRO-3":
        return [] if stage == 3 else [to_ds or {"distributed.zero_stage": 3}]
    if name == "optimizer offload":
        return [] if off_opt else [{**to_ds, "distributed.offload_optimizer": True}]
    if name == "param offload":
        to_3 = to_ds or ({} if stage == 3 else {"distributed.zero_stage": 3})
        return [] if off_par else [{**to_3, "distributed.offload_params": True}]
    if name == "TP":
        return [
            {"generation.tensor_parallel_size": s}
            for s in (2, 4, 8, 16)
            if s > g.tensor_parallel_size and e.resolved.nproc_per_node % s == 0 and e.layout.heads % s == 0
        ]
    c0, mml = t.max_completion_length, g.max_model_length  # shorter completions: max_model_length shrinks with
    return [
        {
            "trainer.max_completion_length": c,  # them, so the prompt keeps its room
            **({"generation.max_model_length": mml - c0 + c} if mml else {}),
        }
        for c in (c0 >> k for k in range(1, 12))
        if c >= 32
    ]


@dataclass
class Recommendation:
    base: Estimate  # the recipe as given
    final: Estimate | None  # with `changes` applied; None when nothing tried fits
    changes: dict[str, Any]  # dotted key → value, the vLLM share included
    applied: list[str]  # names of the changes, cheapest first
    notes: list[str]


def _merged(groups: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """The overrides of several named changes as one mapping."""
    return {key: value for _, overrides in groups for key, value in overrides.items()}


def _search_changes(base: Estimate, attempt: Callable[[dict[str, Any]], Estimate | None]):
    """For a recipe that does not fit: the first of CHANGES that fits alone (cheapest first); else CHANGES
    applied together until one fits, then without those that turn out not to be needed. Returns the named
    changes and the estimate after them (None when nothing fits)."""
    for name in CHANGES:
        for alt in _alternatives(name, base):
            e = attempt(alt)
            if e is not None and e.fits:
                return [(name, alt)], e
    groups: list[tuple[str, dict[str, Any]]] = []
    current, final = base, None
    for name in CHANGES:
        tried = []
        for alt in _alternatives(name, current):
            e = attempt({**_merged(groups), **alt})
            if e is not None:
                tried.append((alt, e))
        if not tried:
            continue
        alt, current = next((x for x in tried if x[1].fits), tried[-1])  # the mildest that fits, else strongest
        groups.append((name, alt))
        if current.fits:
            final = current
            break
    if final is None:
        return groups, None
    for group in reversed(groups[:-1]):
        rest = [x for x in groups if x is not group]
        e = attempt(_merged(rest))
        if e is not None and e.fits:
            groups, final = rest, e
    return groups, final


def recommend(
    resolve_with: Callable[[dict[str, Any]], Any], gpu_gib: float, prompt_tokens: int | None = None
) -> Recommendation:
    """Estimate the recipe (`resolve_with(overrides)` resolves it with dotted-key overrides, or raises UserError)
    and recommend a vLLM share. Offload the recipe asks for is kept (a note says when it looks unneeded); when
    the recipe does not fit, the first of CHANGES that fits alone, else CHANGES together minus those not needed."""

    def attempt(changes: dict[str, Any]) -> Estimate | None:
        try:
            return estimate(resolve_with(changes), gpu_gib, prompt_tokens)
        except UserError:
            return None

    base = estimate(resolve_with({}), gpu_gib, prompt_tokens)
    groups: list[tuple[str, dict[str, Any]]] = []
    final = base if base.fits else None
    if final is None:
        groups, final = _search_changes(base, attempt)
    notes = []
    if final is not None and final.resolved.recipe.generation.sleep_level:
        e = attempt({**_merged(groups), "generation.sleep_level": 0})
        if e is not None and e.fits:
            notes.append(
                f"sleep mode off would also fit (vLLM share {e.chosen:.2f}); it saves the wake, sleep and "
                "weight push of every step"
            )
    for key, i, label in (
        ("distributed.offload_params", 3, "param offload"),
        ("distributed.offload_optimizer", 2, "optimizer offload"),
    ):
        # Offload the recipe asks for is kept (ZeRO-3 estimates run low, see README); only say when it looks
        # unnecessary, so the user can confirm by measuring.
        if final is not None and zero_of(final.resolved)[i]:
            e = attempt({**_merged(groups), key: False})
            if e is not None and e.fits:
                notes.append(
                    f"{label} off would also fit by this estimate (vLLM share {e.chosen:.2f}, peak "
                    f"{e.peak(e.chosen)[1]:.1f} GiB); "
                    "ZeRO-3 estimates run low, so confirm on the GPU before dropping it"
                )
    changes = _merged(groups)
    if final is not None and final.kv_budget_gib is None:  # with kv_cache_memory the share is not a setting
        changes["generation.vllm_gpu_memory_utilization"] = final.chosen
    return Recommendation(base, final, changes, [name for name, _ in groups], notes)


def summary(e: Estimate, util: float | None = None) -> dict[str, Any]:
    """One estimate at a vLLM share (default the recipe's) as plain data, GiB rounded to 3 decimals."""
    util = e.util if util is None else util
    peak_phase, peak = e.peak(util)
    return {
        "vllm_gpu_memory_utilization": util,
        "phases": {p: round(e.total(p, util), 3) for p in PHASES},
        "peak": {"phase": peak_phase, "gib": round(peak, 3)},
        "fits": e.fits,
        "window": {
            "lower": round(e.lower, 4),
            "upper": round(e.upper, 4),
            "upper_phase": e.upper_phase,
            "chosen": e.chosen,
            "margin": MARGIN,
        },
        "kv": {**e.kv, "gib": round(e.kv["gib"], 3), "max_sequences": e.max_seqs(util)},
        "host_gib_per_node": round(e.host_gib, 3),
        "host_terms": {k: round(v, 3) for k, v in e.host.items()},
    }


def to_json(rec: Recommendation) -> dict[str, Any]:
    """The whole result for `--json`: terms (at the recipe's share), phases, window, recommendation."""
    b, f = rec.base, rec.final
    return {
        "model": {"name": b.resolved.recipe.model.name, "params": b.layout.params, "layout": asdict(b.layout)},
        "gpu_memory_gib": b.gpu_gib,
        "world_size": b.resolved.world_size,
        **summary(b),
        "terms": {k: {p: round(v, 3) for p, v in row.items()} for k, row in b.terms.items()},
        "notes": b.notes,
        "recommendation": {
            "fits": f is not None,
            "changes": rec.changes,
            "applied": rec.applied,
            "notes": rec.notes,
            **({"estimate": summary(f, f.chosen)} if f else {}),
        },
    }
