"""What a run will read, checked before launch (no `datasets`, no download): `inspect_data` reads the first rows
of the data `load_prompts` will load (columns, prompt values, row count), and `check_reward_on_sample` calls each
reward once, as TRL does, on a sample completion (a reward model's files: `colocate_rl.model_config`). Each problem
raises `UserError` naming the recipe key and the fix.
"""

from __future__ import annotations

import codecs
import inspect
import json
import math
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from colocate_rl.errors import UserError
from colocate_rl.prompts import (
    DEFAULT_BUILTIN_SIZE,
    FILE_KINDS,
    builtin_rows,
    check_data_options,
    hint_suffix,
    json_kind,
    one_line,
    to_prompt,
)

# ---------------------------------------------------------------------------------------------- checks before launch

SCAN_BYTES = 8 << 20  # validation reads a data file's first 8 MiB (all of a smaller one) ...
SCAN_ROWS = 1000  # ... and a parquet table's first rows
SAMPLE_ROWS = 2  # the rows each reward is called on at validation
BUILTIN_MAX_SAMPLES = 1_000_000  # built-in tasks are generated on every rank at start
SAMPLE_COMPLETION = "<think>6 times 7 is 42.</think> The answer is 42."
_FILE_FIX = "Fix: use one JSON object per line (.jsonl), a JSON list of objects (.json) or a parquet table."


@dataclass(frozen=True)
class DataSample:
    """What validation saw of the prompts: the columns, the first rows as TRL hands them to rewards (`prompt` in
    TRL's format, every other column as it is) and the number of rows when known."""

    source: str
    columns: tuple[str, ...]
    rows: tuple[dict, ...]
    total: int | None


def _open_regular(path: str, source: str):
    """A regular file opened for reading (binary); a FIFO, socket, device or directory is refused without blocking."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise UserError(
            f"data.source: file '{source}' not found; check the path (relative paths in a recipe start from its "
            "directory)"
        )
    except OSError as e:
        raise UserError(f"data.source: cannot open '{path}' ({e.strerror}). Fix: check the path and its permissions.")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UserError(
            f"data.source: '{path}' is not a regular file (a directory, FIFO, socket or device). "
            "Fix: point data.source at a .jsonl, .json or .parquet file on disk."
        )
    return os.fdopen(fd, "rb")


def _decode(path: str, head: bytes, whole: bool) -> str:
    """UTF-8 text of a file's first bytes (a character cut at the end of `head` is left out)."""
    try:
        text = codecs.getincrementaldecoder("utf-8")().decode(head, final=whole)
    except UnicodeDecodeError as e:
        line = head[: e.start].count(b"\n") + 1
        raise UserError(
            f"data.source: '{path}' line {line} is not UTF-8 text (byte 0x{head[e.start]:02x}). "
            "Fix: save the file as UTF-8."
        )
    return text.removeprefix("\ufeff")


def _json_array(path: str, text: str, whole: bool) -> list[tuple[str, object]]:
    """The items of a JSON list (its first ones when the file was not read whole)."""
    decoder, rows, i, n = json.JSONDecoder(), [], text.index("[") + 1, len(text)

    def skip(i: int) -> int:
        while i < n and text[i] in " \t\r\n":
            i += 1
        return i

    def bad(i: int, what: str) -> UserError:
        line = text.count("\n", 0, i) + 1
        return UserError(f"data.source: '{path}' line {line} is not valid JSON ({what}). {_FILE_FIX}")

    i = skip(i)
    if i < n and text[i] == "]":
        return rows
    while True:
        i = skip(i)
        if i >= n:
            if whole:
                raise bad(i, "the list is not closed with ']'")
            return rows
        try:
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError as e:
            if not whole:  # most likely the item the read cut off: the ranks read the rest
                return rows
            raise bad(e.pos, e.msg)
        rows.append((f"item {len(rows) + 1}", value))
        i = skip(i)
        if i >= n:
            if whole:
                raise bad(i, "the list is not closed with ']'")
            return rows
        if text[i] == ",":
            i += 1
        elif text[i] == "]":
            if whole and text[i + 1 :].strip():
                raise bad(i + 1, "extra data after the list")
            return rows
        else:
            raise bad(i, "expected ',' or ']' after an item")


