"""DAPO: decoupled clip range, token-level loss, truncated completions left out of the loss."""

from colocate_rl.algorithms import Algorithm


def _no_kl(recipe) -> list[str]:
    if recipe.trainer.beta == 0:
        return []
    return [
        f"trainer.beta: algorithm dapo trains without the KL term (DAPO paper, section 2.3), got {recipe.trainer.beta}; "
        "set trainer.beta: 0, or choose algorithm: grpo to keep a KL term"
    ]


ALGORITHM = Algorithm(
    name="dapo",
    summary="Clip-higher (ratios clipped to [0.8, 1.28]), token losses averaged over the whole batch, completions "
    "cut at max_completion_length left out of the loss, no KL term (`trainer.beta` must be 0). The paper's dynamic "
    "sampling is not in TRL.",
    paper="DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
    url="https://arxiv.org/abs/2503.14476",
    trainer="grpo",
    preset={
        "loss_type": "dapo",  # token-level loss (TRL's paper index, DAPO)
        "epsilon": 0.2,  # ε_low (DAPO section 4.1, via TRL's paper index)
        "epsilon_high": 0.28,  # clip-higher ε_high (DAPO section 4.1, via TRL's paper index)
        "mask_truncated_completions": True,  # overlong filtering (TRL's paper index, DAPO)
    },
    defining=("loss_type",),
    checks=(_no_kl,),
)
