"""`distributed.zero_stage: auto` and `trainer.gradient_checkpointing: auto`: the fastest trainer layout that fits;
`generation.sleep_level: auto`: sleep only when trainer and vLLM do not fit together; `generation.engine_processes:
auto` (`with_engine_processes`, by the model's size: `plan.overlap.choose_engine_processes`).

`choose_layout` is a pure function of a resolved recipe and the GPU memory. It lists the candidates fastest first
(order by measured speed, not by memory saved): ZeRO-2, ZeRO-3, ZeRO-3 + optimizer offload, ZeRO-3 + optimizer
and parameter offload; with `gradient_checkpointing: auto` each stage without checkpointing, then with it. Explicit
settings win: offload set in the recipe (or in the DeepSpeed JSON it names) applies to every candidate (invalid
ones and duplicates drop out), and an explicit `zero_stage` leaves only checkpointing to choose. Plain DDP and
ZeRO-1 are chosen only explicitly.

It takes the first candidate whose peak estimated by `colocate_rl.memory.estimate` (over all four memory phases,
at the recipe's vLLM share) is at most the GPU's memory less LAYOUT_HEADROOM and, when this machine's RAM is known,
whose offloaded state fits in the RAM less LAYOUT_HEADROOM. Without a GPU there is no limit: the first candidate.
On a GPU with no estimate possible (unknown layout, transformers backend): the first ZeRO-3 candidate (with
checkpointing when that is auto). When none fits: the last, most frugal, candidate; `mem-probe --estimate` says
what else to change, and the measured `mem-probe` checks the choice with `confirm_choice`.

`choose_sleep_level` runs after it, for the layout chosen (or given), which was estimated with vLLM asleep (sleep
level 2): it picks 0 (no wake, sleep or cache emptying each step) when the estimate at sleep 0 (vLLM keeps its whole
share through training) peaks within the same limit, else 2; 2 also when nothing can be compared (no vLLM on a GPU,
no estimate). Level 1 is never chosen.

Measurements behind the order and the headroom: docs/benchmarks/README.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from colocate_rl.errors import UserError
from colocate_rl.memory.shapes import layout_for
from colocate_rl.plan.choices import Candidate, LayoutChoice, ShareChoice, SleepChoice, Tried
from colocate_rl.plan.deepspeed import AUTO_BASE_CONFIG, ZeroLayout, build_deepspeed_config, load_base_config
from colocate_rl.plan.overlap import check_mps, choose_engine_processes, choose_mps, engine_copies
from colocate_rl.plan.resolved import rank_cores, with_values
from colocate_rl.recipe.generation import GenerationSection

if TYPE_CHECKING:
    from colocate_rl.plan.resolved import Resolved
    from colocate_rl.recipe.schema import Recipe

DEFAULT_SHARE = GenerationSection.model_fields["vllm_gpu_memory_utilization"].default
LAYOUT_HEADROOM = 0.10  # of the GPU's memory (and of host RAM), kept free above a candidate's estimated peak
# (stage, offload optimizer, offload params), fastest first: see the module docstring
STAGES = ((2, False, False), (3, False, False), (3, True, False), (3, True, True))


def host_fits(host_gib: float, ram_gib: float | None) -> bool:
    """Whether offloaded state of host_gib per node fits this machine's RAM less LAYOUT_HEADROOM (True when the
    RAM is unknown)."""
    return ram_gib is None or host_gib <= ram_gib * (1 - LAYOUT_HEADROOM)


def candidates(resolved: Resolved, valid: Callable[[dict[str, Any]], bool] | None = None) -> list[Candidate]:
    """The layouts auto may choose for `resolved` (a Resolved whose `deepspeed` is the recipe's explicit build),
    fastest first, each with its DeepSpeed JSON; explicit recipe settings applied, invalid ones (DeepSpeed's rules,
    and `valid(config)` false: e.g. the engine's trainer offload needs its optimizer states on the GPU) and
    duplicates dropped."""
    dist, gc = resolved.recipe.distributed, resolved.recipe.trainer.gradient_checkpointing
    gcs = (False, True) if gc == "auto" else (bool(gc),)
    configs: list[dict[str, Any] | None] = []
    if dist.zero_stage == "auto":
        spec = dist.deepspeed or AUTO_BASE_CONFIG
        base = ZeroLayout.of(load_base_config(spec))
        base_opt, base_par = base.offload_optimizer, base.offload_params
        forced_opt = dist.offload_optimizer if dist.offload_optimizer is not None else (True if base_opt else None)
        forced_par = dist.offload_params if dist.offload_params is not None else (True if base_par else None)
        for stage, opt, par in STAGES:
            try:
                configs.append(
                    build_deepspeed_config(
                        spec,
                        precision=resolved.precision,
                        zero_stage=stage,
                        offload_optimizer=opt if forced_opt is None else forced_opt,
                        offload_params=par if forced_par is None else forced_par,
                        overrides=dist.deepspeed_overrides,
                    )
                )
            except UserError:  # e.g. parameter offload forced on below ZeRO-3: not a candidate
                continue
            if valid is not None and not valid(configs[-1]):
                configs.pop()
    else:
        configs.append(resolved.deepspeed)
    out: list[Candidate] = []
    for config in configs:
        for g in gcs:
            c = Candidate.of(config, g)
            if c not in out:
                out.append(c)
    return out


def choose_layout(
    resolved: Resolved,
    gpu_gib: float | None,
    prompt_tokens: int | None = None,
    valid: Callable[[dict[str, Any]], bool] | None = None,
    ram_gib: float | None = None,
) -> LayoutChoice:
    """The first of `candidates(resolved)` whose estimated peak (over all phases, at the recipe's vLLM share) is at
    most `gpu_gib × (1 − LAYOUT_HEADROOM)` and, when `ram_gib` (this machine's memory) is known, whose offloaded state fits in
    `ram_gib × (1 − LAYOUT_HEADROOM)`. `gpu_gib` None (no GPU): the first candidate, nothing estimated."""
    from colocate_rl.memory.estimate import estimate

    dist, trainer = resolved.recipe.distributed, resolved.recipe.trainer
    auto_keys = tuple(
        k
        for k, v in (
            ("distributed.zero_stage", dist.zero_stage),
            ("trainer.gradient_checkpointing", trainer.gradient_checkpointing),
        )
        if v == "auto"
    )
    cands = candidates(resolved, valid)
    if not cands:  # every auto candidate was invalid with the explicit settings: keep the explicit build
        config = resolved.deepspeed
        cands = [Candidate.of(config, trainer.gradient_checkpointing is True)]

    def done(chosen, tried, reason):
        return LayoutChoice(
            chosen,
            tuple(tried),
            gpu_gib,
            LAYOUT_HEADROOM,
            reason,
            auto_keys,
        )

    if gpu_gib is None or resolved.device != "cuda":
        return done(
            cands[0],
            [Tried(c) for c in cands],
            "no GPU here, so no memory limit was assumed: the fastest candidate (--gpus N plans for GPUs)",
        )
    limit = gpu_gib * (1 - LAYOUT_HEADROOM)
    tried: list[Tried] = []
    for c in cands:
        view = dataclasses.replace(resolved, deepspeed=c.deepspeed, gradient_checkpointing=c.gradient_checkpointing)
        try:
            e = estimate(view, gpu_gib, prompt_tokens)
        except UserError as err:  # unknown layout, transformers backend: no estimate possible
            safe = [x for x in cands if x.stage == 3] or cands
            chosen = next((x for x in safe if x.gradient_checkpointing), safe[0])
            return done(
                chosen,
                [Tried(x) for x in cands],
                f"no estimate ({err.lines[0]}), so the safe choice; set distributed.zero_stage to override",
            )
        phase, peak = e.peak()
        fits_host = host_fits(e.host_gib, ram_gib)
        tried.append(Tried(c, peak, phase, peak <= limit and fits_host, e.host_gib, fits_host))
    first = next((t for t in tried if t.fits), None)
    if first is not None:
        return done(first.candidate, tried, f"the first that fits ({first.peak_gib:.2f} ≤ {limit:.1f} GiB)")
    host = (
        f" (and its offload in {ram_gib * (1 - LAYOUT_HEADROOM):.1f} GiB of host memory)"
        if any(not t.host_fits for t in tried)
        else ""
    )
    return done(
        cands[-1],
        tried,
        f"none fits in {limit:.1f} GiB{host}: the last candidate; see `colocate-rl "
        "mem-probe --estimate` for other changes",
    )


def confirm_choice(choice: LayoutChoice, measured_peak_gib: float) -> tuple[bool, str]:
    """For the measured mode of `mem-probe`: does the peak measured on the GPU (any rank, driver's view) stay within
    the limit auto held the estimate to? Returns (ok, one line naming what to set when it does not)."""
    label = choice.chosen.label
    if choice.limit_gib is None:
        return True, f"{label}: no GPU memory limit was assumed; measured peak {measured_peak_gib:.2f} GiB"
    est = next((t.peak_gib for t in choice.tried if t.candidate == choice.chosen), None)
    est_text = f"estimated {est:.2f}, " if est is not None else ""
    if measured_peak_gib <= choice.limit_gib:
        return True, (
            f"{label} confirmed: measured peak {measured_peak_gib:.2f} GiB ({est_text}limit {choice.limit_gib:.1f} GiB)"
        )
    later = [t.candidate for t in choice.tried]
    nxt = later[later.index(choice.chosen) + 1] if choice.chosen in later[:-1] else None
    fix = (
        (
            f"set distributed.zero_stage: {nxt.stage}"
            + (", distributed.offload_optimizer: true" if nxt.offload_optimizer else "")
            + (", distributed.offload_params: true" if nxt.offload_params else "")
            + (", trainer.gradient_checkpointing: true" if nxt.gradient_checkpointing else "")
        )
        if nxt is not None
        else "use more GPUs or shorter completions"
    )
    return False, (
        f"{label} not confirmed: measured peak {measured_peak_gib:.2f} GiB exceeds the limit "
        f"{choice.limit_gib:.1f} GiB ({est_text}{choice.margin:.0%} margin); {fix}"
    )


def with_share(recipe: Recipe, share: float) -> Recipe:
    """A copy of `recipe` with `generation.vllm_gpu_memory_utilization` set to `share`."""
    gen = recipe.generation.model_copy(update={"vllm_gpu_memory_utilization": share})
    return recipe.model_copy(update={"generation": gen})


def choose_share(resolved: Resolved, gpu_gib: float | None) -> ShareChoice:
    """`generation.vllm_gpu_memory_utilization: auto`: the share one generation batch needs by the estimate (vLLM's
    weights, the batch's KV cache, the allowance) plus SHARE_MARGIN, what `mem-probe --estimate` recommends; the
    schema's default 0.3 where nothing can be sized (no vLLM on a GPU here, or no estimate of the model)."""
    from colocate_rl.memory.estimate import SHARE_MARGIN, estimate

    if gpu_gib is None or resolved.backend != "vllm":
        return ShareChoice(DEFAULT_SHARE, f"no vLLM on a GPU here (generation with {resolved.backend}): the default")
    if resolved.recipe.generation.kv_cache_memory is not None:
        return ShareChoice(DEFAULT_SHARE, "generation.kv_cache_memory sizes vLLM's memory instead: the default")
    try:
        e = estimate(resolved, gpu_gib)
    except UserError as err:  # unknown layout: no estimate possible
        return ShareChoice(DEFAULT_SHARE, f"no estimate ({err.lines[0]}): the default")
    n = engine_copies(resolved.recipe)
    kv = f"one generation batch's KV cache ({e.kv['gib']:.2f} GiB)"
    held = (
        f"vLLM's weights, {kv} and its allowance"
        if n == 1
        else f"{n} engine processes' vLLM weights and allowances, {kv}"
    )
    return ShareChoice(
        e.chosen, f"{held} = {e.need_gib:.2f} GiB ({e.lower:.3f} of {gpu_gib:.1f} GiB) + {SHARE_MARGIN:.0%} of the GPU"
    )


def with_sleep_level(recipe: Recipe, level: int) -> Recipe:
    """A copy of `recipe` with `generation.sleep_level` set to `level`."""
    return recipe.model_copy(update={"generation": recipe.generation.model_copy(update={"sleep_level": level})})


def choose_sleep_level(resolved: Resolved, gpu_gib: float | None, prompt_tokens: int | None = None) -> SleepChoice:
    """`generation.sleep_level: auto` for `resolved` (its layout chosen or given): 0 when the estimated peak with vLLM
    awake through training is at most `gpu_gib × (1 − LAYOUT_HEADROOM)`, the limit `choose_layout` holds layouts
    to; else 2, also when there is no vLLM on a GPU or no estimate to compare (2 frees the most)."""
    from colocate_rl.memory.estimate import estimate

    if gpu_gib is None or resolved.backend != "vllm":
        return SleepChoice(
            2, f"no vLLM on a GPU here (generation with {resolved.backend}), so no memory to compare: the safe level"
        )
    limit = gpu_gib * (1 - LAYOUT_HEADROOM)
    awake = dataclasses.replace(resolved, recipe=with_sleep_level(resolved.recipe, 0))
    try:
        phase, peak = estimate(awake, gpu_gib, prompt_tokens).peak()
    except UserError as err:  # unknown layout: no estimate possible
        return SleepChoice(
            2, f"no estimate ({err.lines[0]}), so the safe level; set generation.sleep_level to override"
        )
    margin = f"{gpu_gib:.1f} GiB less {LAYOUT_HEADROOM:.0%} margin"
    if peak <= limit:
        reason = f"trainer and vLLM fit together (peak {peak:.2f} ≤ {limit:.1f} GiB at sleep 0, {margin})"
        return SleepChoice(0, reason, peak, limit)
    reason = f"at sleep 0 the peak would be {peak:.2f} GiB ({phase}) > {limit:.1f} GiB ({margin})"
    return SleepChoice(2, reason, peak, limit)


def with_engine_processes(resolved: Resolved, auto_share: bool) -> Resolved:
    """`resolved` with `generation.engine_processes: auto` decided (`choose_engine_processes`; `auto_share`: the
    recipe left vLLM's share auto); unchanged when the recipe sets the count."""
    if resolved.recipe.generation.engine_processes != "auto":
        return resolved
    params_b = model_params_b(resolved)
    cores = rank_cores(resolved.host, resolved.nproc_per_node)
    choice = choose_engine_processes(resolved.recipe, resolved.backend, params_b, cores, auto_share)
    recipe = with_values(resolved.recipe, {"generation.engine_processes": choice.count})
    return dataclasses.replace(resolved, recipe=recipe, engine_processes_choice=choice)


def with_mps(resolved: Resolved) -> Resolved:
    """`resolved` (overlap decided) with `generation.mps: auto` decided (`choose_mps`, by the model's size); raises
    UserError when an explicit `on` cannot run (`check_mps`)."""
    if problems := check_mps(resolved.recipe, resolved.host):
        raise UserError(*problems)
    if resolved.recipe.generation.mps != "auto":
        return resolved
    choice = choose_mps(resolved.recipe, resolved.backend, model_params_b(resolved), resolved.host)
    recipe = with_values(resolved.recipe, {"generation.mps": "on" if choice.on else "off"})
    return dataclasses.replace(resolved, recipe=recipe, mps_choice=choice)


def model_params_b(resolved: Resolved) -> float | None:
    """The model's parameters in billions (active ones, for a mixture of experts); None for a layout the estimate
    does not know."""
    try:
        return layout_for(resolved.recipe.model.name, config=resolved.preflight.model_config).active_params / 1e9
    except UserError:
        return None
