"""Several nodes: where nnodes / node rank / rendezvous come from, and the check that all nodes run one recipe.

Precedence of the `distributed.*` node keys is defaults < recipe < Slurm environment < `--set` and the
`train` flags (`--nnodes`, `--node-rank`, `--rdzv-endpoint`, `--rdzv-id`); `layer_distributed` applies
the layers and records where each value came from. Under `srun` (a Slurm job step of more than one node)
the node list gives the rendezvous host (its first node), `SLURM_NODEID` the node rank and the job id the
rendezvous id. Every node hashes its resolved recipe (minus node rank and run dir); the ranks compare the
hashes as soon as the process group is up (`check_same_recipe`) and all stop on a mismatch.

Nothing here imports torch at module level: the CLI imports this module.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from colocate_rl.errors import UserError

if TYPE_CHECKING:
    from colocate_rl.plan.resolve import Resolved

DEFAULT_PORT = 29500
NODE_KEYS = ("nnodes", "node_rank", "rdzv_backend", "rdzv_endpoint", "rdzv_id")
FLAGS = {"nnodes": "--nnodes", "node_rank": "--node-rank", "rdzv_endpoint": "--rdzv-endpoint", "rdzv_id": "--rdzv-id"}
# Environment every rank of a multi-node run gets from its node's launcher.
RECIPE_HASH_ENV = "COLOCATE_RL_RECIPE_HASH"
NODE_RANK_ENV = "COLOCATE_RL_NODE_RANK"
NODES_DIR = "nodes"  # <run_dir>/nodes/<node_rank>/: this node's launch.sh, train.log, recipe identity
IDENTITY_FILE = "recipe-identity.json"
# Slurm step ids at or above this are the batch script, extern and interactive steps, not an `srun` step.
_SLURM_SPECIAL_STEP = 4294967290


# ------------------------------------------------------------------------------------------- Slurm


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


def slurm_note(env: Mapping[str, str]) -> str | None:
    """A hint when `train` runs inside a multi-node Slurm job but outside `srun` (it then uses this node only)."""
    nodes = env.get("SLURM_NNODES", env.get("SLURM_JOB_NUM_NODES", ""))
    if "SLURM_JOB_ID" in env and not in_slurm_step(env) and nodes.isdigit() and int(nodes) > 1:
        return (
            f"inside Slurm job {env['SLURM_JOB_ID']} of {nodes} nodes but not under srun: this node trains alone; "
            "start it as `srun --ntasks-per-node=1 colocate-rl train ...` (scripts/slurm.sbatch) to use all nodes"
        )
    return None


# ------------------------------------------------------------------------------------------- layering


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
    data: dict[str, Any], sets: list[str], flags: Mapping[str, Any], env: Mapping[str, str]
) -> tuple[dict[str, Any], dict[str, str]]:
    """Recipe mapping → (mapping with Slurm, `--set` and flag layers applied, source of each node key)."""
    from colocate_rl.recipe.schema import apply_overrides

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
    result = apply_overrides(result, sets)
    for item in sets:
        key = item.partition("=")[0].strip()
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


# ------------------------------------------------------------------------------------------- recipe hash


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


def recipe_identity(resolved: Resolved) -> dict[str, Any]:
    """What every node must agree on, as dotted key → value: the resolved recipe (auto values replaced by
    what they resolved to, the DeepSpeed JSON by its content) without the node rank and the run dir."""
    data = resolved.recipe.model_dump(mode="json")
    data["distributed"].pop("node_rank")
    data["output"].pop("run_dir")
    data["distributed"]["nproc_per_node"] = resolved.nproc_per_node
    data["distributed"]["mixed_precision"] = resolved.precision
    data["generation"]["backend"] = resolved.backend
    data["model"]["dtype"] = resolved.model_dtype
    data["trainer"]["gradient_checkpointing"] = resolved.gradient_checkpointing
    data["device"] = resolved.device
    data["deepspeed_config"] = resolved.deepspeed
    return _flatten(data)


def identity_hash(identity: Mapping[str, Any]) -> str:
    text = json.dumps(identity, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _show(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def mismatch_message(entries: list[Mapping[str, Any]]) -> str | None:
    """Compare what the ranks report (`node_rank`, `host`, `hash`, `file_hash`, `identity`); None when all agree.

    `hash` is the recipe the rank's node was started with; `file_hash` the one the run directory's shared
    files (launch.json) were written for; `identity` (from one rank per node, may be None) the keys behind it.
    """
    nodes: dict[str, Mapping[str, Any]] = {}
    for entry in entries:
        label = str(entry.get("node_rank"))
        if label not in nodes or (nodes[label].get("identity") is None and entry.get("identity") is not None):
            nodes[label] = entry

    def name(label: str) -> str:
        host = nodes[label].get("host")
        return f"node {label}" + (f" ({host})" if host else "")

    def order(label: str):
        return (0, int(label)) if label.isdigit() else (1, label)

    by_hash: dict[str, list[str]] = {}
    for label in sorted(nodes, key=order):
        by_hash.setdefault(str(nodes[label].get("hash")), []).append(label)
    fix = "start every node with the same recipe file and the same --set flags"
    if len(by_hash) > 1:
        groups = sorted(by_hash.values(), key=lambda labels: order(labels[0]))
        ref = groups[0][0]
        parts = []
        for labels in groups[1:]:
            other = labels[0]
            mine, theirs = nodes[ref].get("identity"), nodes[other].get("identity")
            who = ", ".join(name(label) for label in labels)
            detail = ""
            if isinstance(mine, dict) and isinstance(theirs, dict):
                keys = [k for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k)]
                shown = [
                    f"{k} ({_show(mine.get(k))} on node {ref}, {_show(theirs.get(k))} on node {other})"
                    for k in keys[:4]
                ]
                if len(keys) > 4:
                    shown.append(f"{len(keys) - 4} more")
                detail = " in " + "; ".join(shown) if shown else ""
            parts.append(f"{who} differ{'s' if len(labels) == 1 else ''} from {name(ref)}{detail}")
        summary = ", ".join(
            f"node {', '.join(labels)}: {h}"
            for h, labels in sorted(by_hash.items(), key=lambda item: order(item[1][0]))
        )
        return (
            f"recipe mismatch between nodes: {'; '.join(parts)}; {fix} (`colocate-rl train RECIPE --dry-run` "
            f"prints each node's recipe hash; here {summary})"
        )
    stale = [
        label
        for label in sorted(nodes, key=order)
        if nodes[label].get("file_hash") not in (None, nodes[label].get("hash"))
    ]
    if stale:
        return (
            f"recipe mismatch: the run directory's recipe.yaml/launch.json that {', '.join(map(name, stale))} "
            "read were written for another recipe (an earlier run in the same run dir, or another node started "
            "with other settings); pass a new --run-dir on every node"
        )
    return None


def check_same_recipe(run_dir: Path, launch: Mapping[str, Any]) -> None:
    """On every rank of a multi-node run, once the process group is up: gather what each node was started
    with and raise UserError (on every rank) if the nodes disagree. A no-op for single-node runs."""
    expected = os.environ.get(RECIPE_HASH_ENV)
    if not expected:
        return
    import socket

    import torch.distributed as dist

    node = os.environ.get(NODE_RANK_ENV, "?")
    identity = None
    if os.environ.get("LOCAL_RANK", "0") == "0":
        path = Path(run_dir) / NODES_DIR / node / IDENTITY_FILE
        try:
            identity = json.loads(path.read_text()).get("identity")
        except (OSError, ValueError):
            identity = None
    mine = {
        "node_rank": node,
        "host": socket.gethostname(),
        "hash": expected,
        "file_hash": launch.get("recipe_hash"),
        "identity": identity,
    }
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    message = mismatch_message(gathered)
    if message:
        dist.destroy_process_group()  # every rank stops here; leave the group so the exit is clean (code 2)
        raise UserError(message)
