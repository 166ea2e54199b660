"""The change search, JSON output and lines of `colocate-rl mem-probe --estimate`: when a recipe does not fit, the
cheapest of CHANGES that makes it fit by the estimate (`colocate_rl.memory.estimate`), and a vLLM share to set.
Pure: every variant is resolved by the caller's `resolve_with` (one pre-flight for all of them)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from colocate_rl.errors import UserError
from colocate_rl.memory.autolayout import host_fits
from colocate_rl.memory.estimate import MEMORY_PHASES, SHARE_MARGIN, VLLM_ALLOWANCE_GIB, Estimate, estimate
from colocate_rl.plan.deepspeed import ZeroLayout
from colocate_rl.plan.overlap import engine_copies
from colocate_rl.recipe.load import format_sets

if TYPE_CHECKING:
    from colocate_rl.plan.resolved import Resolved

CHANGES = (
    "sleep on",
    "gradient checkpointing",
    "ZeRO-3",
    "optimizer offload",
    "param offload",
    "TP",
    "shorter completions",
)  # tried in this order (cheapest first) when a recipe does not fit


def summary(e: Estimate, util: float | None = None) -> dict[str, Any]:
    """One estimate at a vLLM share (default the recipe's) as plain data, GiB rounded to 3 decimals."""
    util = e.util if util is None else util
    peak_phase, peak = e.peak(util)
    return {
        "vllm_gpu_memory_utilization": util,
        "phases": {p: round(e.total(p, util), 3) for p in MEMORY_PHASES},
        "peak": {"phase": peak_phase, "gib": round(peak, 3)},
        "fits": e.fits,
        "window": {
            "lower": round(e.lower, 4),
            "upper": round(e.upper, 4),
            "upper_phase": e.upper_phase,
            "chosen": e.chosen,
            "margin": SHARE_MARGIN,
        },
        "kv": {**e.kv, "gib": round(e.kv["gib"], 3), "max_sequences": e.max_seqs(util)},
        "host_gib_per_node": round(e.host_gib, 3),
        "host_terms": {k: round(v, 3) for k, v in e.host.items()},
    }


def _alternatives(name: str, e: Estimate) -> list[dict[str, Any]]:
    """Overrides that make change `name` to e's recipe, mildest first ([] when it does not apply)."""
    g, t = e.resolved.recipe.generation, e.resolved.recipe.trainer
    z = ZeroLayout.of(e.resolved.deepspeed)
    stage, off_opt, off_par = z.stage, z.offload_optimizer, z.offload_params
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


def _search_changes(
    base: Estimate, attempt: Callable[[dict[str, Any]], Estimate | None]
) -> tuple[list[tuple[str, dict[str, Any]]], Estimate | None]:
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
    resolve_with: Callable[[dict[str, Any]], Resolved], gpu_gib: float, prompt_tokens: int | None = None
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
    for key, field_name, label in (
        ("distributed.offload_params", "offload_params", "param offload"),
        ("distributed.offload_optimizer", "offload_optimizer", "optimizer offload"),
    ):
        # Offload the recipe asks for is kept (ZeRO-3 estimates run low, see docs/benchmarks/README.md); only say
        # when it looks unnecessary, so the user can confirm by measuring.
        if final is not None and getattr(ZeroLayout.of(final.resolved.deepspeed), field_name):
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


def to_json(rec: Recommendation) -> dict[str, Any]:
    """The whole result for `--json`: terms (at the recipe's share), phases, window, recommendation, and what each
    `auto` of the recipe chose and why."""
    b, f = rec.base, rec.final
    r = b.resolved
    return {
        "model": {"name": r.recipe.model.name, "params": b.layout.params, "layout": asdict(b.layout)},
        "gpu_memory_gib": b.gpu_gib,
        "world_size": r.world_size,
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
        **{
            f"{name}_choice": choice.to_json() if choice is not None else None
            for name, choice in (
                ("share", r.share_choice),
                ("layout", r.layout_choice),
                ("sleep", r.sleep_choice),
                ("micro_batch", r.micro_batch_choice),
                ("overlap", r.overlap_choice),
                ("engine_processes", r.engine_processes_choice),
                ("mps", r.mps_choice),
            )
        },
    }


def host_line(e: Estimate, ram_gib: float | None) -> list[str]:
    """Host memory per node for offloaded state (none: no line); compared with this machine's RAM when known."""
    if not e.host:
        return []
    line = (
        f"host memory per node: {e.host_gib:.1f} GiB for "
        + ", ".join(f"{k} {v:.1f}" for k, v in e.host.items())
        + " (the processes' own memory comes on top)"
    )
    if not host_fits(e.host_gib, ram_gib):  # the host limit auto's choice uses
        line += f"; this machine has {ram_gib:.0f} GiB of RAM: not enough — use more GPUs or nodes, or less offload"
    return [line]


def recommendation_lines(rec: Recommendation, ram_gib: float | None = None) -> list[str]:
    """What `mem-probe --estimate` prints under its table: layout, batch, window, verdict, recommendation."""
    b, lay, kv, G = rec.base, rec.base.layout, rec.base.kv, rec.base.gpu_gib
    r, stage = b.resolved.recipe, ZeroLayout.of(b.resolved.deepspeed).stage
    experts = (
        f", {lay.active_params:,} active: {lay.active_experts} of {lay.experts} experts per token"
        if lay.experts
        else ""
    )
    n = engine_copies(r)
    allowance = f"{VLLM_ALLOWANCE_GIB:g} GiB allowance"
    split, need = (
        (f" (split among its {n} engine processes)", f"{n} × (vLLM weights + {allowance}) + KV")
        if n > 1
        else ("", f"vLLM weights + KV + {allowance}")
    )
    lines = [
        f"model {r.model.name}: {lay.params:,} params (hidden {lay.hidden}, {lay.layers} layers, {lay.heads} "
        f"heads / {lay.kv_heads} KV heads, vocab {lay.vocab:,}{experts}); {r.distributed.nnodes} node(s) × "
        f"{b.resolved.nproc_per_node} GPU(s) of {G:.1f} GiB; {'DDP' if stage is None else f'ZeRO-{stage}'}; "
        f"vLLM TP {r.generation.tensor_parallel_size}",
        f"generation batch: {kv['sequences']} sequences per vLLM engine{split} × {kv['tokens']} tokens (prompt ≤ "
        f"{kv['prompt_tokens']} + completion {kv['completion_tokens']}), KV {kv['bytes_per_token']:,} B/token → "
        f"{kv['gib']:.2f} GiB; the recipe's share ({b.util}) holds {b.max_seqs(b.util):,} such sequences",
        *([f"prompt length: {lp.line(r.data.source)}"] if (lp := b.resolved.preflight.longest_prompt) else []),
        f"window for generation.vllm_gpu_memory_utilization: {b.lower:.3f} ({need} = {b.need_gib:.2f} GiB) to "
        f"{b.upper:.3f} (what the trainer's "
        f"{b.fixed[b.upper_phase]:.2f} GiB leave during {b.upper_phase})",
    ]
    where = "below the window" if b.util < b.lower else "above the window" if b.util > b.upper else "in the window"
    phase, peak = b.peak()
    lines.append(f"recipe as written (share {b.util}, {where}): peak {peak:.2f} GiB of {G:.1f} in {phase}")
    if not b.asleep_fits:
        p = max((p for p in MEMORY_PHASES if p not in b.awake), key=b.fixed.__getitem__)
        lines.append(
            f"does not fit: {p} needs {b.fixed[p]:.2f} GiB while vLLM sleeps; {G * (1 - SHARE_MARGIN):.1f} GiB "
            f"usable ({SHARE_MARGIN:.0%} kept free)"
        )
    elif not b.fits:
        lines.append(
            f"does not fit: vLLM needs a share of {b.lower:.3f} + {SHARE_MARGIN:.0%}, the trainer leaves "
            f"{b.upper:.3f} − {SHARE_MARGIN:.0%}"
        )
    f = rec.final
    if f is None:
        return lines + [f"no change tried makes it fit ({', '.join(CHANGES)}); use more GPUs or a smaller model"]
    if rec.applied:
        sets = " ".join(f"--set {item}" for item in format_sets(rec.changes))
        lines.append(f"{'change' if b.fits else 'cheapest change that fits'}: {' + '.join(rec.applied)} ({sets})")
    final_zero = ZeroLayout.of(f.resolved.deepspeed)
    off_opt, off_par = final_zero.offload_optimizer, final_zero.offload_params
    phase, peak = f.peak(f.chosen)
    lines.append(
        f"recommended: generation.vllm_gpu_memory_utilization {f.chosen:.2f} (lower bound + {SHARE_MARGIN:.0%} "
        f"of the GPU); sleep level {f.resolved.recipe.generation.sleep_level}; optimizer "
        f"offload {'on' if off_opt else 'off'}; param offload {'on' if off_par else 'off'} → peak "
        f"{peak:.2f} GiB of {G:.1f} in {phase}; KV room for {f.max_seqs(f.chosen):,} sequences (a batch is "
        f"{f.kv['sequences']})"
    )
    return lines + host_line(f, ram_gib) + [f"note: {n}" for n in b.notes + rec.notes]
