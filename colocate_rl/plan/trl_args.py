"""TRL's GRPOConfig/RLOOConfig arguments of a run: colocate-rl's own, then the algorithm's preset
(colocate_rl.algorithms), then `trainer.extra_args`; and which TRL fields colocate-rl owns (so that neither the
preset nor `trainer.extra_args` can override them). Torch-free."""

from __future__ import annotations

import json
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from colocate_rl import algorithms, rundir
from colocate_rl.errors import did_you_mean

if TYPE_CHECKING:
    from colocate_rl.plan.resolved import Resolved
    from colocate_rl.recipe.schema import Recipe

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
    "max_tool_calling_iterations": "tools.max_turns",
    "model_init_kwargs": "model.dtype",
    "save_strategy": "checkpoint.every_steps / checkpoint.every_minutes",
    "save_steps": "checkpoint.every_steps",
    "save_total_limit": "checkpoint.keep_last",
    "resume_from_checkpoint": "`colocate-rl train --resume RUN_DIR`",
    # the launcher pushes final/ once the run has finished (colocate_rl.launch.push), not TRL from the ranks
    **dict.fromkeys(
        (
            "push_to_hub",
            "hub_model_id",
            "hub_private_repo",
            "hub_strategy",
            "hub_token",
            "hub_always_push",
            "hub_revision",
        ),
        "output.push_to_hub (and output.hub_private)",
    ),
}


# TRL/transformers fields of TRL's own evaluation, which colocate-rl does not run: it generates at the training
# temperature with num_generations_eval per prompt and adds a loss pass. The recipe's `eval:` section evaluates instead
# (colocate_rl.rank.evaluation).
EVALUATION_FIELDS = {
    "eval_strategy",
    "eval_steps",
    "do_eval",
    "eval_on_start",
    "eval_delay",
    "load_best_model_at_end",
    "metric_for_best_model",
    "greater_is_better",
    "per_device_eval_batch_size",
    "eval_accumulation_steps",
    "num_generations_eval",
    "eval_do_concat_batches",
    "eval_use_gather_object",
    "batch_eval_metrics",
    "bf16_full_eval",
    "fp16_full_eval",
    "prediction_loss_only",
    "include_for_metrics",
}


def trl_field_names(trainer: str) -> set[str]:
    """Field names of TRL's GRPOConfig ("grpo") / RLOOConfig ("rloo") for the pinned TRL (checked against TRL by a
    test)."""
    data = json.loads(resources.files("colocate_rl.recipe").joinpath("trl_fields.json").read_text())
    return set(data[trainer])


def trl_args(resolved: Resolved, run_dir: Path) -> dict[str, Any]:
    """Keyword arguments of TRL's GRPOConfig/RLOOConfig for this run: colocate-rl's own < the algorithm's preset <
    `trainer.extra_args` (neither may hold a field colocate-rl manages: see check_extra_args and the tests)."""
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
        "reward_weights": [r.weight for r in recipe.rewards] or None,  # none: the environment's get_reward, weight 1
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
    if recipe.tools.active:
        args["max_tool_calling_iterations"] = recipe.tools.max_turns
    args.update(algorithms.get(recipe.algorithm).preset)
    args.update(trainer.extra_args)
    return args


KIND_NAMES = {
    "bool": "true/false",
    "int": "a whole number",
    "float": "a number",
    "str": "text",
    "null": "null",
    "list": "a list",
    "dict": "a mapping",
}


def trl_value_kinds(trainer: str) -> dict[str, dict[str, list]]:
    """Field → {"kinds": the JSON kinds TRL takes (bool, int, float, str, null, list, dict or any), "choices": the
    strings it takes, when it checks them} of GRPOConfig / RLOOConfig (the pinned TRL; checked by a test)."""
    import json
    from importlib import resources

    data = json.loads(resources.files("colocate_rl.recipe").joinpath("trl_fields.json").read_text())
    return data["types"][trainer]


def _at_least(low: float, open_: bool = False) -> tuple[Callable[[float], bool], str]:
    return (lambda v: v > low, f"more than {low:g}") if open_ else (lambda v: v >= low, f"{low:g} or more")


# Ranges of TRL fields that TRL, transformers, torch or the generation engine check only on the ranks, for the values
# `trainer.extra_args` may set (and the same sampling names inside `generation_kwargs`).
TRL_RANGES: dict[str, tuple[Callable[[float], bool], str]] = {
    "top_p": (lambda v: 0 < v <= 1, "more than 0 and at most 1"),
    "min_p": (lambda v: 0 <= v <= 1, "from 0 to 1"),
    "top_k": (lambda v: v >= 0, "0 (no top-k filter) or more"),
    "top_entropy_quantile": (lambda v: 0 <= v <= 1, "from 0 to 1"),
    "adam_beta1": (lambda v: 0 <= v < 1, "from 0 to below 1"),
    "adam_beta2": (lambda v: 0 <= v < 1, "from 0 to below 1"),
    "repetition_penalty": _at_least(0, open_=True),
    "temperature": _at_least(0, open_=True),
    "delta": _at_least(0, open_=True),
    "num_train_epochs": _at_least(0, open_=True),
    "vllm_importance_sampling_cap": _at_least(0, open_=True),
    **dict.fromkeys(("num_iterations", "steps_per_generation", "generation_batch_size", "max_tokens"), _at_least(1)),
    **dict.fromkeys(
        ("epsilon", "epsilon_high", "warmup_steps", "weight_decay", "max_grad_norm", "adam_epsilon"), _at_least(0)
    ),
    "dataloader_num_workers": _at_least(0),
}
# Fields TRL's config reads as a mapping also when given as text: the text must then be a JSON object.
JSON_TEXT_FIELDS = {"generation_kwargs", "chat_template_kwargs", "lr_scheduler_kwargs", "gradient_checkpointing_kwargs"}


