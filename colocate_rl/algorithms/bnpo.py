"""BNPO: TRL's batch-normalized variant of the GRPO loss."""

from colocate_rl.algorithms import Algorithm

ALGORITHM = Algorithm(
    name="bnpo",
    summary="Token losses averaged over the tokens of each local micro-batch (not of the whole step as `dapo` "
    "does), so the result depends slightly on the micro-batch size; with one completion per micro-batch it equals "
    "`loss_type: grpo`. A loss variant of TRL's, without a paper of its own.",
    paper="none: a loss aggregation of TRL's GRPOTrainer (`loss_type: bnpo`)",
    url="https://huggingface.co/docs/trl/grpo_trainer",
    trainer="grpo",
    preset={"loss_type": "bnpo"},  # TRL's GRPOConfig docs, loss_type "bnpo"
    defining=("loss_type",),
)
