"""Prompt datasets and reward functions for online RL (GRPO / RLOO) with TRL.

`load_prompts` returns a `datasets.Dataset` with a `prompt` column in TRL's format; `resolve_reward` turns a
recipe reward name into a TRL reward function `fn(prompts, completions, **kwargs) -> list[float | None]`.
Every problem the user can fix raises `UserError` naming the recipe key (`data.source`, `rewards[1].name`, ...).
`datasets` is imported inside functions so that importing this module stays instant.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import random
import re
import sys
import zlib
from decimal import Decimal

from colocate_rl.errors import UserError, did_you_mean

# ---------------------------------------------------------------------------------------------- datasets

BUILTIN_TASKS: dict[str, str] = {
    "digits": "short requests to write, count or list numbers; pair with the dense reward `digit_share`",
    "arithmetic": "'What is 17 + 25?'-style integer questions with an `answer` column; pair with `answer_match`",
}

_DIGITS_TEMPLATES = [
    "Count from {a} to {b}.",
    "Write the numbers from {a} to {b}, separated by spaces.",
    "Count backwards from {b} to {a}.",
    "List the first {k} multiples of {m}.",
    "List the even numbers between {a} and {b}.",
    "Write {k} random {d}-digit numbers.",
    "Write the squares of the numbers from 1 to {k}.",
    "Write the years from {y} to {z}.",
    "Give me {k} numbers greater than {a}.",
    "Write down a phone number with {d} digits.",
    "List {k} numbers that add up to {b}.",
    "Continue this sequence for {k} more numbers: {a}, {a2}, {a4}",
]
_ARITHMETIC_TEMPLATES = ["What is {a} {op} {b}?", "Compute {a} {op} {b}.", "Calculate {a} {op} {b}.", "{a} {op} {b}?"]
_FILE_KINDS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_DEFAULT_BUILTIN_SIZE = 512


def _did_you_mean(word: str, options) -> str:
    hint = did_you_mean(word, options)
    return f" ({hint})" if hint else ""


def _one_line(exc: BaseException, limit: int = 300) -> str:
    """`Type: message` on one line, with the root cause when the exception wraps another one."""
    root = exc
    while root.__cause__ is not None:
        root = root.__cause__
    text = f"{type(exc).__name__}: {exc}" + (f" (caused by {type(root).__name__}: {root})" if root is not exc else "")
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _builtin_rows(task: str, n: int, seed: int) -> list[dict]:
    """`n` rows of a built-in task, a pure function of `seed` (so any `n` gives a prefix of a larger `n`)."""
    rng = random.Random(f"{task}:{seed}")
    rows = []
    for _ in range(n):
        if task == "digits":
            a, m, y = rng.randint(1, 60), rng.randint(2, 15), rng.randint(1900, 2010)
            v = dict(a=a, b=a + rng.randint(5, 30), k=rng.randint(3, 12), m=m, d=rng.randint(2, 6), y=y)
            v.update(z=y + rng.randint(3, 15), a2=a + m, a4=a + 2 * m)
            rows.append({"prompt": rng.choice(_DIGITS_TEMPLATES).format(**v)})
        else:  # arithmetic
            op = rng.choice("+-*")
            a, b = (rng.randint(2, 99), rng.randint(2, 12)) if op == "*" else (rng.randint(1, 99), rng.randint(1, 99))
            a, b = (max(a, b), min(a, b)) if op == "-" else (a, b)
            result = a + b if op == "+" else a - b if op == "-" else a * b
            rows.append({"prompt": rng.choice(_ARITHMETIC_TEMPLATES).format(a=a, op=op, b=b), "answer": str(result)})
    return rows


def _parquet_rows(path: str) -> int | None:
    import pyarrow.parquet as pq

    try:
        return pq.read_metadata(path).num_rows
    except Exception:  # not a parquet file: let datasets report it
        return None


def _load_file(path: str, kind: str):
    """Load a local .jsonl/.json/.parquet file; UserError if it is missing, empty or unreadable."""
    import datasets

    if not os.path.isfile(path):
        raise UserError(
            f"data.source: file '{path}' not found (looked at {os.path.abspath(path)}). "
            f"Fix: correct the path; relative paths start from the current directory {os.getcwd()}."
        )
    with open(path, "rb") as f:
        head = f.read(64)
    no_records = not head.strip() or (len(head) < 64 and head.strip() == b"[]")
    if no_records or (kind == "parquet" and _parquet_rows(path) == 0):
        raise UserError(f"data.source: file '{path}' is empty. Fix: put at least one record in it.")
    try:
        return datasets.load_dataset(kind, data_files=path, split="train")
    except Exception as e:
        raise UserError(
            f"data.source: cannot read '{path}' as {kind} ({_one_line(e)}). "
            "Fix: use one JSON object per line (.jsonl), a JSON list of objects (.json) or a parquet table."
        ) from e


def _load_hub(source: str, subset: str | None, split: str):
    """Load a Hugging Face Hub dataset (or a local dataset folder); UserError naming `data.source` on any failure."""
    import datasets

    try:
        ds = datasets.load_dataset(source, subset, split=split)
    except Exception as e:
        raise UserError(
            f"data.source: cannot load dataset '{source}' (data.subset={subset!r}, data.split={split!r}): "
            f"{_one_line(e)}. "
            "Fix: check the id, subset, split and network access, or use a local .jsonl/.json/.parquet file "
            f"or builtin:<task> ({', '.join(BUILTIN_TASKS)})."
        ) from e
    if not isinstance(ds, datasets.Dataset):
        raise UserError(f"data.source: '{source}' gave a {type(ds).__name__}, not one split. Fix: set data.split.")
    return ds


def _to_prompt(value, row: int, prompt_field: str, chat: bool, system_prompt: str | None):
    """One prompt in TRL's format: a message list (chat) or the plain string."""
    if isinstance(value, str):
        if not chat:
            return value
        system = [{"role": "system", "content": system_prompt}] if system_prompt else []
        return system + [{"role": "user", "content": value}]
    if isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m for m in value):
        if not chat:
            raise UserError(
                f"data.chat: column '{prompt_field}' already holds chat messages (row {row}) but data.chat is false. "
                "Fix: set data.chat: true."
            )
        if system_prompt and value[0]["role"] != "system":
            return [{"role": "system", "content": system_prompt}] + value
        return value
    raise UserError(
        f"data.prompt_field: column '{prompt_field}' holds a {type(value).__name__} at row {row}, not text "
        "or a list of chat messages. Fix: point data.prompt_field at a text column."
    )


