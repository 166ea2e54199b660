"""CISPO: clip the importance-sampling weight, keep every token's gradient."""

from colocate_rl.algorithms import Algorithm

ALGORITHM = Algorithm(
    name="cispo",
    summary="Clips the (stop-gradient) importance-sampling weight at ε_max = 5 instead of clipping the update, so "
    "every token keeps a gradient; token losses averaged over the whole batch.",
    paper="MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention",
    url="https://arxiv.org/abs/2506.13585",
    trainer="grpo",
    preset={
        "loss_type": "cispo",  # TRL's GRPOConfig docs, loss_type "cispo"
        # ε_max: 5.0 is what the ScaleRL paper (arXiv 2510.13786) recommends, per TRL's GRPOConfig docs
        # (epsilon_high); TRL's own default would clip the weight at 1 + 0.2
        "epsilon_high": 5.0,
    },
    defining=("loss_type",),
)
