"""RLOO: TRL's RLOOTrainer as it ships."""

from colocate_rl.algorithms import Algorithm

ALGORITHM = Algorithm(
    name="rloo",
    summary="TRL's RLOOTrainer: REINFORCE with each completion's baseline the mean reward of the other completions "
    "of its prompt (leave-one-out); `extra_args: {normalize_advantages: true}` also normalizes the advantages.",
    paper="Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human Feedback in LLMs",
    url="https://arxiv.org/abs/2402.14740",
    trainer="rloo",
    # no preset: TRL's RLOOConfig defaults, as colocate-rl has always run `rloo` (trainer.beta replaces its 0.05)
)
