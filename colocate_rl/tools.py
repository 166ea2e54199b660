"""Tools the model may call and environments it acts in (the recipe's `tools:` section): the built-in tools, and the
user's functions and environment factories found by name, as rewards are (`colocate_rl.rewards.load_user_object`).

Importing a tool or environment file runs it, like a reward file: it is the user's code, run as the user, in the
launcher (`validate`, `train`, `mem-probe`) and on every rank. No shell or file tool is shipped.
"""

from __future__ import annotations

import ast
import inspect
import operator
from collections.abc import Callable

from colocate_rl.errors import UserError, one_line
from colocate_rl.rewards import load_user_object

_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
_MAX_EXPRESSION = 200  # characters: a calculator call is short; anything longer is refused, not evaluated
_MAX_POWER = 64  # exponents above this are refused (2 ** 10 ** 9 would take the process)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_POWER:
            raise ValueError(f"exponent {right} is too large")
        return _OPERATORS[type(node.op)](left, right)
    raise ValueError(f"unsupported element {ast.unparse(node)!r}: use numbers, + - * / // % ** and parentheses")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with +, -, * and / on numbers.

    Args:
        expression: The arithmetic expression to evaluate.

    Returns:
        The result, as a string.
    """
    if len(expression) > _MAX_EXPRESSION:
        raise ValueError(f"expression longer than {_MAX_EXPRESSION} characters")
    try:
        value = _evaluate(ast.parse(expression.strip(), mode="eval").body)
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(round(value, 6) if isinstance(value, float) else value)


BUILTIN_TOOLS: dict[str, Callable] = {"calculator": calculator}


def resolve_tool(name: str, *, key: str) -> Callable:
    """The tool function `name` names: a built-in, `package.module:function` or `path/to/file.py:function`.
    UserError naming `key` for an unknown built-in, an import that fails, a missing name, or something that is not a
    function (TRL calls a tool by its `__name__`)."""
    fn = load_user_object(name, key=key, what="tool function", builtins=BUILTIN_TOOLS)
    if ":" not in name:
        return fn
    if not (inspect.isfunction(fn) or inspect.ismethod(fn) or inspect.iscoroutinefunction(fn)):
        what = "a class" if inspect.isclass(fn) else f"an object of type {type(fn).__name__}"
        raise UserError(
            f"{key}: '{name}' is {what}, not a function; TRL offers a tool by its function name and signature. "
            "Fix: point at a function with type hints and a docstring."
        )
    return fn


def resolve_environment(name: str, *, key: str) -> Callable:
    """The environment factory `name` names (`package.module:Factory` or `path/to/file.py:Factory`): a class or a
    function returning an environment. UserError naming `key` as in `resolve_tool`."""
    factory = load_user_object(name.strip(), key=key, what="environment factory")
    if not callable(factory):
        raise UserError(
            f"{key}: '{name}' is an object of type {type(factory).__name__}, not a class or function. Fix: point at "
            "the environment's class (or a function that returns a new environment)."
        )
    return factory


def environment_tools(environment) -> list[Callable]:
    """The tools an environment offers, as TRL finds them: the public methods of its class except `reset` and
    `get_reward`, bound to `environment`."""
    return [
        getattr(environment, name)
        for name, _ in inspect.getmembers(type(environment), predicate=inspect.isfunction)
        if name not in ("reset", "get_reward") and not name.startswith("_")
    ]


def schema_problem(fn: Callable, key: str) -> str | None:
    """None when transformers can build the JSON schema TRL renders into the prompt for `fn` (type hints for every
    argument, a Google-style docstring with a description and an `Args:` line per argument); else one line naming
    `key`."""
    from transformers.utils import get_json_schema

    try:
        get_json_schema(fn)
    except Exception as e:  # transformers' DocstringParsingException / TypeHintParsingException, or a bad hint
        name = getattr(fn, "__name__", "the tool")
        return (
            f"{key}: tool '{name}' has no schema TRL can render into the prompt ({one_line(e)}). Fix: give every "
            "argument a type hint and the function a Google-style docstring: a description, then `Args:` with one "
            "`name: description` line per argument."
        )
    return None
