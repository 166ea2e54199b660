"""Reward models in the memory estimate: their sizes (`colocate_rl.memory.shapes`) and what each rank holds of them.
TRL loads a reward model on every rank in the policy's dtype and prepares it with the run's DeepSpeed config, so it
is sharded under ZeRO-3 and on CPU with ZeRO-3's parameter offload; it stays there through every phase."""

from __future__ import annotations

from typing import TYPE_CHECKING

from colocate_rl.memory.shapes import reward_model_params
from colocate_rl.plan.deepspeed import ZeroLayout

if TYPE_CHECKING:
    from colocate_rl.plan.resolved import Resolved


def reward_model_sizes(resolved: Resolved) -> list[tuple[str, str, int]]:
    """(recipe key, model, parameters) of each reward model; UserError when one has no known layout."""
    return [
        (
            f"rewards[{i}].model",
            r.model,
            reward_model_params(r.model, f"rewards[{i}].model", resolved.preflight.reward_model_configs.get(r.model)),
        )
        for i, r in enumerate(resolved.recipe.rewards)
        if r.model is not None
    ]


def reward_model_bytes(resolved: Resolved, param_bytes: int, zero: ZeroLayout) -> float:
    """Bytes of reward-model weights one rank's GPU holds, at `param_bytes` per parameter (the trainer's weights')."""
    params = sum(size for _, _, size in reward_model_sizes(resolved))
    if zero.stage == 3:
        return 0 if zero.offload_params else param_bytes * params / resolved.world_size
    return param_bytes * params


def reward_model_notes(resolved: Resolved) -> list[str]:
    """One line per reward model for the estimate's notes."""
    return [f"{key} {name}: {size:,} parameters on every rank" for key, name, size in reward_model_sizes(resolved)]
