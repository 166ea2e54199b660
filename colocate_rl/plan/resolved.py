"""`Resolved`: a recipe bound to a host, every `auto` decided, and the recipe as the run directory records it
(`Resolved.recorded_recipe`: the decided values in place of `auto`, so that a resume and the ranks read them and
never choose again). Torch-free; reads nothing."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from colocate_rl.plan.choices import (
    EngineProcessesChoice,
    LayoutChoice,
    MicroBatchChoice,
    MpsChoice,
    OverlapChoice,
    ShareChoice,
    SleepChoice,
)
from colocate_rl.plan.deepspeed import AUTO_BASE_CONFIG, ZeroLayout
from colocate_rl.plan.host import Host
from colocate_rl.plan.overlap import engine_copies, engine_in_process
from colocate_rl.plan.preflight import Preflight
from colocate_rl.recipe.schema import Recipe

# Every recipe key that may say `auto`: what the resolution decides
AUTO_KEYS = (
    "distributed.nproc_per_node",
    "distributed.mixed_precision",
    "distributed.zero_stage",
    "model.dtype",
    "generation.backend",
    "generation.vllm_gpu_memory_utilization",
    "generation.sleep_level",
    "generation.overlap",
    "generation.engine_process",
    "generation.engine_processes",
    "generation.mps",
    "trainer.gradient_checkpointing",
    "trainer.micro_batch_size",
)


# Built-in rewards slow enough to score on several processes when `processes: auto`: the most processes each takes
AUTO_REWARD_PROCESSES = {"math_verify": 8}


def rank_cores(host: Host, nproc_per_node: int) -> int:
    """A rank's share of the host's CPU cores."""
    return host.cpu_count // max(nproc_per_node, 1)


def reward_processes(recipe: Recipe, host: Host, nproc_per_node: int) -> list[int]:
    """Each reward's `processes` as an integer: `auto` gives a reward of AUTO_REWARD_PROCESSES the rank's spare CPU
    cores (`rank_cores`, less one for the trainer and one for each engine process), when that is 2 or more; else 1.
    `recipe` has its engine process count decided."""
    spare = rank_cores(host, nproc_per_node) - 1 - engine_copies(recipe)
    out = []
    for reward in recipe.rewards:
        most = AUTO_REWARD_PROCESSES.get((reward.name or "").strip(), 1)
        auto = min(most, spare) if most > 1 and spare >= 2 else 1
        out.append(reward.processes if isinstance(reward.processes, int) else auto)
    return out


def _get(recipe: Recipe, dotted: str) -> Any:
    section, key = dotted.split(".")
    return getattr(getattr(recipe, section), key)


def auto_keys(recipe: Recipe) -> list[str]:
    """The keys of AUTO_KEYS that `recipe` leaves `auto`."""
    return [key for key in AUTO_KEYS if _get(recipe, key) == "auto"]


def with_values(recipe: Recipe, values: Mapping[str, Any]) -> Recipe:
    """A copy of `recipe` with `values` (`section.key` → value) set as they are: values a resolution decided."""
    sections: dict[str, dict[str, Any]] = {}
    for dotted, value in values.items():
        section, key = dotted.split(".")
        sections.setdefault(section, {})[key] = value
    return recipe.model_copy(update={s: getattr(recipe, s).model_copy(update=u) for s, u in sections.items()})


@dataclass(frozen=True)
class Resolved:
    """A validated recipe bound to a host: every machine-dependent choice made. `recipe` holds the sleep level and
    micro-batch decided; the other decisions are fields here (`recorded_recipe` puts them into the recipe)."""

    recipe: Recipe
    host: Host
    nproc_per_node: int
    device: str  # "cuda" or "cpu"
    backend: str  # "vllm" or "transformers"
    precision: str  # "bf16", "fp16" or "no"
    model_dtype: str  # "bfloat16", "float16" or "float32"
    deepspeed: dict[str, Any] | None
    builtin_layout: str | None  # set when model.name is builtin:<layout>
    preflight: Preflight  # what the recipe's files said: the estimate reads the model's config from it
    gradient_checkpointing: bool = False  # trainer.gradient_checkpointing as resolved (auto → chosen)
    share_choice: ShareChoice | None = None  # when generation.vllm_gpu_memory_utilization is auto (recipe holds it)
    layout_choice: LayoutChoice | None = None  # what auto chose, when zero_stage or gradient_checkpointing is auto
    sleep_choice: SleepChoice | None = None  # what auto chose, when generation.sleep_level is auto (recipe holds it)
    micro_batch_choice: MicroBatchChoice | None = None  # when trainer.micro_batch_size is auto (recipe holds it)
    overlap_choice: OverlapChoice | None = None  # when generation.overlap is auto (recipe holds it)
    engine_processes_choice: EngineProcessesChoice | None = None  # when generation.engine_processes is auto (recipe
    # holds it); a line only where the engine runs in its own process
    mps_choice: MpsChoice | None = None  # when generation.mps is auto (recipe holds it); a line only with overlap

    def choice_lines(self) -> list[str]:
        """What each `auto` chose and why, one line each (the layout may take several)."""
        return (
            (  # decided first: the share holds every engine process's copy
                [self.engine_processes_choice.line()]
                if self.engine_processes_choice is not None and engine_in_process(self.recipe)
                else []
            )
            + ([self.share_choice.line()] if self.share_choice is not None else [])
            + (self.layout_choice.lines() if self.layout_choice is not None else [])
            + ([self.sleep_choice.line()] if self.sleep_choice is not None else [])
            + ([self.micro_batch_choice.line()] if self.micro_batch_choice is not None else [])
            + ([self.overlap_choice.line()] if self.overlap_choice is not None else [])
            + (
                [self.mps_choice.line()]
                if self.mps_choice is not None and self.recipe.generation.overlap == "one_step"
                else []
            )
            + [
                f"rewards[{i}].processes: auto → {n} ({r.name} scored on {n} processes of the rank's "
                f"{rank_cores(self.host, self.nproc_per_node)} CPU cores)"
                for i, (r, n) in enumerate(zip(self.recipe.rewards, self.reward_processes))
                if r.processes == "auto" and n > 1
            ]
        )

    @property
    def reward_processes(self) -> list[int]:
        return reward_processes(self.recipe, self.host, self.nproc_per_node)

    @property
    def world_size(self) -> int:
        return self.recipe.distributed.nnodes * self.nproc_per_node

    def recorded_recipe(self) -> Recipe:
        """The recipe with every `auto` replaced by what it resolved to (`auto_keys` of it is empty): ranks, backend,
        precision, dtype, gradient checkpointing and, for `zero_stage: auto`, the DeepSpeed config named (auto's
        base when none), the stage and the offload chosen."""
        dist = self.recipe.distributed
        values: dict[str, Any] = {
            "generation.engine_process": engine_in_process(self.recipe),
            "distributed.nproc_per_node": self.nproc_per_node,
            "distributed.mixed_precision": self.precision,
            "model.dtype": self.model_dtype,
            "generation.backend": self.backend,
            "trainer.gradient_checkpointing": self.gradient_checkpointing,
        }
        if dist.zero_stage == "auto":
            zero = ZeroLayout.of(self.deepspeed)
            values.update(
                {"distributed.deepspeed": dist.deepspeed or AUTO_BASE_CONFIG, "distributed.zero_stage": zero.stage}
            )
            for key in ("offload_optimizer", "offload_params"):
                if getattr(dist, key) is None:
                    values[f"distributed.{key}"] = getattr(zero, key)
        rewards = [r.model_copy(update={"processes": n}) for r, n in zip(self.recipe.rewards, self.reward_processes)]
        return with_values(self.recipe, values).model_copy(update={"rewards": rewards})
