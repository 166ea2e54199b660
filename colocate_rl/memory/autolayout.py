"""`distributed.zero_stage: auto` and `trainer.gradient_checkpointing: auto`: the fastest trainer layout that fits.

`choose_layout` is a pure function of a resolved recipe and the GPU memory: it lists the candidate layouts in
order of speed, estimates each one's peak memory per GPU with `colocate_rl.memory.estimate` (the arithmetic of
`mem-probe --estimate`), and takes the first whose peak is at most the GPU's memory less a safety margin.

Candidate order (by measured speed, not by how much memory each saves). Reference run: 2 H200s, random-init
Qwen2.5-1.5B layout, 32 completions × 256 tokens per step, sleep mode on, median s/step: ZeRO-2 1.38, plain DDP
1.65, ZeRO-3 3.17 (and TRL's server mode, 1 GPU generating + 1 training, 2.39). So:

1. ZeRO-2 — faster than DDP on that run, and unlike plain DDP with bf16 weights it keeps fp32 master weights,
   so lr 1e-6 updates are not lost to bf16 rounding. ZeRO-1 has ZeRO-2's speed profile with more memory
   (unsharded gradients), so it is not a candidate.
2. ZeRO-3.
3. ZeRO-3 + optimizer offload.
4. ZeRO-3 + optimizer and parameter offload.

Plain DDP and ZeRO-1 stay available by explicit setting (`distributed.deepspeed: null` / `zero_stage: 1`). With
`trainer.gradient_checkpointing: auto` each stage is tried without checkpointing, then with it, before the next
stage: checkpointing costs about a third more train compute, ZeRO-3 far more. Explicit settings win:
`offload_optimizer` / `offload_params` set in the recipe (or offload present in the DeepSpeed JSON it names) are
applied to every candidate (candidates that become invalid, such as parameter offload below ZeRO-3, or
duplicates, drop out); an explicit `zero_stage` leaves only gradient checkpointing to choose.

What is compared: the estimated peak over all four phases (generation, weight sync, training, optimizer step) at
the recipe's `generation.vllm_gpu_memory_utilization`. With sleep mode on, vLLM's memory is freed while the trainer
trains and steps, so the training phases hold the trainer's state, activations, logits and step buffers beside the
sleep residue; but the trainer's resident state (weights, gradients, optimizer states unless offloaded) stays on the
GPU while vLLM is awake, so generation and the weight sync count too: a layout whose state does not leave room for
vLLM's share fails at vLLM's start, not in backward. With sleep mode off, every phase holds vLLM's whole share.

Margin: 10 % of the GPU must stay free above the estimated peak. The estimate is arithmetic: within 6 % of the
measured peak for DDP and 16–33 % low for ZeRO-3 on the H200 reference runs (README, tests/test_estimate.py), and
the allocator's fragmentation and NCCL buffers come on top; 10 % keeps a layout that is borderline by the
estimate from being chosen over the next, slower, safe one. When the measured mode of `mem-probe` runs, it can
check the choice with `confirm_choice`.

Offloaded state must also fit in host memory: when this machine's RAM is known (not for `--gpus N` planning), a
candidate whose offload needs more than 90 % of it per node (`mem-probe --estimate`'s host figure) does not fit.

Without a GPU (CPU runs, planning without `--gpus`) there is no memory limit to compare with: the first candidate
is taken and the reason says so. On a GPU where no estimate is possible (a model whose layout is unknown, the
transformers backend) the first ZeRO-3 candidate (with checkpointing when that is auto) is taken, as the safe
choice. When no candidate fits, the last one (the most frugal) is taken, and `mem-probe --estimate` explains
what else to change.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from colocate_rl.errors import UserError
from colocate_rl.plan.deepspeed import build_deepspeed_config, load_base_config, zero_settings

MARGIN = 0.10  # of the GPU's memory, kept free above a candidate's estimated peak
AUTO_BASE_CONFIG = "zero3"  # the shipped DeepSpeed JSON auto starts from when distributed.deepspeed is null
# (stage, offload optimizer, offload params), fastest first: see the module docstring
STAGES = ((2, False, False), (3, False, False), (3, True, False), (3, True, True))


@dataclass(frozen=True)
class Candidate:
    """One layout: ZeRO stage (None = plain DDP), offload, gradient checkpointing, and its DeepSpeed JSON."""

    stage: int | None
    offload_optimizer: bool
    offload_params: bool
    gradient_checkpointing: bool
    deepspeed: dict[str, Any] | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def label(self) -> str:
        name = "DDP" if self.stage is None else f"ZeRO-{self.stage}"
        off = [x for x, on in (("optimizer", self.offload_optimizer), ("params", self.offload_params)) if on]
        if off:
            name += " + offload " + " and ".join(off)
        return name + (", checkpointing" if self.gradient_checkpointing else "")


@dataclass(frozen=True)
class Tried:
    """A candidate and its estimated peak per GPU (None when not estimated)."""

    candidate: Candidate
    peak_gib: float | None = None
    peak_phase: str | None = None
    fits: bool | None = None
    host_gib: float = 0.0  # host memory per node for what it offloads
    host_fits: bool = True  # within this machine's RAM less the margin (True when the RAM is not known)


@dataclass(frozen=True)
class LayoutChoice:
    """What auto chose and why: every candidate in order, its estimate, the limit it was held to."""

    chosen: Candidate
    tried: tuple[Tried, ...]
    gpu_gib: float | None  # one GPU's memory; None without a GPU
    margin: float
    reason: str  # one line
    auto_keys: tuple[str, ...]  # the recipe keys that were auto

    @property
    def limit_gib(self) -> float | None:
        return None if self.gpu_gib is None else self.gpu_gib * (1 - self.margin)

    @property
    def deepspeed(self) -> dict[str, Any] | None:
        return self.chosen.deepspeed

    @property
    def gradient_checkpointing(self) -> bool:
        return self.chosen.gradient_checkpointing

    def lines(self) -> list[str]:
        """Human lines: the header, one per candidate (estimated peak vs the limit), the choice and why."""
        keys = " and ".join(self.auto_keys)
        if self.limit_gib is None:
            head = f"{keys} auto: no GPU memory to compare with"
        else:
            head = (
                f"{keys} auto: estimated peak per GPU vs {self.limit_gib:.1f} GiB ({self.gpu_gib:.1f} GiB less "
                f"{self.margin:.0%} margin), fastest first"
            )
        out = [head]
        for t in self.tried:
            mark = "  ← chosen" if t.candidate == self.chosen else ""
            if t.peak_gib is None:
                out.append(f"  {t.candidate.label:<52} not estimated{mark}")
            else:
                why = [
                    x
                    for x, bad in (("too big", t.peak_gib > self.limit_gib), ("host RAM too small", not t.host_fits))
                    if bad
                ]
                verdict = "; ".join(why) if why else "fits"
                host = f" + host {t.host_gib:.1f} GiB" if t.host_gib else ""
                out.append(f"  {t.candidate.label:<52} {t.peak_gib:7.2f} GiB ({t.peak_phase}){host} {verdict}{mark}")
        out.append(f"chosen: {self.chosen.label} — {self.reason}")
        return out

    def pinned_sets(self, deepspeed: str | None) -> list[str]:
        """`--set` overrides that fix the chosen layout (for keys that were auto), so a run at another vLLM share
        trains with this layout rather than auto's choice for that share. `deepspeed`: the recipe's
        `distributed.deepspeed` (None: auto's base config is named)."""
        c, out = self.chosen, []
        if "distributed.zero_stage" in self.auto_keys and c.stage is not None:
            out += [] if deepspeed else [f"distributed.deepspeed={AUTO_BASE_CONFIG}"]
            out += [
                f"distributed.zero_stage={c.stage}",
                f"distributed.offload_optimizer={str(c.offload_optimizer).lower()}",
                f"distributed.offload_params={str(c.offload_params).lower()}",
            ]
        if "trainer.gradient_checkpointing" in self.auto_keys:
            out.append(f"trainer.gradient_checkpointing={str(c.gradient_checkpointing).lower()}")
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "auto_keys": list(self.auto_keys),
            "gpu_memory_gib": self.gpu_gib,
            "margin": self.margin,
            "limit_gib": None if self.limit_gib is None else round(self.limit_gib, 3),
            "chosen": _cand_json(self.chosen),
            "reason": self.reason,
            "candidates": [
                {
                    **_cand_json(t.candidate),
                    "peak_gib": None if t.peak_gib is None else round(t.peak_gib, 3),
                    "peak_phase": t.peak_phase,
                    "host_gib": round(t.host_gib, 3),
                    "fits": t.fits,
                }
                for t in self.tried
            ],
        }


