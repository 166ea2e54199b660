"""Slurm: inside an `srun` step of several nodes, the node count, this node's rank and the rendezvous come from
Slurm's environment (the first host of the node list, `SLURM_NODEID`, the job id). Torch-free."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from colocate_rl.errors import UserError

DEFAULT_PORT = 29500
# Slurm step ids at or above this are the batch script, extern and interactive steps, not an `srun` step.
_SLURM_SPECIAL_STEP = 4294967290


def expand_hostlist(text: str) -> list[str]:
    """Expand a Slurm host list (`node[01-03,07],gpu5`, `rack[1-2]-n[1-2]`) into host names, in order.
    Zero padding follows the range's first number, as Slurm writes it. Raises ValueError on bad syntax."""
    hosts: list[str] = []
    for item in _split_top_level(text.strip()):
        if item:
            hosts.extend(_expand_one(item))
    if not hosts:
        raise ValueError("empty host list")
    return hosts


def _split_top_level(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in {text!r}")
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    if depth:
        raise ValueError(f"unbalanced '[' in {text!r}")
    return parts + [current]


def _expand_one(item: str) -> list[str]:
    match = re.search(r"\[([^\[\]]*)\]", item)
    if match is None:
        if "]" in item:
            raise ValueError(f"unbalanced ']' in {item!r}")
        return [item]
    head, tail = item[: match.start()], item[match.end() :]
    values: list[str] = []
    for spec in match.group(1).split(","):
        lo, sep, hi = spec.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad range {spec!r} in {item!r}")
        if not sep:
            values.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"descending range {spec!r} in {item!r}")
        values.extend(str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1))
    return [host for value in values for host in _expand_one(head + value + tail)]


@dataclass(frozen=True)
class Setting:
    """One `distributed.<key>` value and where it came from (shown by `train --dry-run`)."""

    key: str
    value: Any
    source: str


def in_slurm_step(env: Mapping[str, str]) -> bool:
    """True inside an `srun` job step (not in the batch script itself, nor on a login node)."""
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", ""))
    return "SLURM_JOB_ID" in env and step.isdigit() and int(step) < _SLURM_SPECIAL_STEP


def _int_env(env: Mapping[str, str], name: str) -> int:
    raw = env[name]
    if not raw.strip().isdigit():
        raise UserError(
            f"{name}: expected a whole number from Slurm, got {raw!r}; run under srun, or pass "
            "--nnodes/--node-rank/--rdzv-endpoint/--rdzv-id yourself"
        )
    return int(raw)


def slurm_settings(env: Mapping[str, str]) -> list[Setting]:
    """The node keys Slurm's environment gives, inside an `srun` step of more than one node; else []."""
    if not in_slurm_step(env):
        return []
    nodes_var = next((v for v in ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES") if v in env), None)
    list_var = next((v for v in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST") if v in env), None)
    if nodes_var is None or list_var is None or "SLURM_NODEID" not in env:
        return []
    nnodes = _int_env(env, nodes_var)
    if nnodes <= 1:
        return []
    tasks_var = next((v for v in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS") if v in env), None)
    if tasks_var is not None and _int_env(env, tasks_var) > nnodes:
        raise UserError(
            f"{tasks_var}: srun started {env[tasks_var]} tasks on {nnodes} nodes, but colocate-rl needs "
            "one task per node (torchrun starts the ranks); use srun --ntasks-per-node=1 "
            "(see scripts/slurm.sbatch)"
        )
    try:
        hosts = expand_hostlist(env[list_var])
    except ValueError as e:
        raise UserError(
            f"{list_var}: cannot read the Slurm node list {env[list_var]!r} ({e}); pass "
            "--rdzv-endpoint HOST:PORT yourself"
        )
    port, port_source = DEFAULT_PORT, f"default port {DEFAULT_PORT}"
    if env.get("MASTER_PORT", "").strip():
        port, port_source = _int_env(env, "MASTER_PORT"), "MASTER_PORT"
    return [
        Setting("nnodes", nnodes, f"Slurm {nodes_var}"),
        Setting("node_rank", _int_env(env, "SLURM_NODEID"), "Slurm SLURM_NODEID"),
        Setting("rdzv_endpoint", f"{hosts[0]}:{port}", f"Slurm first host of {list_var}, {port_source}"),
        Setting("rdzv_id", str(env["SLURM_JOB_ID"]), "Slurm SLURM_JOB_ID"),
    ]


def slurm_note(env: Mapping[str, str], nnodes: int = 1, nnodes_source: str = "default") -> str | None:
    """A hint when `train` runs one node inside a multi-node Slurm job but outside `srun` (it then uses this node
    only), unless the user asked for the node count (`--nnodes`, `--set`)."""
    if nnodes != 1 or nnodes_source not in ("default", "recipe"):
        return None
    nodes = env.get("SLURM_NNODES", env.get("SLURM_JOB_NUM_NODES", ""))
    if "SLURM_JOB_ID" in env and not in_slurm_step(env) and nodes.isdigit() and int(nodes) > 1:
        return (
            f"inside Slurm job {env['SLURM_JOB_ID']} of {nodes} nodes but not under srun: this node trains alone; "
            "start it as `srun --ntasks-per-node=1 colocate-rl train ...` (scripts/slurm.sbatch) to use all nodes"
        )
    return None