def _json_rows(path: str, head: bytes, whole: bool) -> list[tuple[str, object]]:
    """(place, value) of each record of a JSON Lines file or a JSON list, read as `datasets` reads them; only the
    records in `head` when the file was not read whole."""
    if not whole:
        cut = head.rfind(b"\n")
        if cut < 0 and not head.lstrip().startswith(b"["):
            return []  # one line longer than SCAN_BYTES: nothing to check in the part read
        head = head[: cut + 1] if not head.lstrip().startswith(b"[") else head
    text = _decode(path, head, whole)
    if text.lstrip().startswith("["):
        items = _json_array(path, text, whole)
        if items and all(isinstance(v, str) for _, v in items):  # a list of strings: datasets names it `text`
            return [(place, {"text": v}) for place, v in items]
        return items
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append((f"line {number}", json.loads(line)))
        except ValueError as e:
            if not rows and whole:  # one JSON object over several lines: datasets would read it as one row
                try:
                    json.loads(text)
                except ValueError:
                    pass
                else:
                    raise _one_object(path)
            what = f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else str(e)
            raise UserError(f"data.source: '{path}' line {number} is not valid JSON ({what}). {_FILE_FIX}")
    return rows


def _one_object(path: str) -> UserError:
    return UserError(
        f"data.source: '{path}' holds one JSON object, not rows (datasets would read it as one row). Fix: write one "
        "JSON object per row (.jsonl) or a JSON list of row objects (.json)."
    )


def _file_rows(path: str, kind: str, source: str) -> tuple[list[tuple[str, dict]], list[str], int | None]:
    """(place, row) of a data file's first rows, its columns and its row count when known."""
    f = _open_regular(path, source)
    if kind == "parquet":
        import pyarrow.parquet as pq

        try:
            with f:
                table = pq.ParquetFile(f)
                total, columns = table.metadata.num_rows, list(table.schema_arrow.names)
                batch = next(table.iter_batches(batch_size=SCAN_ROWS), None) if total else None
                rows = batch.to_pylist() if batch is not None else []
        except Exception as e:
            raise UserError(f"data.source: cannot read '{path}' as parquet ({one_line(e)}). {_FILE_FIX}") from e
        return [(f"row {i}", row) for i, row in enumerate(rows)], columns, total
    with f:
        head = f.read(SCAN_BYTES + 1)
    whole = len(head) <= SCAN_BYTES
    records = _json_rows(path, head[:SCAN_BYTES], whole)
    if whole and len(records) == 1 and records[0][0] == "line 1" and path.lower().endswith(".json"):
        raise _one_object(path)  # a .json file of one object; one line of a .jsonl file is one row
    rows, columns = [], {}
    for place, value in records:
        if not isinstance(value, dict):
            raise UserError(
                f"data.source: '{path}' {place} is {json_kind(value)}, not a JSON object with named columns. "
                + _FILE_FIX
            )
        rows.append((place, value))
        columns.update(dict.fromkeys(value))
    return rows, list(columns), (len(rows) if whole else None)


