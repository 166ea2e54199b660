"""The recipe identity every node of a run must share: the resolved recipe (auto values replaced by what they
resolved to, the DeepSpeed JSON by its content) without the node rank and the run dir, as dotted key → value, and
its hash. `mismatch_message` explains what differs between the nodes (`colocate_rl.rank.same_recipe` gathers it on
the ranks). Torch-free."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from colocate_rl.plan.resolved import Resolved

# Environment every rank of a multi-node run gets from its node's launcher.
RECIPE_HASH_ENV = "COLOCATE_RL_RECIPE_HASH"
NODE_RANK_ENV = "COLOCATE_RL_NODE_RANK"


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


def recipe_identity(resolved: Resolved) -> dict[str, Any]:
    """What every node must agree on, as dotted key → value: the resolved recipe (auto values replaced by
    what they resolved to, the DeepSpeed JSON by its content) without the node rank, the run dir and the rewards'
    processes."""
    data = resolved.recorded_recipe().model_dump(mode="json")
    data["distributed"].pop("node_rank")
    data["output"].pop("run_dir")
    for reward in data["rewards"]:
        reward.pop("processes")  # the node's CPU cores decide it (auto); scores are the same on any number
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
