"""TRL's GRPOConfig/RLOOConfig arguments of a run, and which TRL fields colocate-rl owns (so that
`trainer.extra_args` cannot override them). Torch-free."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from colocate_rl import rundir

if TYPE_CHECKING:
    from colocate_rl.plan.resolve import Resolved

# TRL config fields `trl_args` sets from something other than a `trainer.*` key of the same name, and the recipe
# key that controls each (`trainer.*` fields are owned by their section: see plan.resolve).
MANAGED_TRL_FIELDS = {
    "output_dir": "output.run_dir",
    "logging_dir": "output.run_dir",
    "data_seed": "trainer.seed",
    "report_to": "output.report_to",
    "disable_tqdm": "the progress lines of `colocate-rl train`",
    "deepspeed": "distributed.deepspeed",
    "bf16": "distributed.mixed_precision",
    "fp16": "distributed.mixed_precision",
    "use_cpu": "distributed.nproc_per_node (the device follows the host)",
    "use_vllm": "generation.backend",
    "vllm_mode": "generation.backend",
    "vllm_gpu_memory_utilization": "generation.vllm_gpu_memory_utilization",
    "vllm_tensor_parallel_size": "generation.tensor_parallel_size",
    "vllm_enable_sleep_mode": "generation.sleep_level",
    "vllm_max_model_length": "generation.max_model_length",
    "reward_weights": "rewards[*].weight",
    "model_init_kwargs": "model.dtype",
    "save_strategy": "checkpoint.every_steps / checkpoint.every_minutes",
    "save_steps": "checkpoint.every_steps",
    "save_total_limit": "checkpoint.keep_last",
    "resume_from_checkpoint": "`colocate-rl train --resume RUN_DIR`",
}


def trl_field_names(algorithm: str) -> set[str]:
    """Field names of TRL's GRPOConfig / RLOOConfig for the pinned TRL (checked against TRL by a test)."""
    data = json.loads(resources.files("colocate_rl.recipe").joinpath("trl_fields.json").read_text())
    return set(data[algorithm])


def trl_args(resolved: Resolved, run_dir: Path) -> dict[str, Any]:
    """Keyword arguments of TRL's GRPOConfig/RLOOConfig for this run (extra_args included)."""
    recipe, trainer, gen = resolved.recipe, resolved.recipe.trainer, resolved.recipe.generation
    args: dict[str, Any] = {
        "output_dir": str(run_dir / rundir.CHECKPOINTS),
        "learning_rate": trainer.learning_rate,
        "per_device_train_batch_size": trainer.per_device_train_batch_size,
        "gradient_accumulation_steps": trainer.gradient_accumulation_steps,
        "num_generations": trainer.num_generations,
        "max_completion_length": trainer.max_completion_length,
        "max_steps": trainer.max_steps,
        "beta": trainer.beta,
        "temperature": trainer.temperature,
        "seed": trainer.seed,
        "data_seed": trainer.seed,
        "gradient_checkpointing": resolved.gradient_checkpointing,
        "logging_steps": trainer.logging_steps,
        "save_strategy": "no",  # colocate-rl's checkpoint policy asks for each save (colocate_rl.rank.checkpoints)
        "save_total_limit": recipe.checkpoint.keep_last,
        "report_to": list(recipe.output.report_to) or "none",
        "disable_tqdm": True,
        "bf16": resolved.precision == "bf16",
        "fp16": resolved.precision == "fp16",
        "use_cpu": resolved.device == "cpu",
        "model_init_kwargs": {"dtype": resolved.model_dtype},
        "reward_weights": [r.weight for r in recipe.rewards],
        "use_vllm": resolved.backend == "vllm",
    }
    if resolved.deepspeed is not None:
        args["deepspeed"] = str(run_dir / rundir.DEEPSPEED)
    if resolved.backend == "vllm":
        args.update(
            vllm_mode="colocate",
            vllm_gpu_memory_utilization=gen.vllm_gpu_memory_utilization,
            vllm_tensor_parallel_size=gen.tensor_parallel_size,
            vllm_enable_sleep_mode=gen.sleep_level > 0,
        )
        if gen.max_model_length is not None:
            args["vllm_max_model_length"] = gen.max_model_length
    args.update(trainer.extra_args)
    return args