def _cand_json(c: Candidate) -> dict[str, Any]:
    return {
        "label": c.label,
        "zero_stage": c.stage,
        "offload_optimizer": c.offload_optimizer,
        "offload_params": c.offload_params,
        "gradient_checkpointing": c.gradient_checkpointing,
    }


def _zero(config: dict[str, Any] | None) -> tuple[int | None, bool, bool]:
    return zero_settings(config)[1:]


def host_fits(host_gib: float, ram_gib: float | None) -> bool:
    """Whether offloaded state of host_gib per node fits this machine's RAM less MARGIN (True when RAM is unknown)."""
    return ram_gib is None or host_gib <= ram_gib * (1 - MARGIN)


def candidates(resolved, valid: Callable[[dict[str, Any]], bool] | None = None) -> list[Candidate]:
    """The layouts auto may choose for `resolved` (a Resolved whose `deepspeed` is the recipe's explicit build),
    fastest first, each with its DeepSpeed JSON; explicit recipe settings applied, invalid ones (DeepSpeed's rules,
    and `valid(config)` false: e.g. the engine's trainer offload needs its optimizer states on the GPU) and
    duplicates dropped."""
    dist, gc = resolved.recipe.distributed, resolved.recipe.trainer.gradient_checkpointing
    gcs = (False, True) if gc == "auto" else (bool(gc),)
    configs: list[dict[str, Any] | None] = []
    if dist.zero_stage == "auto":
        spec = dist.deepspeed or AUTO_BASE_CONFIG
        _, base_opt, base_par = _zero(load_base_config(spec))
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
            c = Candidate(*_zero(config), gradient_checkpointing=g, deepspeed=config)
            if c not in out:
                out.append(c)
    return out