def inspect_data(
    source: str,
    *,
    prompt_field: str = "prompt",
    chat: bool = True,
    system_prompt: str | None = None,
    num_samples: int | None = None,
    seed: int = 0,
) -> DataSample | None:
    """Check the prompts `load_prompts` will load, before anything runs: a built-in task's first rows, or a local
    file opened (regular files only) and its first rows read (JSON Lines and JSON lists: the first SCAN_BYTES, all of
    a smaller file; parquet: the first SCAN_ROWS rows); the `prompt_field` column present in them and holding text or
    chat messages. Returns what was seen, or None for a hub dataset (or a local dataset folder), which is not opened:
    nothing is downloaded before launch. Raises UserError as `load_prompts` does, naming the file and the line."""
    task = check_data_options(source, num_samples, system_prompt, chat)
    if task is not None:
        if num_samples is not None and num_samples > BUILTIN_MAX_SAMPLES:
            raise UserError(
                f"data.num_samples: {num_samples} prompts of a built-in task, generated on every rank at start. "
                f"Fix: use at most {BUILTIN_MAX_SAMPLES} (the prompts repeat in a new order each epoch)."
            )
        rows = [(f"row {i}", row) for i, row in enumerate(builtin_rows(task, SAMPLE_ROWS, seed))]
        columns, total = list(rows[0][1]), num_samples or DEFAULT_BUILTIN_SIZE
    else:
        path = os.path.expanduser(source)
        suffix = os.path.splitext(source)[1].lower()
        if suffix in FILE_KINDS:
            rows, columns, total = _file_rows(path, FILE_KINDS[suffix], source)
        elif os.path.exists(path) and not os.path.isdir(path):
            raise UserError(
                f"data.source: file '{source}' has an unsupported type '{suffix}'. "
                "Fix: convert it to .jsonl, .json or .parquet."
            )
        elif source.startswith(("./", "../", "/", "~")) and not os.path.exists(path):
            raise UserError(
                f"data.source: '{source}' not found (looked at {os.path.abspath(path)}). Fix: correct the path "
                "(relative paths in a recipe start from its directory, in --set from the current one), or give a Hub "
                "dataset id."
            )
        else:
            return None  # a hub id or a local dataset folder: loaded by datasets on the ranks
        if not rows and total is not None:
            raise UserError(f"data.source: file '{source}' is empty. Fix: put at least one record in it.")
        if not rows:  # the part read holds no whole record (one very long line): nothing to check here
            return None
        if num_samples is not None and total is not None and num_samples > total:
            raise UserError(
                f"data.num_samples: {num_samples} but '{source}' has {total} rows. "
                f"Fix: set it to at most {total}, or remove it to use every row."
            )
    if prompt_field not in columns:
        found = ", ".join(columns) if columns else "none"
        raise UserError(
            f"data.prompt_field: column '{prompt_field}' not found in '{source}'"
            f"{hint_suffix(prompt_field, columns)}; columns found: {found}. "
            "Fix: set data.prompt_field to one of them."
        )
    forms: dict[bool, str] = {}
    prompts = []
    for place, row in rows:
        prompt = to_prompt(row.get(prompt_field), place, prompt_field, chat, system_prompt)
        forms.setdefault(isinstance(row.get(prompt_field), list), place)
        prompts.append(prompt)
    if len(forms) > 1:
        raise UserError(
            f"data.prompt_field: column '{prompt_field}' of '{source}' holds text ({forms[False]}) and chat messages "
            f"({forms[True]}). Fix: use one form for every row."
        )
    sample = []
    for prompt, (_, row) in zip(prompts[:SAMPLE_ROWS], rows[:SAMPLE_ROWS]):
        sample.append({**{c: row.get(c) for c in columns if c != "prompt"}, "prompt": prompt})
    return DataSample(source, tuple(columns), tuple(sample), total)


def _snake(name: str) -> str:
    """datasets' camelcase_to_snakecase: how its cache names a hub dataset's folder."""
    name = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", name)
    return re.sub(r"([a-z\d])([A-Z])", r"\1_\2", name).lower()


def hub_dataset_problem(source: str, key: str) -> str | None:
    """The line for a hub dataset a launch cannot load: the hub cannot be reached and datasets' own cache
    (HF_DATASETS_CACHE, what `load_dataset` reads offline) does not hold it. None for a built-in task, a local file or
    folder, a reachable hub."""
    from colocate_rl.model_config import hf_home, hub_unreachable

    local = os.path.exists(os.path.expanduser(source)) or os.path.splitext(source)[1].lower() in FILE_KINDS
    if source.startswith("builtin:") or local:
        return None
    reason = hub_unreachable()
    if reason is None:
        return None
    cache = Path(os.environ.get("HF_DATASETS_CACHE") or hf_home() / "datasets").expanduser()
    *owner, name = source.split("/")
    if any(p.is_dir() for p in cache.glob("___".join([*owner, _snake(name)]) + "/*/*/*")):
        return None
    return (
        f"{key}: hub dataset '{source}' cannot be fetched ({reason}) and is not in the local datasets cache ({cache}); "
        f"load it once where the hub is reachable (datasets.load_dataset('{source}')), or give a local .jsonl, .json "
        "or .parquet file"
    )


