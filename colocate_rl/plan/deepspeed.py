"""The DeepSpeed JSON of a run: a shipped config or a user file, with the recipe's overrides merged in.

Fails (UserError naming `distributed.*`) on a missing/unreadable file, invalid JSON, or settings that
contradict the recipe (e.g. bf16 hard-coded on in the JSON while the trainer runs in fp32).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from colocate_rl.errors import UserError, did_you_mean
from colocate_rl.recipe.shipped import shipped_deepspeed_configs

# The configuration keys of the pinned DeepSpeed (0.19; tests/test_bad_inputs.py checks them against the installed
# one). DeepSpeed reads its top level key by key and so silently ignores a misspelt key there; it refuses an unknown
# key of `zero_optimization` and its offload blocks, but only once the ranks start.
DEEPSPEED_KEYS = frozenset(
    {
        "activation_checkpointing", "aio", "autotuning", "bf16", "bfloat16", "checkpoint", "comet", "comms_logger",
        "communication_data_type", "compile", "csv_monitor", "data_efficiency", "data_types", "dataloader_drop_last",
        "datastates_ckpt", "disable_allgather", "disable_python_gc", "dump_state", "expert_parallel",
        "flops_profiler", "fp16", "gradient_accumulation_steps", "gradient_allreduce_op", "gradient_clipping",
        "gradient_predivide_factor", "hybrid_engine", "log_level", "managed_gradient_accumulation",
        "memory_breakdown", "optimizer", "pipeline", "prescale_gradients", "scheduler",
        "seq_parallel_communication_data_type", "steps_per_print", "tensor_parallel", "tensorboard", "timers",
        "torch_autocast", "train_batch_size", "train_micro_batch_size_per_gpu", "use_data_before_expert_parallelism",
        "vocabulary_size", "wall_clock_breakdown", "wandb", "weight_quantization", "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer", "zero_optimization",
    }
)  # fmt: skip
# Top-level keys whose value is a section (a mapping), as DeepSpeed and colocate-rl read them.
DEEPSPEED_SECTIONS = frozenset({"bf16", "fp16", "bfloat16", "zero_optimization", "optimizer", "scheduler"})
# Removed in DeepSpeed 0.19, which refuses them.
DEEPSPEED_REMOVED_KEYS = frozenset(
    {
        "amp", "compression_training", "curriculum_learning", "eigenvalue", "elasticity", "graph_harvesting",
        "nebula", "progressive_layer_drop", "quantize_training", "sparse_attention", "sparse_gradients",
    }
)  # fmt: skip
ZERO_KEYS = frozenset(
    {
        "allgather_bucket_size", "allgather_partitions", "compute_grad_norm", "contiguous_gradients", "cpu_offload",
        "cpu_offload_param", "cpu_offload_use_pin_memory", "elastic_checkpoint", "enable_sanity_checks",
        "ignore_unused_parameters", "leaf_module", "legacy_stage1", "load_from_fp32_weights",
        "log_trace_cache_warnings", "memory_efficient_linear", "offload_optimizer", "offload_param", "overlap_comm",
        "override_module_apply", "parameter_alignment", "pipeline_loading_checkpoint", "reduce_bucket_size",
        "reduce_scatter", "round_robin_gradients", "save_muon_momentum_buffer_in_memory", "stage",
        "stage3_gather_fp16_weights_on_model_save", "sub_group_size", "use_multi_rank_bucket_allreduce", "zenflow",
        "zero_hpz_partition_size", "zero_quantized_gradients", "zero_quantized_nontrainable_weights",
        "zero_quantized_weights",
        # fields DeepSpeed also takes under their stage3_ names
        "allgather_sequential", "stage3_allgather_sequential", "gather_16bit_weights_on_model_save",
        "stage3_gather_16bit_weights_on_model_save", "max_live_parameters", "stage3_max_live_parameters",
        "max_reuse_distance", "stage3_max_reuse_distance", "model_persistence_threshold",
        "stage3_model_persistence_threshold", "module_granularity_threshold", "stage3_module_granularity_threshold",
        "param_persistence_threshold", "stage3_param_persistence_threshold", "prefetch_bucket_size",
        "stage3_prefetch_bucket_size", "use_all_reduce_for_fetch_params", "stage3_use_all_reduce_for_fetch_params",
    }
)  # fmt: skip
ZERO_REMOVED_KEYS = frozenset({"mics_shard_size", "mics_hierarchical_params_gather", "zeropp_loco_param"})
OFFLOAD_KEYS = {
    "offload_optimizer": frozenset(
        {
            "buffer_count", "cpuadam_cores_perc", "device", "fast_init", "nvme_path", "pin_memory", "pipeline_read",
            "pipeline_write", "ratio", "super_offload",
        }
    ),
    "offload_param": frozenset({"buffer_count", "buffer_size", "device", "max_in_cpu", "nvme_path", "pin_memory"}),
}  # fmt: skip


def _whole(v: Any) -> bool:  # JSON configs often write 1e9 for a count: a whole float counts
    return not isinstance(v, bool) and (isinstance(v, int) or (isinstance(v, float) and v.is_integer()))


def _number(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float))


# The forms a DeepSpeed value takes: (how a message says it, the test).
_FORMS: dict[str, tuple[str, Any]] = {
    "bool": ("true/false", lambda v: isinstance(v, bool)),
    "null": ("null", lambda v: v is None),
    "auto": ('"auto"', lambda v: v == "auto"),
    "text": ("text", lambda v: isinstance(v, str)),
    "int": ("a whole number", _whole),
    "int>=0": ("a whole number of 0 or more", lambda v: _whole(v) and v >= 0),
    "int>0": ("a whole number above 0", lambda v: _whole(v) and v > 0),
    "num>=0": ("a number of 0 or more", lambda v: _number(v) and v >= 0),
    "num>0": ("a number above 0", lambda v: _number(v) and v > 0),
    "0..1": ("a number from 0 to 1", lambda v: _number(v) and 0 <= v <= 1),
    "stage": ("0, 1, 2 or 3", lambda v: _whole(v) and v in (0, 1, 2, 3)),
    "device": ('"cpu", "nvme" or "none"', lambda v: v in ("cpu", "nvme", "none")),
}
_ZERO_BOOLS = (
    "contiguous_gradients reduce_scatter use_multi_rank_bucket_allreduce allgather_partitions compute_grad_norm "
    "load_from_fp32_weights elastic_checkpoint gather_16bit_weights_on_model_save stage3_gather_16bit_weights_on_model_save "
    "use_all_reduce_for_fetch_params stage3_use_all_reduce_for_fetch_params allgather_sequential "
    "stage3_allgather_sequential stage3_gather_fp16_weights_on_model_save ignore_unused_parameters legacy_stage1 "
    "round_robin_gradients parameter_alignment zero_quantized_weights zero_quantized_nontrainable_weights "
    "zero_quantized_gradients memory_efficient_linear pipeline_loading_checkpoint override_module_apply "
    "log_trace_cache_warnings enable_sanity_checks save_muon_momentum_buffer_in_memory"
).split()
_ZERO_COUNTS = (
    "allgather_bucket_size sub_group_size zero_hpz_partition_size prefetch_bucket_size stage3_prefetch_bucket_size "
    "param_persistence_threshold stage3_param_persistence_threshold model_persistence_threshold "
    "stage3_model_persistence_threshold max_live_parameters stage3_max_live_parameters max_reuse_distance "
    "stage3_max_reuse_distance"
).split()
_OFFLOAD = {"device": "device", "nvme_path": "text|null", "buffer_count": "int>=0", "pin_memory": "bool"}
# Value forms of the keys DeepSpeed (and transformers, for "auto") checks only on the ranks. Those of
# `zero_optimization` and its offload blocks are the fields of DeepSpeed's pydantic models (tests/test_bad_inputs.py
# checks them against the installed DeepSpeed), which take "auto" for their default; the top level is read key by key.
DEEPSPEED_VALUES: dict[str, str] = {
    **dict.fromkeys(
        ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"), "int>0|auto"
    ),
    "gradient_clipping": "num>=0|auto",
    "steps_per_print": "int>0",
    "gradient_predivide_factor": "num>0",
    **dict.fromkeys(
        ("wall_clock_breakdown", "memory_breakdown", "prescale_gradients", "zero_allow_untested_optimizer"), "bool"
    ),
    **{f"{p}.enabled": "bool|auto" for p in ("bf16", "fp16")},
    **{f"fp16.{k}": "int>=0" for k in ("initial_scale_power", "loss_scale_window", "hysteresis")},
    "fp16.loss_scale": "num>=0",
    "zero_optimization.stage": "stage|auto",
    "zero_optimization.reduce_bucket_size": "int>0|auto",
    "zero_optimization.module_granularity_threshold": "int|auto",
    "zero_optimization.stage3_module_granularity_threshold": "int|auto",
    **{f"zero_optimization.{k}": "bool|null|auto" for k in ("overlap_comm", "cpu_offload", "cpu_offload_param")},
    "zero_optimization.cpu_offload_use_pin_memory": "bool|null|auto",
    **{f"zero_optimization.{k}": "bool|auto" for k in _ZERO_BOOLS},
    **{f"zero_optimization.{k}": "int>=0|auto" for k in _ZERO_COUNTS},
    **{f"zero_optimization.offload_param.{k}": f"{v}|auto" for k, v in _OFFLOAD.items()},
    **{f"zero_optimization.offload_param.{k}": "int>=0|auto" for k in ("buffer_size", "max_in_cpu")},
    **{f"zero_optimization.offload_optimizer.{k}": f"{v}|auto" for k, v in _OFFLOAD.items()},
    **{
        f"zero_optimization.offload_optimizer.{k}": "bool|auto"
        for k in ("pipeline_read", "pipeline_write", "fast_init", "super_offload")
    },
    **{f"zero_optimization.offload_optimizer.{k}": "0..1|auto" for k in ("ratio", "cpuadam_cores_perc")},
}


def _value_problems(config: dict[str, Any], name) -> list[str]:
    """One line per DEEPSPEED_VALUES key of `config` whose value has none of its forms (`name` words the key)."""
    problems = []
    for path, spec in DEEPSPEED_VALUES.items():
        *sections, key = path.split(".")
        section: Any = config
        for part in sections:
            section = section.get(part) if isinstance(section, dict) else None
        if not isinstance(section, dict) or key not in section:
            continue
        value, forms = section[key], spec.split("|")
        if not any(_FORMS[form][1](value) for form in forms):
            wanted = [_FORMS[form][0] for form in forms]
            text = ", ".join(wanted[:-1]) + ", or " + wanted[-1] if len(wanted) > 1 else wanted[0]
            problems.append(f"{name(path)}: DeepSpeed takes {text} here, got {value!r}; fix the value")
    return problems


def check_deepspeed_keys(config: Any, where: str, file: bool = False) -> list[str]:
    """One line per key of a DeepSpeed config (or of overrides merged into one) that DeepSpeed does not know, at
    the top level, in `zero_optimization` and in its offload blocks, per section that is not a mapping, and per value
    of the wrong kind or range (`DEEPSPEED_VALUES`). `where`
    names the config: the recipe key `distributed.deepspeed_overrides`, or the JSON file (`file`)."""
    if not isinstance(config, dict):
        return [f"{where}: must be a mapping of DeepSpeed config keys, got {config!r}"]
    docs = "see https://www.deepspeed.ai/docs/config-json/"

    def name(path: str) -> str:  # `distributed.deepspeed_overrides.zero_optimization.stage`, `ds.json: bf16`
        return f"{where}: {path}" if file else f"{where}.{path}"

    def unknown(path: str, key: str, known: frozenset, removed: frozenset = frozenset()) -> str | None:
        if key in removed:
            return f"{name(path + str(key))}: removed in DeepSpeed 0.19, which refuses it; remove it"
        if key not in known:
            return f"{name(path + str(key))}: not a DeepSpeed config key; {did_you_mean(str(key), known) or docs}"
        return None

    problems = [unknown("", key, DEEPSPEED_KEYS, DEEPSPEED_REMOVED_KEYS) for key in config]
    for key in DEEPSPEED_SECTIONS & set(config):
        if config[key] is not None and not isinstance(config[key], dict):
            problems.append(f"{name(key)}: must be a mapping (a DeepSpeed config section), got {config[key]!r}")
    zero = config.get("zero_optimization")
    if isinstance(zero, dict):
        problems += [unknown("zero_optimization.", key, ZERO_KEYS, ZERO_REMOVED_KEYS) for key in zero]
        for block, known in OFFLOAD_KEYS.items():
            value = zero.get(block)
            if isinstance(value, dict):
                problems += [unknown(f"zero_optimization.{block}.", key, known) for key in value]
            elif value is not None:
                problems.append(f"{name('zero_optimization.' + block)}: must be a mapping or null, got {value!r}")
    return [p for p in problems if p] + _value_problems(config, name)


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """A copy of `base` with `override` merged in, recursively for nested mappings."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