def _range_problem(path: str, key: str, value: Any, whose: str) -> str | None:
    """The line for a number outside TRL_RANGES[key] (`whose`: what reads it), or None."""
    if key not in TRL_RANGES or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    within, wanted = TRL_RANGES[key]
    return None if within(value) else f"{path}: {whose} takes {wanted} here, got {value!r}; fix the value"


def _mapping_problems(path: str, key: str, value: Any, config_name: str) -> list[str]:
    """A JSON_TEXT_FIELDS value given as text must be a JSON object; `generation_kwargs` names the engine's sampling
    options: their ranges, and not `n` (one completion per prompt: the group comes from trainer.num_generations)."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.lstrip().startswith("{") else None
        except ValueError:
            value = None
        if not isinstance(value, dict):
            return [f"{path}: TRL's {config_name} reads text here only as a JSON object ('{{...}}'); write a mapping"]
    if key != "generation_kwargs" or not isinstance(value, dict):
        return []
    problems = []
    for name, item in value.items():
        if name == "n":
            problems.append(
                f"{path}.n: each prompt gets one completion per sample (the group size is trainer.num_generations); "
                "remove it and set trainer.num_generations"
            )
        elif name in TRL_RANGES and (isinstance(item, bool) or not isinstance(item, (int, float))):
            problems.append(f"{path}.{name}: the sampling takes a number here, got {item!r}; fix the value")
        else:
            problems.append(_range_problem(f"{path}.{name}", str(name), item, "the sampling"))
    return [p for p in problems if p]


def _value_kind(value: Any) -> str:
    if value is None:
        return "null"
    for kind, types in (("bool", bool), ("int", int), ("float", float), ("str", str), ("list", list), ("dict", dict)):
        if isinstance(value, types):
            return kind
    return "any"


def _check_trl_value(path: str, value: Any, spec: dict[str, list], config_name: str) -> str | None:
    """Why TRL would refuse `value` for a field of kinds and choices `spec`, as one line, or None."""
    kinds, choices = set(spec["kinds"]), spec.get("choices")
    kind = _value_kind(value)
    accepted = "any" in kinds or kind in kinds or (kind == "int" and "float" in kinds)
    if accepted and not (kind == "str" and choices and value not in choices):
        return None
    wanted = [f"'{c}'" for c in choices] if choices and "str" in kinds else []
    wanted += [KIND_NAMES[k] for k in sorted(kinds) if k != "str" or not wanted]
    hint = ""
    if kind == "str" and choices and value not in choices:
        hint = did_you_mean(value, choices)
    elif kind == "str" and kinds & {"int", "float"}:
        try:
            float(value)
        except ValueError:
            pass
        else:
            exponent = "e" in value.lower() and "float" in kinds
            hint = (
                f"YAML reads {value} as text: write it with a decimal point and a signed exponent, such as 1.0e-8"
                if exponent
                else "remove the quotes"
            )
    elif kind == "float" and "int" in kinds:
        hint = "write a whole number"
    shown = "a mapping" if kind == "dict" else "a list" if kind == "list" else repr(value)
    return (
        f"{path}: TRL's {config_name} takes {', '.join(wanted[:-1]) + ' or ' if len(wanted) > 1 else ''}{wanted[-1]} "
        f"here, got {shown}" + (f"; {hint}" if hint else "; fix the value")
    )


def check_extra_args(recipe: Recipe) -> list[str]:
    """Problems with `trainer.extra_args` and the algorithm: keys colocate-rl or the trainer section owns, keys that
    contradict the algorithm, names TRL does not have, values of the wrong kind for the pinned TRL; then what the
    algorithm needs from the rest of the recipe."""
    problems = []
    algorithm = algorithms.get(recipe.algorithm)
    known = trl_field_names(algorithm.trainer)
    value_kinds = trl_value_kinds(algorithm.trainer)
    owned = set(type(recipe.trainer).model_fields) - {"extra_args"}
    config_name = algorithm.config_name
    for key, value in recipe.trainer.extra_args.items():
        path = f"trainer.extra_args.{key}"
        conflict = algorithm.conflict(key, value)
        if key in owned:
            problems.append(f"{path}: set it as trainer.{key} instead")
        elif key in MANAGED_TRL_FIELDS:
            problems.append(f"{path}: colocate-rl sets this itself; use {MANAGED_TRL_FIELDS[key]}")
        elif key in EVALUATION_FIELDS:
            problems.append(
                f"{path}: TRL's own evaluation is not used; remove it and evaluate with the recipe's eval section "
                "(eval.every_steps, eval.num_samples, eval.temperature, eval.source)"
            )
        elif conflict:
            problems.append(conflict)
        elif key not in known:
            hint = did_you_mean(key, known) or f"see TRL's {config_name} for valid names"
            problems.append(f"{path}: not a field of TRL {config_name}; {hint}")
        elif key in value_kinds:
            problem = _check_trl_value(path, value, value_kinds[key], config_name)
            problem = problem or _range_problem(path, key, value, f"TRL's {config_name}")
            if problem:
                problems.append(problem)
            elif key in JSON_TEXT_FIELDS:
                problems += _mapping_problems(path, key, value, config_name)
    return problems + algorithm.problems(recipe)
