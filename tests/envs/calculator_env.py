"""A stateful environment for `builtin:arithmetic` rows, in TRL 1.16's `environment_factory` contract, whose one tool
is the built-in calculator under the same name and schema (so `builtin:tiny-calc` calls it): `reset` keeps the row's
answer, `get_reward` scores the episode 1.0 when one of its calls returned that answer."""

from colocate_rl.tools import calculator as _calculator


class CalculatorEnv:
    def __init__(self):
        self._answer, self._results = None, []

    def reset(self, answer=None, **row) -> None:
        self._answer, self._results = answer, []

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression with +, -, * and / on numbers.

        Args:
            expression: The arithmetic expression to evaluate.

        Returns:
            The result, as a string.
        """
        result = _calculator(expression)
        self._results.append(result)
        return result

    def get_reward(self) -> float:
        return 1.0 if self._answer is not None and self._answer in self._results else 0.0
