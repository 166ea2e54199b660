"""SAPO: a smooth, temperature-controlled gate instead of hard clipping."""

from colocate_rl.algorithms import Algorithm

ALGORITHM = Algorithm(
    name="sapo",
    summary="Replaces the hard clip of the token ratio by a sigmoid gate with temperature 1.0 for positive and 1.05 "
    "for negative advantages, which shrinks off-policy updates smoothly; per-sequence loss.",
    paper="Soft Adaptive Policy Optimization",
    url="https://arxiv.org/abs/2511.20347",
    trainer="grpo",
    preset={
        "loss_type": "sapo",  # TRL's paper index, SAPO
        "sapo_temperature_pos": 1.0,  # TRL's paper index, SAPO (TRL's default)
        "sapo_temperature_neg": 1.05,  # TRL's paper index, SAPO (TRL's default)
    },
    defining=("loss_type",),
)
