"""Dr. GRPO: GRPO without its length and standard-deviation normalizations."""

from colocate_rl.algorithms import Algorithm

ALGORITHM = Algorithm(
    name="dr_grpo",
    summary="GRPO without its two biases: token losses summed and divided by a constant (max_completion_length) "
    "instead of each completion's length, and advantages not divided by the group's reward standard deviation.",
    paper="Understanding R1-Zero-Like Training: A Critical Perspective",
    url="https://arxiv.org/abs/2503.20783",
    trainer="grpo",
    preset={
        "loss_type": "dr_grpo",  # a constant instead of each length (TRL's paper index, Dr. GRPO)
        "scale_rewards": "none",  # no division by the std (TRL's GRPOConfig docs, scale_rewards)
    },
    defining=("loss_type", "scale_rewards"),
)
