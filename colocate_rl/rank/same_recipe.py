"""On every rank of a multi-node run, once the process group is up: all nodes must run the same recipe."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from colocate_rl.errors import UserError
from colocate_rl.plan.identity import NODE_RANK_ENV, RECIPE_HASH_ENV, mismatch_message
from colocate_rl.rundir import RunDir


def check_same_recipe(run_dir: Path, recipe_hash: str) -> None:
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
        path = RunDir(Path(run_dir)).identity(node)
        try:
            identity = json.loads(path.read_text()).get("identity")
        except (OSError, ValueError):
            identity = None
    mine = {
        "node_rank": node,
        "host": socket.gethostname(),
        "hash": expected,
        "file_hash": recipe_hash,
        "identity": identity,
    }
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    message = mismatch_message(gathered)
    if message:
        dist.destroy_process_group()  # every rank stops here; leave the group so the exit is clean (code 2)
        raise UserError(message)