def choose_layout(
    resolved,
    gpu_gib: float | None,
    prompt_tokens: int | None = None,
    valid: Callable[[dict[str, Any]], bool] | None = None,
    ram_gib: float | None = None,
) -> LayoutChoice:
    """The first of `candidates(resolved)` whose estimated peak (over all phases, at the recipe's vLLM share) is at
    most `gpu_gib × (1 − MARGIN)` and, when `ram_gib` (this machine's memory) is known, whose offloaded state fits in
    `ram_gib × (1 − MARGIN)`. `gpu_gib` None (no GPU): the first candidate, nothing estimated."""
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
        cands = [
            Candidate(*_zero(config), gradient_checkpointing=trainer.gradient_checkpointing is True, deepspeed=config)
        ]

    def done(chosen, tried, reason):
        return LayoutChoice(
            chosen,
            tuple(tried),
            gpu_gib,
            MARGIN,
            reason,
            auto_keys,
        )

    if gpu_gib is None or resolved.device != "cuda":
        return done(
            cands[0],
            [Tried(c) for c in cands],
            "no GPU here, so no memory limit was assumed: the fastest candidate (--gpus N plans for GPUs)",
        )
    limit = gpu_gib * (1 - MARGIN)
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
        f" (and its offload in {ram_gib * (1 - MARGIN):.1f} GiB of host memory)"
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
