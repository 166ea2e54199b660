"""GSPO: one importance ratio per sequence instead of per token."""

from colocate_rl.algorithms import Algorithm

ALGORITHM = Algorithm(
    name="gspo",
    summary="One importance ratio per completion (the geometric mean of its token ratios), clipped to "
    "[1 - 3e-4, 1 + 4e-4], with GRPO's per-sequence loss. The ratio moves away from 1 only off-policy: the paper "
    "splits each generation into 4 optimizer steps (`extra_args: {steps_per_generation: 4}` with "
    "gradient_accumulation_steps 1); with one step per generation it is `loss_type: grpo`.",
    paper="Group Sequence Policy Optimization",
    url="https://arxiv.org/abs/2507.18071",
    trainer="grpo",
    preset={
        "importance_sampling_level": "sequence",  # TRL's paper index, GSPO
        "loss_type": "grpo",  # per-sequence loss, as TRL's paper index reproduces GSPO
        "epsilon": 3e-4,  # GSPO paper (v2), section 5.1, via TRL's paper index
        "epsilon_high": 4e-4,  # GSPO paper (v2), section 5.1, via TRL's paper index
    },
    defining=("importance_sampling_level", "loss_type"),
)
