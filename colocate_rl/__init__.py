"""colocate-rl: one YAML recipe → colocated online RL (GRPO, RLOO) with TRL on every torchrun rank."""

__version__ = "0.1.0"
