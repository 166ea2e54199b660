"""GRPO: TRL's GRPOTrainer as it ships (the default algorithm)."""

from colocate_rl.algorithms import Algorithm

ALGORITHM = Algorithm(
    name="grpo",
    summary="TRL's GRPOTrainer with its own defaults: advantages normalized within each prompt's group, token "
    "ratios clipped to 1 ± 0.2, and TRL 1.16's default loss aggregation `loss_type: dapo` (token losses averaged "
    "over the whole batch); `trainer.extra_args` may change any of them.",
    paper="DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models",
    url="https://arxiv.org/abs/2402.03300",
    trainer="grpo",
    # no preset: TRL's GRPOConfig defaults (grpo_config.py: loss_type "dapo", epsilon 0.2, scale_rewards "group"),
    # as colocate-rl has always run `grpo`
)
