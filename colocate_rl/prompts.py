"""Prompt datasets for online RL (GRPO / RLOO) with TRL: `load_prompts` returns a `datasets.Dataset` with a
`prompt` column in TRL's format, from a built-in task, a local .jsonl/.json/.parquet file or a hub dataset.
Every problem the user can fix raises `UserError` naming the recipe key. `datasets` is imported inside functions so
that importing this module stays instant.
"""

from __future__ import annotations

import itertools
import os
import random
from collections.abc import Iterable, Iterator

from colocate_rl.errors import UserError, hint_suffix, one_line

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
FILE_KINDS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
DEFAULT_BUILTIN_SIZE = 512
HELDOUT_STREAM = "heldout"  # the seed stream of a built-in task's held-out prompts
HELDOUT_DRAWS_PER_ROW = 100  # draws tried per held-out prompt wanted before giving up


def json_kind(value) -> str:
    """`a number`, `null`, `a list`, ... for a value read from JSON (or any Python value)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true/false"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    return f"a {type(value).__name__}"


def source_kind(source: str) -> str:
    """How `load_prompts` reads `source`: `builtin`, `file` (a .jsonl/.json/.parquet name) or `hub` (anything else)."""
    if source.startswith("builtin:"):
        return "builtin"
    return "file" if os.path.splitext(source)[1].lower() in FILE_KINDS else "hub"


def iter_builtin_rows(task: str, seed: int | str) -> Iterator[dict]:
    """The endless rows of a built-in task, a pure function of `seed`."""
    rng = random.Random(f"{task}:{seed}")
    while True:
        if task == "digits":
            a, m, y = rng.randint(1, 60), rng.randint(2, 15), rng.randint(1900, 2010)
            v = dict(a=a, b=a + rng.randint(5, 30), k=rng.randint(3, 12), m=m, d=rng.randint(2, 6), y=y)
            v.update(z=y + rng.randint(3, 15), a2=a + m, a4=a + 2 * m)
            yield {"prompt": rng.choice(_DIGITS_TEMPLATES).format(**v)}
        else:  # arithmetic
            op = rng.choice("+-*")
            a, b = (rng.randint(2, 99), rng.randint(2, 12)) if op == "*" else (rng.randint(1, 99), rng.randint(1, 99))
            a, b = (max(a, b), min(a, b)) if op == "-" else (a, b)
            result = a + b if op == "+" else a - b if op == "-" else a * b
            yield {"prompt": rng.choice(_ARITHMETIC_TEMPLATES).format(a=a, op=op, b=b), "answer": str(result)}


def builtin_rows(task: str, n: int, seed: int | str) -> list[dict]:
    """`n` rows of a built-in task, a pure function of `seed` (so any `n` gives a prefix of a larger `n`)."""
    return list(itertools.islice(iter_builtin_rows(task, seed), n))


def heldout_builtin_rows(task: str, n: int, seed: int, exclude: Iterable[str] = ()) -> list[dict]:
    """`n` rows of a built-in task for evaluation: drawn from a seed stream training never uses, each prompt text once
    and none of `exclude` (the training prompts). UserError naming eval.num_samples when the task has too few."""
    seen, rows = set(exclude), []
    for row in itertools.islice(iter_builtin_rows(task, f"{seed}:{HELDOUT_STREAM}"), HELDOUT_DRAWS_PER_ROW * n):
        if row["prompt"] not in seen:
            seen.add(row["prompt"])
            rows.append(row)
            if len(rows) == n:
                return rows
    raise UserError(
        f"eval.num_samples: {n} held-out prompts of builtin:{task}, but only {len(rows)} prompts that training does "
        f"not use were found in {HELDOUT_DRAWS_PER_ROW * n} draws. Fix: lower eval.num_samples or data.num_samples."
    )


def _parquet_rows(path: str) -> int | None:
    import pyarrow.parquet as pq

    try:
        return pq.read_metadata(path).num_rows
    except Exception:  # not a parquet file: let datasets report it
        return None


def _load_file(path: str, kind: str, key: str = "data.source"):
    """Load a local .jsonl/.json/.parquet file; UserError naming `key` if it is missing, empty or unreadable."""
    import datasets

    if not os.path.isfile(path):
        raise UserError(
            f"{key}: file '{path}' not found (looked at {os.path.abspath(path)}). "
            "Fix: correct the path; relative paths in a recipe start from its directory, in --set from the current one."
        )
    with open(path, "rb") as f:
        head = f.read(64)
    no_records = not head.strip() or (len(head) < 64 and head.strip() == b"[]")
    if no_records or (kind == "parquet" and _parquet_rows(path) == 0):
        raise UserError(f"{key}: file '{path}' is empty. Fix: put at least one record in it.")
    try:
        return datasets.load_dataset(kind, data_files=path, split="train")
    except Exception as e:
        raise UserError(
            f"{key}: cannot read '{path}' as {kind} ({one_line(e)}). "
            "Fix: use one JSON object per line (.jsonl), a JSON list of objects (.json) or a parquet table."
        ) from e


def _load_hub(source: str, subset: str | None, split: str, key: str = "data.source", split_key: str = "data.split"):
    """Load a Hugging Face Hub dataset (or a local dataset folder); UserError naming `key` on any failure."""
    import datasets

    try:
        ds = datasets.load_dataset(source, subset, split=split)
    except Exception as e:
        raise UserError(
            f"{key}: cannot load dataset '{source}' (data.subset={subset!r}, {split_key}={split!r}): "
            f"{one_line(e)}. "
            "Fix: check the id, subset, split and network access, or use a local .jsonl/.json/.parquet file "
            f"or builtin:<task> ({', '.join(BUILTIN_TASKS)})."
        ) from e
    if not isinstance(ds, datasets.Dataset):
        raise UserError(f"{key}: '{source}' gave a {type(ds).__name__}, not one split. Fix: set {split_key}.")
    return ds


def to_prompt(value, row: int | str, prompt_field: str, chat: bool, system_prompt: str | None):
    """One prompt in TRL's format: a message list (chat) or the plain string. `row` is an index or a place in the
    file, such as `line 3`."""
    row = f"row {row}" if isinstance(row, int) else row
    if isinstance(value, str):
        if not chat:
            return value
        system = [{"role": "system", "content": system_prompt}] if system_prompt else []
        return system + [{"role": "user", "content": value}]
    if isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m for m in value):
        if not chat:
            raise UserError(
                f"data.chat: column '{prompt_field}' already holds chat messages ({row}) but data.chat is false. "
                "Fix: set data.chat: true."
            )
        bad = next((i for i, m in enumerate(value) if not isinstance(m.get("content"), (str, list))), None)
        if bad is not None:
            content = value[bad].get("content")
            what = "no content" if "content" not in value[bad] else f"{json_kind(content)} as its content, not text"
            raise UserError(
                f"data.prompt_field: chat message {bad} of column '{prompt_field}' at {row} has {what}. Fix: give "
                "every message a role and a content."
            )
        if system_prompt and value[0]["role"] != "system":
            return [{"role": "system", "content": system_prompt}] + value
        return value
    raise UserError(
        f"data.prompt_field: column '{prompt_field}' holds {json_kind(value)} at {row}, not text "
        "or a list of chat messages. Fix: point data.prompt_field at a text column."
    )


def check_data_options(source: str, num_samples: int | None, system_prompt: str | None, chat: bool) -> str | None:
    """The `data.*` rules that need no file: returns the built-in task of a `builtin:<task>` source (None for a file or
    hub id). Raises UserError naming the key."""
    if num_samples is not None and (type(num_samples) is not int or num_samples < 1):
        raise UserError(f"data.num_samples: must be a positive integer, got {num_samples!r}. Fix: set it or remove it.")
    if system_prompt and not chat:
        raise UserError(
            "data.system_prompt: set while data.chat is false; plain-text prompts have no system turn. "
            "Fix: set data.chat: true, or put the instruction into the prompt text."
        )
    if not isinstance(source, str) or not source.strip():
        raise UserError("data.source: is empty. Fix: use builtin:<task>, a .jsonl/.json/.parquet file or a Hub id.")
    if not source.startswith("builtin:"):
        return None
    task = source[len("builtin:") :]
    if task not in BUILTIN_TASKS:
        raise UserError(
            f"data.source: unknown built-in task '{task}'{hint_suffix(task, BUILTIN_TASKS)}. "
            f"Fix: use one of {', '.join('builtin:' + t for t in BUILTIN_TASKS)}."
        )
    return task


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
    held_out: int = 0,
):
    """Load the prompt dataset named by `source` and put a TRL-format `prompt` column in it.

    `source` is `builtin:<task>` (generated from `seed`, 512 rows unless `num_samples`), a local `.jsonl`/`.json`/
    `.parquet` file (file order kept; `split`/`subset` ignored; its last `held_out` rows left out, for evaluation),
    or else a Hub dataset id. Other columns are kept, TRL passes them to reward functions. `num_samples` keeps the
    first rows. Raises UserError for: an unknown task, a missing/empty/unreadable file, a Hub load failure (e.g.
    offline), no rows (also none left after `held_out`), a missing `prompt_field` column, non-text prompts, a bad
    `num_samples`, or `system_prompt` without `chat`.
    """
    task = check_data_options(source, num_samples, system_prompt, chat)

    if task is not None:
        import datasets

        ds = datasets.Dataset.from_list(builtin_rows(task, num_samples or DEFAULT_BUILTIN_SIZE, seed))
    else:
        suffix = os.path.splitext(source)[1].lower()
        if suffix in FILE_KINDS:
            ds = _load_file(os.path.expanduser(source), FILE_KINDS[suffix])
            if held_out and len(ds) <= held_out:
                raise UserError(
                    f"eval.num_samples: its last {held_out} rows of '{source}' are held out for evaluation, which "
                    f"leaves none of its {len(ds)} rows to train on. Fix: lower eval.num_samples or set eval.source."
                )
            ds = ds.select(range(len(ds) - held_out)) if held_out else ds
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
    return _with_trl_prompts(ds, source, prompt_field, chat, system_prompt)


def _with_trl_prompts(ds, source: str, prompt_field: str, chat: bool, system_prompt: str | None):
    """`ds` with its `prompt_field` column turned into TRL's `prompt` column; UserError when the column is missing."""
    if prompt_field not in ds.column_names:
        raise UserError(
            f"data.prompt_field: column '{prompt_field}' not found in '{source}'"
            f"{hint_suffix(prompt_field, ds.column_names)}; "
            f"columns found: {', '.join(ds.column_names)}. Fix: set data.prompt_field to one of them."
        )
    prompts = [to_prompt(v, i, prompt_field, chat, system_prompt) for i, v in enumerate(ds[prompt_field])]
    ds = ds.add_column("__prompt__", prompts)  # add before removing: a table without columns has no rows
    if "prompt" in ds.column_names:
        ds = ds.remove_columns("prompt")
    return ds.rename_column("__prompt__", "prompt")


