"""Where the `distributed.*` node keys come from: defaults < recipe < Slurm environment < overrides (`--set`) and
the `train` flags (`--nnodes`, `--node-rank`, `--rdzv-endpoint`, `--rdzv-id`). `layer_distributed` applies the
layers and records each node key's source, which `train --dry-run` prints and error lines name. Torch-free."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from colocate_rl.errors import UserError
from colocate_rl.plan.slurm import slurm_settings
from colocate_rl.recipe.load import apply_overrides

NODE_KEYS = ("nnodes", "node_rank", "rdzv_backend", "rdzv_endpoint", "rdzv_id")
FLAGS = {"nnodes": "--nnodes", "node_rank": "--node-rank", "rdzv_endpoint": "--rdzv-endpoint", "rdzv_id": "--rdzv-id"}


def _put(data: dict[str, Any], key: str, value: Any) -> None:
    section = data.setdefault("distributed", {})
    if section is None:
        section = data["distributed"] = {}
    if isinstance(section, dict):  # a non-mapping is reported by the schema
        section[key] = value


def parse_node_flags(
    nnodes: str | None, node_rank: str | None, rdzv_endpoint: str | None, rdzv_id: str | None
) -> dict[str, Any]:
    """The `train` flags as `distributed.*` values (only those given). Fails (UserError) on a bad value."""
    out: dict[str, Any] = {}
    for key, raw, low in (("nnodes", nnodes, 1), ("node_rank", node_rank, 0)):
        if raw is None:
            continue
        if not raw.strip().isdigit() or int(raw) < low:
            raise UserError(f"{FLAGS[key]}: expected a whole number ≥ {low}, got {raw!r}")
        out[key] = int(raw)
    if rdzv_endpoint is not None:
        out["rdzv_endpoint"] = rdzv_endpoint
    if rdzv_id is not None:
        if not rdzv_id.strip():
            raise UserError("--rdzv-id: must not be empty; give the same id on every node of the job")
        out["rdzv_id"] = rdzv_id
    return out


def layer_distributed(
    data: dict[str, Any], overrides: Mapping[str, Any], flags: Mapping[str, Any], env: Mapping[str, str]
) -> tuple[dict[str, Any], dict[str, str]]:
    """Recipe mapping → (mapping with the Slurm, override and flag layers applied, source of each node key)."""
    section = data.get("distributed")
    sources = {k: "recipe" if isinstance(section, dict) and k in section else "default" for k in NODE_KEYS}
    flagged = set(flags)
    settings = slurm_settings(env)
    # A flag naming the node count (e.g. --nnodes 1 inside a Slurm job) takes over the whole node layout.
    if "nnodes" in flagged:
        settings = []
    result = copy.deepcopy(data)
    for setting in settings:
        _put(result, setting.key, setting.value)
        sources[setting.key] = setting.source
    result = apply_overrides(result, overrides)
    for key in overrides:
        for name in NODE_KEYS:
            if key in ("distributed", f"distributed.{name}"):
                sources[name] = f"--set {key}"
    for key, value in flags.items():
        _put(result, key, value)
        sources[key] = FLAGS[key]
    return result, sources


def explain_sources(lines: list[str], sources: Mapping[str, str]) -> list[str]:
    """Append where a node key came from to error lines about it (when not from the recipe or defaults)."""
    out = []
    for line in lines:
        for key in NODE_KEYS:
            if line.startswith(f"distributed.{key}:") and sources.get(key) not in (None, "recipe", "default"):
                line += f" (from {sources[key]})"
                break
        out.append(line)
    return out
