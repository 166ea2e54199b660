"""LUSPO: GSPO with each sequence's loss scaled by its length."""

from colocate_rl.algorithms import Algorithm

ALGORITHM = Algorithm(
    name="luspo",
    summary="GSPO's sequence-level ratio with each completion's loss multiplied by its length, which removes "
    "GSPO's bias towards short completions.",
    paper="Length-Unbiased Sequence Policy Optimization: Revealing and Controlling Response Length Variation in RLVR",
    url="https://arxiv.org/abs/2602.05261",
    trainer="grpo",
    preset={
        "loss_type": "luspo",  # TRL's GRPOConfig docs, loss_type "luspo"
        "importance_sampling_level": "sequence",  # TRL's GRPOConfig docs: luspo requires the sequence level
        # the clip range stays TRL's default (epsilon 0.2): TRL's docs give no other for LUSPO
    },
    defining=("loss_type", "importance_sampling_level"),
)
