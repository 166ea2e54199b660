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

from colocate_rl.errors import UserError
from colocate_rl.recipe.shipped import shipped_deepspeed_configs


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
    try:
        config = json.loads(path.read_text())
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
    """The run's DeepSpeed config. `precision` is the trainer's (`bf16`, `fp16` or `no`) and must agree."""
    config = load_base_config(spec)
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
        enabled = config.get(name, {}).get("enabled", False)
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
