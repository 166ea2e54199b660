"""The memory estimate's training allowance: what H200 training peaks held beyond the estimate's other terms.

Fitted (least squares of the relative error) by benchmarks/fit_estimate.py to the training peaks it lists (0.135 to
1.7B parameters, micro-batches 16 to 256, ZeRO-2 and no DeepSpeed, vLLM awake and asleep): shares of the activations
(more without DeepSpeed: torch's autocast over fp32 weights), of the trainer gradients on the GPU (sharded as the
estimate shards them) and of LM-head tiles (TRL 1.16's fused LM head computes log-probabilities in fp32 tiles of
4,096 tokens). What each part stands for is not measured; beyond the rows' sizes it is extrapolated.
"""

from __future__ import annotations

LM_HEAD_TILE_TOKENS = 4096
ALLOWANCE = {
    "activations": 0.1096,
    "activations without DeepSpeed": 0.04112,
    "gradients": 3.037,
    "per LM-head tile": 0.1956,
}


def training_allowance(activations: float, gradients: float, vocab: int, deepspeed: bool) -> float:
    """Bytes beside one micro-batch's `activations` (bytes), given the trainer `gradients` on the GPU (bytes)."""
    c = ALLOWANCE
    share = c["activations"] + (0 if deepspeed else c["activations without DeepSpeed"])
    return activations * share + gradients * c["gradients"] + LM_HEAD_TILE_TOKENS * vocab * 4 * c["per LM-head tile"]