AUTO_BASE_CONFIG = (
    "zero3"  # the shipped DeepSpeed JSON `zero_stage: auto` starts from when distributed.deepspeed is null
)


@dataclass(frozen=True)
class ZeroLayout:
    """The one reader of a DeepSpeed config's ZeRO settings. An `offload_*` block counts as offloaded when its
    `device` is set and not "none"; DeepSpeed's own default for a block without `device` is "none"."""

    stage: int | None  # None: no DeepSpeed config (DDP or one process)
    offload_optimizer: bool
    offload_params: bool
    section: dict[str, Any]  # the `zero_optimization` mapping ({} without one)

    @classmethod
    def of(cls, config: dict[str, Any] | None) -> ZeroLayout:
        zero = (config or {}).get("zero_optimization") or {}

        def offloaded(key: str) -> bool:
            return (zero.get(key) or {}).get("device", "none") not in ("none", None)

        stage = zero.get("stage", 0) if config is not None else None
        return cls(stage, offloaded("offload_optimizer"), offloaded("offload_param"), zero)


def load_base_config(spec: str) -> dict[str, Any]:
    """Read a shipped config by name or a JSON file by path."""
    shipped = shipped_deepspeed_configs()
    path = shipped.get(spec) or Path(spec).expanduser()
    names = ", ".join(shipped)
    if not path.is_file():
        raise UserError(f"distributed.deepspeed: '{spec}' is neither a shipped config ({names}) nor a JSON file")
    from colocate_rl.recipe.load import read_text_file

    try:
        config = json.loads(read_text_file(path, "DeepSpeed config"))
    except json.JSONDecodeError as e:
        raise UserError(f"{path}:{e.lineno}:{e.colno}: invalid JSON in the DeepSpeed config: {e.msg}")
    if not isinstance(config, dict):
        raise UserError(f"{path}: a DeepSpeed config must be a JSON object")
    return config