def load_eval_prompts(
    source: str | None,
    *,
    train_source: str,
    split: str = "test",
    subset: str | None = None,
    prompt_field: str = "prompt",
    chat: bool = True,
    system_prompt: str | None = None,
    num_samples: int = 64,
    seed: int = 0,
    train_num_samples: int | None = None,
):
    """The held-out prompts of an evaluation, in TRL's format, like `load_prompts`.

    `source` None holds out part of `train_source`: of a built-in task, `num_samples` prompts from its held-out seed
    stream, none of the (`train_num_samples`) training prompts; of a local file, its last `num_samples` rows (which
    training leaves out: `load_prompts(held_out=...)`); of a hub dataset, the first rows of `split`. Else the first
    `num_samples` rows of `source` (a built-in task: of its held-out stream). UserError naming the recipe key."""
    key = "eval.source" if source is not None else "data.source"
    source = source if source is not None else train_source
    task = source.removeprefix("builtin:") if source.startswith("builtin:") else None
    if task is not None:
        import datasets

        if task not in BUILTIN_TASKS:
            raise UserError(
                f"{key}: unknown built-in task '{task}'{hint_suffix(task, BUILTIN_TASKS)}. "
                f"Fix: use one of {', '.join('builtin:' + t for t in BUILTIN_TASKS)}."
            )
        exclude = []
        if source == train_source:
            exclude = [r["prompt"] for r in builtin_rows(task, train_num_samples or DEFAULT_BUILTIN_SIZE, seed)]
        ds = datasets.Dataset.from_list(heldout_builtin_rows(task, num_samples, seed, exclude))
    else:
        suffix = os.path.splitext(source)[1].lower()
        if suffix in FILE_KINDS:
            ds = _load_file(os.path.expanduser(source), FILE_KINDS[suffix], key)
            last = key == "data.source"  # the held-out rows of the training file are its last ones
            ds = ds.select(range(max(0, len(ds) - num_samples), len(ds)) if last else range(min(num_samples, len(ds))))
        elif os.path.isfile(source):
            raise UserError(
                f"{key}: file '{source}' has an unsupported type '{suffix}'. Fix: convert it to .jsonl, .json or .parquet."
            )
        else:
            ds = _load_hub(source, subset, split, key, "eval.split")
            ds = ds.select(range(min(num_samples, len(ds))))
        if len(ds) == 0:
            raise UserError(f"{key}: '{source}' has no rows (eval.split={split!r}). Fix: use a non-empty one.")
    return _with_trl_prompts(ds, source, prompt_field, chat, system_prompt)