def load_prompts(
    source: str,
    *,
    split: str = "train",
    subset: str | None = None,
    prompt_field: str = "prompt",
    chat: bool = True,
    system_prompt: str | None = None,
    num_samples: int | None = None,
    seed: int = 0,
):
    """Load the prompt dataset named by `source` and put a TRL-format `prompt` column in it.

    `source` is `builtin:<task>` (generated from `seed`, 512 rows unless `num_samples`), a local `.jsonl`/`.json`/
    `.parquet` file (file order kept; `split`/`subset` ignored), or else a Hub dataset id. Other columns are kept,
    TRL passes them to reward functions. `num_samples` keeps the first rows. Raises UserError for: an unknown task,
    a missing/empty/unreadable file, a Hub load failure (e.g. offline), no rows, a missing `prompt_field` column,
    non-text prompts, a bad `num_samples`, or `system_prompt` without `chat`.
    """
    if num_samples is not None and (type(num_samples) is not int or num_samples < 1):
        raise UserError(f"data.num_samples: must be a positive integer, got {num_samples!r}. Fix: set it or remove it.")
    if system_prompt and not chat:
        raise UserError(
            "data.system_prompt: set while data.chat is false; plain-text prompts have no system turn. "
            "Fix: set data.chat: true, or put the instruction into the prompt text."
        )
    if not isinstance(source, str) or not source.strip():
        raise UserError("data.source: is empty. Fix: use builtin:<task>, a .jsonl/.json/.parquet file or a Hub id.")

    if source.startswith("builtin:"):
        import datasets

        task = source[len("builtin:") :]
        if task not in BUILTIN_TASKS:
            raise UserError(
                f"data.source: unknown built-in task '{task}'{_did_you_mean(task, BUILTIN_TASKS)}. "
                f"Fix: use one of {', '.join('builtin:' + t for t in BUILTIN_TASKS)}."
            )
        ds = datasets.Dataset.from_list(_builtin_rows(task, num_samples or _DEFAULT_BUILTIN_SIZE, seed))
    else:
        suffix = os.path.splitext(source)[1].lower()
        if suffix in _FILE_KINDS:
            ds = _load_file(os.path.expanduser(source), _FILE_KINDS[suffix])
        elif os.path.isfile(source):
            raise UserError(
                f"data.source: file '{source}' has an unsupported type '{suffix}'. "
                "Fix: convert it to .jsonl, .json or .parquet."
            )
        else:
            ds = _load_hub(source, subset, split)
        if len(ds) == 0:
            raise UserError(f"data.source: '{source}' has no rows (data.split={split!r}). Fix: use a non-empty one.")
        if num_samples is not None:
            ds = ds.select(range(min(num_samples, len(ds))))

    if prompt_field not in ds.column_names:
        raise UserError(
            f"data.prompt_field: column '{prompt_field}' not found in '{source}'"
            f"{_did_you_mean(prompt_field, ds.column_names)}; "
            f"columns found: {', '.join(ds.column_names)}. Fix: set data.prompt_field to one of them."
        )
    prompts = [_to_prompt(v, i, prompt_field, chat, system_prompt) for i, v in enumerate(ds[prompt_field])]
    ds = ds.add_column("__prompt__", prompts)  # add before removing: a table without columns has no rows
    if "prompt" in ds.column_names:
        ds = ds.remove_columns("prompt")
    return ds.rename_column("__prompt__", "prompt")


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


