"""Reward functions: the built-in ones and `resolve_reward`, which turns a recipe reward name (a built-in name,
`package.module:function` or `path/to/file.py:function`) into a TRL reward function
`fn(prompts, completions, **kwargs) -> list[float | None]`. Importing a reward file runs its code; `time_limit` bounds
how long the pre-flight lets that code (and one call of it) run.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import re
import signal
import sys
import threading
import time
import zlib
from contextlib import contextmanager
from decimal import Decimal

from colocate_rl.errors import UserError, hint_suffix, one_line

# ---------------------------------------------------------------------------------------------- rewards


def _content_text(content) -> str:
    if isinstance(content, list):  # multimodal parts: [{"type": "text", "text": ...}, ...]
        return "".join(p.get("text") or "" for p in content if isinstance(p, dict))
    return content or ""


def completion_text(completion) -> str:
    """The text of one completion: a string (chat=False) or the assistant messages' contents (chat=True)."""
    if isinstance(completion, str):
        return completion
    return "\n".join(_content_text(m.get("content")) for m in completion if m.get("role", "assistant") == "assistant")


_NUMBER = re.compile(r"(?:(?<!\d)-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_THINK = re.compile(r"\s*<think>.*?</think>(.*)", re.DOTALL)


def _last_number(text: str) -> Decimal | None:
    found = _NUMBER.findall(text)
    return Decimal(found[-1].replace(",", "")) if found else None


def digit_share(prompts, completions, **kwargs) -> list[float]:
    """Fraction of the completion's non-space characters that are digits 0-9 (0.0 when empty). Dense."""
    rewards = []
    for completion in completions:
        chars = [c for c in completion_text(completion) if not c.isspace()]
        rewards.append(sum(c in "0123456789" for c in chars) / len(chars) if chars else 0.0)
    return rewards


def answer_match(prompts, completions, answer=None, **kwargs) -> list[float | None]:
    """1.0 if the completion's last number equals the `answer` column (GSM8K: the part after '####'), else 0.0.

    None for rows whose answer is None. Raises UserError if the dataset has no `answer` column.
    """
    if answer is None:
        raise UserError(
            "rewards: answer_match needs an `answer` column in the dataset, which has none. "
            "Fix: use a dataset with an answer column (e.g. builtin:arithmetic) or drop answer_match."
        )
    rewards = []
    for completion, gold in zip(completions, answer, strict=True):
        if gold is None:
            rewards.append(None)
            continue
        expected = _last_number(str(gold).split("####")[-1].replace(",", ""))
        got = _last_number(completion_text(completion))
        rewards.append(1.0 if expected is not None and got == expected else 0.0)
    return rewards


def math_verify(prompts, completions, answer=None, **kwargs) -> list[float | None]:
    """1.0 if the completion's final answer equals the `answer` column mathematically, else 0.0: Hugging Face's
    math-verify parses LaTeX, `\\boxed{}`, fractions, decimals and GSM8K `####` answers, as TRL's and open-r1's
    accuracy rewards do. A `<think>` section is left out. None for rows whose answer is None or does not parse.
    Raises UserError if the dataset has no `answer` column."""
    from math_verify import parse, verify

    if answer is None:
        raise UserError(
            "rewards: math_verify needs an `answer` column in the dataset, which has none. "
            "Fix: use a dataset with an answer column (e.g. builtin:arithmetic) or drop math_verify."
        )
    rewards: list[float | None] = []
    for completion, gold in zip(completions, answer, strict=True):
        expected = parse(str(gold).split("####")[-1]) if gold is not None else []
        if not expected:
            rewards.append(None)
            continue
        text = completion_text(completion)
        thought = _THINK.fullmatch(text)
        got = parse(thought.group(1) if thought else text)
        rewards.append(1.0 if got and verify(expected, got) else 0.0)
    return rewards


def format_think(prompts, completions, **kwargs) -> list[float]:
    """1.0 if the completion is `<think>...</think>` followed by a non-empty answer, else 0.0."""
    rewards = []
    for completion in completions:
        m = _THINK.fullmatch(completion_text(completion))
        ok = m is not None and m.group(1).strip() != "" and "<think>" not in m.group(1) and "</think>" not in m.group(1)
        rewards.append(1.0 if ok else 0.0)
    return rewards


_HASH_ANSWER = re.compile(r"^####\s*-?[0-9][0-9,]*(?:\.[0-9]+)?\s*$", re.MULTILINE)


def hash_answer_format(prompts, completions, **kwargs) -> list[float]:
    """1.0 if the completion gives its final answer on a GSM8K line `#### N` (N a number), else 0.0."""
    return [1.0 if _HASH_ANSWER.search(completion_text(c)) else 0.0 for c in completions]


def length_penalty(prompts, completions, **kwargs) -> list[float]:
    """-(characters / 1000) of the completion."""
    return [-(len(completion_text(c)) / 1000) for c in completions]


def tool_call_ok(prompts, completions, **kwargs) -> list[float]:
    """1.0 if the episode called a tool and every call returned a result (none was an error: unknown tool, bad
    arguments, a raise, a timeout, over the call limit), else 0.0. For recipes with `tools:`."""
    rewards = []
    for completion in completions:
        messages = [] if isinstance(completion, str) else completion
        results = [_content_text(m.get("content")) for m in messages if m.get("role") == "tool"]
        rewards.append(1.0 if results and not any(r.startswith("{'error':") for r in results) else 0.0)
    return rewards


# A built-in's first call imports and builds what it needs (math_verify: sympy, its parsers): a reward pool's process
# makes this call at its start, before the first training batch
WARM_CALLS = {"math_verify": {"prompts": [""], "completions": ["6 times 7 is 42.\n#### 42"], "answer": ["#### 42"]}}
REWARD_COLUMNS = {"answer_match": ("answer",), "math_verify": ("answer",)}  # dataset columns a built-in reward needs
BUILTIN_REWARDS = {
    f.__name__: f
    for f in (digit_share, answer_match, math_verify, format_think, hash_answer_format, length_penalty, tool_call_ok)
}


REWARD_TIME_LIMIT_S = 60.0  # the pre-flight's limit on importing one reward and on calling it once on a sample


class RewardTimeout(BaseException):
    """`time_limit` ran out in reward code. A BaseException, so that the code's own `except Exception` does not end
    it; the handlers that report a reward's own errors let it (and Ctrl-C) through: see `USER_CODE_EXITS`."""


USER_CODE_EXITS = (KeyboardInterrupt, RewardTimeout)  # what a reward's error handler must not turn into a line


@contextmanager
def alarm(seconds: float, expired: type[BaseException], repeat_s: float = 1.0):
    """Raise `expired` in the block once `seconds` have passed (again every `repeat_s`, should the code swallow it),
    by SIGALRM: only in the main thread of a POSIX process (where a signal handler can be set); elsewhere the block
    runs without a limit. A timer and handler set before (pytest-timeout's, say) are put back, the time the block took
    counted."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return
    armed = [True]

    def expire(signum, frame):
        if armed[0]:
            raise expired

    previous = signal.signal(signal.SIGALRM, expire)
    start = time.monotonic()
    delay, interval = signal.setitimer(signal.ITIMER_REAL, seconds, repeat_s)  # an earlier timer: put back
    try:
        yield
    finally:
        armed[0] = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if delay:
            signal.setitimer(signal.ITIMER_REAL, max(delay - (time.monotonic() - start), 1e-3), interval)


@contextmanager
def time_limit(key: str, what: str):
    """Run the block (reward code) for at most REWARD_TIME_LIMIT_S seconds (`alarm`): RewardTimeout raised in it
    becomes a UserError naming `key`. Outside the main thread the block runs without a limit."""
    try:
        with alarm(REWARD_TIME_LIMIT_S, RewardTimeout):
            yield
    except RewardTimeout:
        raise UserError(
            f"{key}: {what} did not end within {REWARD_TIME_LIMIT_S:g} s, the pre-flight's limit; a reward runs on "
            "every batch of completions: make it return faster, or look for what it waits on (input(), a lock, a "
            "network call without a timeout)"
        ) from None


def _import_file(target: str, key: str, what: str = "reward"):
    """Import `path/to/file.py` (a relative path: from the current directory; a recipe's are absolute by now) as a
    fresh module."""
    path = os.path.abspath(os.path.expanduser(target))
    if not target.endswith(".py"):
        raise UserError(f"{key}: '{target}' looks like a path but is not a .py file. Fix: write 'path/to/file.py:fn'.")
    if os.path.exists(path) and not os.path.isfile(path):  # importing a FIFO would block
        raise UserError(
            f"{key}: {what} file '{target}' is not a regular file (a directory, FIFO, socket or device). "
            "Fix: point at a .py file on disk."
        )
    if not os.path.isfile(path):
        raise UserError(
            f"{key}: {what} file '{target}' not found (looked at {path}). "
            "Fix: correct the path; relative paths in a recipe start from its directory, in --set from the current one."
        )
    stem = re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
    mod_name = f"colocate_rl_user_{stem}_{zlib.crc32(path.encode()):08x}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module  # dataclasses, pickling etc. look the module up by name
    try:
        spec.loader.exec_module(module)
    except USER_CODE_EXITS:
        sys.modules.pop(mod_name, None)
        raise
    except BaseException as e:  # sys.exit() or a BaseException of its own too: a reward file must only define
        sys.modules.pop(mod_name, None)
        raise UserError(f"{key}: importing {what} file '{target}' failed: {one_line(e)}. Fix: correct it.") from e
    return module


def _import_module(target: str, key: str):
    try:
        return importlib.import_module(target)
    except ImportError as e:
        raise UserError(
            f"{key}: cannot import module '{target}' ({one_line(e)}). Fix: install it or add its folder to "
            "PYTHONPATH, or write 'path/to/file.py:function'."
        ) from e
    except USER_CODE_EXITS:
        raise
    except BaseException as e:
        raise UserError(f"{key}: importing module '{target}' failed: {one_line(e)}. Fix: correct that module.") from e


def load_user_object(name: str, *, key: str, what: str = "reward function", builtins: dict | None = None):
    """The object `package.module:attr` or `path/to/file.py:attr` names (importing a file runs it), or the built-in
    of that name in `builtins`. UserError naming `key` for an unknown built-in, a malformed name, a module or file that
    does not import, or a missing attribute."""
    name = name.strip()
    if builtins is not None and ":" not in name:
        if name in builtins:
            return builtins[name]
        raise UserError(
            f"{key}: unknown {what.split()[0]} '{name}'{hint_suffix(name, builtins)}. Fix: use a built-in "
            f"({', '.join(builtins)}), 'package.module:function' or 'path/to/file.py:function'."
        )
    target, _, attr = name.rpartition(":")
    if not target or not attr.isidentifier():
        raise UserError(f"{key}: '{name}' is malformed. Fix: write 'package.module:function' or 'path/to/file.py:fn'.")
    is_path = target.endswith(".py") or "/" in target or os.sep in target
    kind = what.split()[0]
    module = _import_file(target, key, kind) if is_path else _import_module(target, key)
    if not hasattr(module, attr):
        defined = [n for n, v in vars(module).items() if inspect.isfunction(v) and v.__module__ == module.__name__]
        defined = [n for n in defined if not n.startswith("_")]
        found = f"functions defined there: {', '.join(defined)}" if defined else "it defines no public functions"
        raise UserError(
            f"{key}: '{target}' has no attribute '{attr}'{hint_suffix(attr, defined)}; {found}. "
            f"Fix: put the {what}'s name after the ':'."
        )
    return getattr(module, attr)


def resolve_reward(name: str, *, key: str):
    """Return the reward function for `name`: a built-in, `package.module:function` or `path/to/file.py:function`.

    The result's `__name__` (what TRL logs) is the built-in or function name. Raises UserError naming `key` for an
    unknown built-in, a module that does not import, a missing file, a missing attribute, a class or non-callable,
    or a function without `**kwargs` (TRL passes completion_ids, trainer_state and every dataset column by keyword).
    """
    if not isinstance(name, str) or not name.strip():
        raise UserError(f"{key}: reward name is empty. Fix: use one of {', '.join(BUILTIN_REWARDS)} or 'module:fn'.")
    name = name.strip()
    if ":" not in name:
        return load_user_object(name, key=key, builtins=BUILTIN_REWARDS)
    fn = load_user_object(name, key=key)
    attr = name.rpartition(":")[2]
    if inspect.isclass(fn) or not callable(fn):
        what = "a class" if inspect.isclass(fn) else f"an object of type {type(fn).__name__}"
        raise UserError(
            f"{key}: '{name}' is {what}, not a function. Fix: point at a function "
            "`def f(prompts, completions, **kwargs) -> list[float]` (or at a module-level instance with __call__)."
        )
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # some C callables have no signature: let TRL find out
        params = None
    if params is not None and not any(p.kind is p.VAR_KEYWORD for p in params):
        raise UserError(
            f"{key}: reward function '{name}' takes no **kwargs, but TRL passes prompts, completions, completion_ids, "
            f"trainer_state and every dataset column by keyword. Fix: `def {attr}(prompts, completions, **kwargs)`."
        )
    if not hasattr(fn, "__name__"):
        try:
            fn.__name__ = attr  # callable instance: log it under its attribute name
        except (AttributeError, TypeError):
            pass
    return fn


def is_async(fn) -> bool:
    """Whether TRL runs reward `fn` on its event loop: a coroutine function or an instance with an async __call__."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def check_reward_spec(name: str, *, key: str) -> None:
    """Validate a reward name at recipe-check time (imports the module/file); UserError as in `resolve_reward`."""
    resolve_reward(name, key=key)


def reward_columns(name: str) -> tuple[str, ...]:
    """The dataset columns the reward named `name` needs (built-ins only; a user's reward says so by failing)."""
    return REWARD_COLUMNS.get(name.strip(), ())
