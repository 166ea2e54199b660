"""What each `auto` of the recipe chose and why: the trainer layout (`LayoutChoice`, its `Candidate`s and their
estimates), the sleep level (`SleepChoice`) and the micro-batch (`MicroBatchChoice`). Plain records, made by
`colocate_rl.memory` (autolayout, micro_batch), held by `colocate_rl.plan.resolved.Resolved`, printed by the CLI and
pinned into the run directory's recipe.yaml. Torch-free."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from colocate_rl.plan.deepspeed import AUTO_BASE_CONFIG, ZeroLayout


@dataclass(frozen=True)
class Candidate:
    """One layout: ZeRO stage (None = plain DDP), offload, gradient checkpointing, and its DeepSpeed JSON."""

    stage: int | None
    offload_optimizer: bool
    offload_params: bool
    gradient_checkpointing: bool
    deepspeed: dict[str, Any] | None = dataclasses.field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, config: dict[str, Any] | None, gradient_checkpointing: bool) -> Candidate:
        zero = ZeroLayout.of(config)
        return cls(zero.stage, zero.offload_optimizer, zero.offload_params, gradient_checkpointing, config)

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

    def pinned_overrides(self, deepspeed: str | None) -> dict[str, Any]:
        """Overrides that fix the chosen layout (for keys that were auto), so a run at another vLLM share trains with
        this layout rather than auto's choice for that share. `deepspeed`: the recipe's `distributed.deepspeed`
        (None: auto's base config is named)."""
        c, out = self.chosen, {}
        if "distributed.zero_stage" in self.auto_keys and c.stage is not None:
            if not deepspeed:
                out["distributed.deepspeed"] = AUTO_BASE_CONFIG
            out["distributed.zero_stage"] = c.stage
            out["distributed.offload_optimizer"] = c.offload_optimizer
            out["distributed.offload_params"] = c.offload_params
        if "trainer.gradient_checkpointing" in self.auto_keys:
            out["trainer.gradient_checkpointing"] = c.gradient_checkpointing
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


@dataclass(frozen=True)
class ShareChoice:
    """What `generation.vllm_gpu_memory_utilization: auto` chose and why."""

    share: float
    reason: str

    def line(self) -> str:
        return f"generation.vllm_gpu_memory_utilization auto: {self.share:g} — {self.reason}"

    def to_json(self) -> dict[str, Any]:
        return {"share": self.share, "reason": self.reason}


@dataclass(frozen=True)
class SleepChoice:
    """What `generation.sleep_level: auto` chose and why; the estimated peak at sleep 0 and the limit it was held to
    (None when nothing was estimated); the micro-batch taken awake where the forecast chose 2 for a larger one."""

    level: int
    reason: str
    peak_gib: float | None = None
    limit_gib: float | None = None
    awake_micro_batch: int | None = None

    def line(self) -> str:
        return f"generation.sleep_level auto: {self.level} — {self.reason}"

    def to_json(self) -> dict[str, Any]:
        rounded = [None if x is None else round(x, 3) for x in (self.peak_gib, self.limit_gib)]
        return {
            "level": self.level,
            "reason": self.reason,
            "peak_gib_at_sleep_0": rounded[0],
            "limit_gib": rounded[1],
            "awake_micro_batch": self.awake_micro_batch,
        }

    def confirm(self, measured_peak_gib: float) -> tuple[bool, str]:
        """For the measured `mem-probe` (its trials ran at this level): at level 0, does the measured peak stay
        within the limit? Returns (ok, one line)."""
        if self.level != 0 or self.limit_gib is None:
            return True, f"sleep level {self.level}, not measured at 0: {self.reason}"
        seen = (
            f"measured peak {measured_peak_gib:.2f} GiB (estimated {self.peak_gib:.2f}, limit {self.limit_gib:.1f} GiB)"
        )
        if measured_peak_gib <= self.limit_gib:
            return True, f"sleep level 0 confirmed: {seen}"
        return False, f"sleep level 0 not confirmed: {seen}; set generation.sleep_level: 2"


@dataclass(frozen=True)
class SwitchChoice:
    """What an on/off `generation.<KEY>: auto` chose (ON_VALUE when `on`, else off) and why."""

    KEY: ClassVar[str]
    ON_VALUE: ClassVar[str] = "on"
    on: bool
    reason: str

    @property
    def value(self) -> str:
        return self.ON_VALUE if self.on else "off"

    def line(self) -> str:
        return f"generation.{self.KEY} auto: {self.value} — {self.reason}"

    def to_json(self) -> dict[str, Any]:
        return {self.KEY: self.value, "reason": self.reason}


class OverlapChoice(SwitchChoice):
    """What `generation.overlap: auto` chose (one_step when `on`) and why."""

    KEY, ON_VALUE = "overlap", "one_step"


class MpsChoice(SwitchChoice):
    """What `generation.mps: auto` chose and why."""

    KEY = "mps"


@dataclass(frozen=True)
class EngineProcessesChoice:
    """What `generation.engine_processes: auto` chose and why."""

    count: int
    reason: str

    def line(self) -> str:
        return f"generation.engine_processes auto: {self.count} — {self.reason}"

    def to_json(self) -> dict[str, Any]:
        return {"engine_processes": self.count, "reason": self.reason}


@dataclass(frozen=True)
class MicroBatchChoice:
    """What `trainer.micro_batch_size: auto` chose and why; the estimated peak at that size and the limit it was held
    to (None when nothing was estimated)."""

    size: int
    steps: int  # gradient accumulation steps at that size
    reason: str
    peak_gib: float | None = None
    limit_gib: float | None = None

    def line(self) -> str:
        return (
            f"trainer.micro_batch_size auto: {self.size} (× {self.steps} accumulation step"
            f"{'s' if self.steps > 1 else ''}) — {self.reason}"
        )

    def to_json(self) -> dict[str, Any]:
        rounded = [None if x is None else round(x, 3) for x in (self.peak_gib, self.limit_gib)]
        return {
            "size": self.size,
            "gradient_accumulation_steps": self.steps,
            "reason": self.reason,
            "peak_gib": rounded[0],
            "limit_gib": rounded[1],
        }
