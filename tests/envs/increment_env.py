"""TRL's own environment example (huggingface/trl `demo_grpo_environment.py`: `IncrementEnv`, a counter the model
raises through its one tool), as colocate-rl runs it with `tools.environment`. Two changes, both for TRL 1.16's
contract: `reset` takes the row's columns (TRL passes them) and the episode is scored by `get_reward` (the counter
reaching the row's `target`), where the demo's reward was a constant 0."""


class IncrementEnv:
    def __init__(self):
        self._counter = 0
        self._target = None

    def reset(self, target=None, **row) -> None:
        self._counter = 0
        self._target = target

    def increment(self, a: int) -> int:
        """
        Increment the integer by a specified value

        Args:
            a: The value to increment by

        Returns:
            The incremented integer.
        """
        self._counter += a
        return self._counter

    def get_reward(self) -> float:
        return 1.0 if self._target is not None and self._counter == int(self._target) else 0.0