def format_think(prompts, completions, **kwargs) -> list[float]:
    """1.0 if the completion is `<think>...</think>` followed by a non-empty answer, else 0.0."""
    rewards = []
    for completion in completions:
        m = _THINK.fullmatch(completion_text(completion))
        ok = m is not None and m.group(1).strip() != "" and "<think>" not in m.group(1) and "</think>" not in m.group(1)
        rewards.append(1.0 if ok else 0.0)
    return rewards


def length_penalty(prompts, completions, **kwargs) -> list[float]:
    """-(characters / 1000) of the completion."""
    return [-(len(completion_text(c)) / 1000) for c in completions]


BUILTIN_REWARDS = {f.__name__: f for f in (digit_share, answer_match, format_think, length_penalty)}


def _import_file(target: str, key: str):
    """Import `path/to/file.py` (relative to the current directory) as a fresh module."""
    path = os.path.abspath(os.path.expanduser(target))
    if not target.endswith(".py"):
        raise UserError(f"{key}: '{target}' looks like a path but is not a .py file. Fix: write 'path/to/file.py:fn'.")
    if not os.path.isfile(path):
        raise UserError(
            f"{key}: reward file '{target}' not found (looked at {path}). "
            f"Fix: correct the path; relative paths start from the current directory {os.getcwd()}."
        )
    stem = re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
    mod_name = f"colocate_rl_user_{stem}_{zlib.crc32(path.encode()):08x}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module  # dataclasses, pickling etc. look the module up by name
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(mod_name, None)
        raise UserError(f"{key}: importing reward file '{target}' failed: {_one_line(e)}. Fix: correct it.") from e
    return module


def _import_module(target: str, key: str):
    try:
        return importlib.import_module(target)
    except ImportError as e:
        raise UserError(
            f"{key}: cannot import module '{target}' ({_one_line(e)}). Fix: install it or add its folder to "
            "PYTHONPATH, or write 'path/to/file.py:function'."
        ) from e
    except Exception as e:
        raise UserError(f"{key}: importing module '{target}' failed: {_one_line(e)}. Fix: correct that module.") from e


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
        if name in BUILTIN_REWARDS:
            return BUILTIN_REWARDS[name]
        raise UserError(
            f"{key}: unknown reward '{name}'{_did_you_mean(name, BUILTIN_REWARDS)}. Fix: use a built-in "
            f"({', '.join(BUILTIN_REWARDS)}), 'package.module:function' or 'path/to/file.py:function'."
        )
    target, _, attr = name.rpartition(":")
    if not target or not attr.isidentifier():
        raise UserError(f"{key}: '{name}' is malformed. Fix: write 'package.module:function' or 'path/to/file.py:fn'.")
    is_path = target.endswith(".py") or "/" in target or os.sep in target
    module = _import_file(target, key) if is_path else _import_module(target, key)

    if not hasattr(module, attr):
        defined = [n for n, v in vars(module).items() if inspect.isfunction(v) and v.__module__ == module.__name__]
        defined = [n for n in defined if not n.startswith("_")]
        found = f"functions defined there: {', '.join(defined)}" if defined else "it defines no public functions"
        raise UserError(
            f"{key}: '{target}' has no attribute '{attr}'{_did_you_mean(attr, defined)}; {found}. "
            "Fix: put the reward function's name after the ':'."
        )
    fn = getattr(module, attr)
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


def check_reward_spec(name: str, *, key: str) -> None:
    """Validate a reward name at recipe-check time (imports the module/file); UserError as in `resolve_reward`."""
    resolve_reward(name, key=key)