def build_deepspeed_config(
    spec: str,
    *,
    precision: str,
    zero_stage: int | None = None,
    offload_optimizer: bool | None = None,
    offload_params: bool | None = None,
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The run's DeepSpeed config. `precision` is the trainer's (`bf16`, `fp16` or `no`) and must agree. Every key
    of the base config and of `overrides` must be one DeepSpeed knows (`check_deepspeed_keys`)."""
    config = load_base_config(spec)
    shipped = shipped_deepspeed_configs()
    problems = check_deepspeed_keys(config, str(shipped.get(spec) or Path(spec).expanduser()), file=True)
    problems += check_deepspeed_keys(overrides or {}, "distributed.deepspeed_overrides")
    if problems:
        raise UserError(*problems)
    zero = config.setdefault("zero_optimization", {})
    if zero_stage is not None:
        zero["stage"] = zero_stage
    if offload_optimizer is not None:
        if offload_optimizer:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        else:
            zero.pop("offload_optimizer", None)
    if offload_params is not None:
        if offload_params:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
        else:
            zero.pop("offload_param", None)
    config = deep_merge(config, overrides or {})

    problems = []
    zero = ZeroLayout.of(config)
    if zero.offload_params and zero.stage != 3:
        problems.append(
            f"distributed.offload_params: parameter offload needs ZeRO stage 3 (stage is {zero.stage}); "
            "set distributed.zero_stage: 3 or offload_params: false"
        )
    for name in ("bf16", "fp16"):
        enabled = (config.get(name) or {}).get("enabled", False)
        wanted = precision == name
        if enabled == "auto":
            config[name]["enabled"] = wanted
        elif bool(enabled) != wanted:
            problems.append(
                f"distributed.mixed_precision: the DeepSpeed config has {name}.enabled={str(enabled).lower()} "
                f"but the trainer runs with mixed_precision '{precision}'; set {name}.enabled to \"auto\" in the "
                "JSON (or in distributed.deepspeed_overrides) or change distributed.mixed_precision"
            )
    if problems:
        raise UserError(*problems)
    return config
