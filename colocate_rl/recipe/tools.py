"""The recipe's `tools:` section: functions the model may call and a multi-turn environment, with their limits.

Checked before launch by `colocate_rl.plan.tools` (the code imports, the schemas TRL renders, the chat template);
run on the ranks by `colocate_rl.rank.tools` through TRL's tool loop and colocate-rl's generation engine.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat

from colocate_rl.recipe.values import Count


class ToolsSection(BaseModel):
    """Tool use and multi-turn episodes (TRL's `tools` and `environment_factory`). Tool and environment code runs
    inside the training processes as you, like reward files: use only code you trust."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    functions: list[Annotated[str, Field(min_length=1)]] = Field(
        default_factory=list,
        description="Functions the model may call: a built-in (calculator), `package.module:function` or "
        "`path/to/file.py:function`. Each needs type hints and a Google-style docstring: TRL renders them into the "
        "prompt as the tool's schema.",
    )
    environment: str | None = Field(
        None,
        description="A stateful environment (TRL's `environment_factory`): `package.module:Factory` or "
        "`path/to/file.py:Factory`, called once per concurrent episode. Its public methods are tools; `reset(**row)` "
        "starts an episode (text it returns is appended to the prompt); an optional `get_reward()` scores the episode "
        "as one more reward.",
    )
    max_turns: Count = Field(
        4,
        le=64,
        description="Most tool rounds in one episode: after the model's first reply, at most this many times the "
        "tool results are appended and it replies again (TRL's `max_tool_calling_iterations`). The episode's tokens, "
        "the model's and the tools', are bounded by trainer.max_completion_length; tool tokens are masked out of "
        "the loss.",
    )
    max_calls: Count = Field(
        8, description="Most tool calls in one episode; a call beyond them gets an error back as its result."
    )
    timeout_s: PositiveFloat = Field(
        10.0,
        le=3600,
        description="Longest one tool call may run, seconds. A call that takes longer, or raises, returns an error "
        "text to the model instead of ending the run.",
    )

    def summary(self) -> str:
        """`calculator, env.py:Game; ≤ 4 turns, ≤ 8 calls, 10 s a call` for the plan's table."""
        what = [*self.functions, *([self.environment] if self.environment else [])]
        turns, calls = (
            f"{n} {word}{'s' * (n != 1)}" for n, word in ((self.max_turns, "turn"), (self.max_calls, "call"))
        )
        return f"{', '.join(what)}; ≤ {turns}, ≤ {calls}, {self.timeout_s:g} s a call"

    @property
    def active(self) -> bool:
        """Whether the recipe uses tools or an environment at all."""
        return bool(self.functions) or self.environment is not None
