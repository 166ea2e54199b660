"""Errors that end a run with a message instead of a traceback. UserError: bad input the user can fix; the CLI prints
it one line per problem and exits 2. StaleWeightsError: the worker prints it and exits 3. EngineProcessError and
RewardProcessError: the worker prints it and exits 1."""


class StaleWeightsError(RuntimeError):
    """vLLM is not generating from the trainer's current weights (colocate_rl.rank.vllm_engine's weight check)."""


class EngineProcessError(RuntimeError):
    """The generation engine's own process failed or ended (colocate_rl.rank.engine_process); the message names it."""


class RewardProcessError(RuntimeError):
    """A process of a reward pool died (colocate_rl.rank.rewards); the message names the reward."""


class UserError(Exception):
    """Bad input (recipe, file, flag). `lines` holds one self-contained message per problem."""

    def __init__(self, *lines: str):
        self.lines = [line for line in lines if line]
        super().__init__("\n".join(self.lines))


def did_you_mean(word: str, options) -> str:
    """`did you mean 'x'?` for the closest of `options`, or '' when none is close."""
    import difflib

    match = difflib.get_close_matches(word, sorted(options), n=1)
    return f"did you mean '{match[0]}'?" if match else ""


def hint_suffix(word: str, options) -> str:
    """` (did you mean 'x'?)` for the closest of `options`, or ''."""
    hint = did_you_mean(word, options)
    return f" ({hint})" if hint else ""


def one_line(exc: BaseException, limit: int = 300) -> str:
    """`Type: message` on one line, with the root cause when the exception wraps another one."""
    root = exc
    while root.__cause__ is not None:
        root = root.__cause__
    text = f"{type(exc).__name__}: {exc}" + (f" (caused by {type(root).__name__}: {root})" if root is not exc else "")
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