def _sample_trainer_state(max_steps: int):
    """A stand-in for transformers' TrainerState at the first step (what rewards read from `trainer_state`)."""
    from types import SimpleNamespace

    return SimpleNamespace(
        epoch=0.0,
        global_step=0,
        max_steps=max_steps,
        num_train_epochs=1,
        log_history=[],
        is_local_process_zero=True,
        is_world_process_zero=True,
    )


def _finite_number(value) -> bool:
    """A finite number (numpy and torch scalars too): not true/false, NaN or inf."""
    if isinstance(value, (str, bytes, bool)) or type(value).__name__ == "bool_":
        return False
    try:
        return (isinstance(value, (int, float)) or hasattr(type(value), "__float__")) and math.isfinite(float(value))
    except (TypeError, ValueError, OverflowError):
        return False


def check_reward_on_sample(
    fn, name: str, sample: DataSample, *, key: str, chat: bool, max_steps: int = 1, environment=None
) -> None:
    """Call a reward once, as TRL calls it, on a sample completion for the first rows of `sample`, for at most
    `rewards.REWARD_TIME_LIMIT_S`; UserError naming `key` when it raises anything (sys.exit() too), runs longer, or
    does not return one finite number (or None) per completion. With `environment` (a factory: the recipe's
    `tools.environment`) the reward also gets `environments`, one reset per row, as TRL passes them."""
    import asyncio

    from colocate_rl.rewards import USER_CODE_EXITS, time_limit

    rows = list(sample.rows)
    completion = [{"role": "assistant", "content": SAMPLE_COMPLETION}] if chat else SAMPLE_COMPLETION
    completions = [completion for _ in rows]
    columns = {c: [row.get(c) for row in rows] for c in sample.columns if c not in ("prompt", "completion")}
    if environment is not None:
        columns["environments"] = [environment() for _ in rows]
        for env, row in zip(columns["environments"], rows):
            env.reset(**row)
    fix = "Fix: return a list with one float (or None) per completion, for any completion text."
    with time_limit(key, f"reward '{name}' called on a sample completion"):
        try:
            result = fn(
                prompts=[row["prompt"] for row in rows],
                completions=completions,
                completion_ids=[list(SAMPLE_COMPLETION.encode())[:16] for _ in rows],
                **columns,
                trainer_state=_sample_trainer_state(max_steps),
                log_extra=lambda *args, **kwargs: None,
                log_metric=lambda *args, **kwargs: None,
            )
            if inspect.isawaitable(result):  # an async reward: TRL awaits it

                async def wait(awaitable):
                    return await awaitable

                result = asyncio.run(wait(result))
        except USER_CODE_EXITS:
            raise
        except UserError as e:
            raise UserError(*(f"{key}: reward '{name}' stopped on a sample completion: {line}" for line in e.lines))
        except BaseException as e:  # sys.exit() or a BaseException of its own too
            if isinstance(e, TypeError) and "required" in str(e) and "argument" in str(e):  # a column not there
                found = ", ".join(columns) or "none besides the prompt"
                fix = (
                    f"Fix: TRL passes the data's columns by keyword and {sample.source} has {found}: use data with "
                    "that column, or rename the parameter."
                )
            raise UserError(
                f"{key}: reward '{name}' raised {one_line(e)} when called on a sample completion of "
                f"{sample.source} (its first {len(rows)} rows). {fix}"
            ) from e
    if isinstance(result, (str, bytes, dict)) or not hasattr(result, "__len__") or not hasattr(result, "__iter__"):
        shown = one_line(ValueError(repr(result)), 80).removeprefix("ValueError: ")
        raise UserError(
            f"{key}: reward '{name}' returned {json_kind(result)} ({shown}) for {len(rows)} sample completions, "
            f"not a list. {fix}"
        )
    if len(result) != len(rows):
        raise UserError(
            f"{key}: reward '{name}' returned {len(result)} value(s) for {len(rows)} sample completions. {fix}"
        )
    for i, value in enumerate(result):
        if value is not None and not _finite_number(value):
            raise UserError(
                f"{key}: reward '{name}' returned {json_kind(value)} ({value!r:.40}) for sample completion {i}, "
                f"not a finite number. {fix}"
            )
