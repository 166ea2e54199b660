"""Paths in a recipe: a relative path starts from the recipe file's directory, and is made absolute when the recipe
is read, so the run directory's recipe.yaml names the very files the ranks and a later `train --resume` read, from
any directory. `--set` values start from the current directory (they were typed there).

The keys that hold paths (`PATH_KEYS`) and how a path is told from a name that is none:

- `model.name`: `builtin:<layout>` and a hub id are names; a local path when it starts with `./` or `../`, or
  when it exists relative to the recipe's directory (else, as before, relative to the current directory);
- `data.source` (and `eval.source`): `builtin:<task>` and a hub id are names; a local path when it ends in
  `.jsonl`/`.json`/`.parquet` or starts with `./` or `../`, or exists as `model.name` above;
- `rewards[].name`: `path/to/file.py:function` (a `.py` file or a `/` before the `:`) holds a path; a built-in
  name or `package.module:function` does not; `rewards[].model` (a reward model) as `model.name`;
- `distributed.deepspeed`: a shipped config's name (`zero3`, ...) is a name; a path when it ends in `.json`, holds
  a `/` or starts with `.`, or exists as `model.name` above;
- `output.run_dir`: always a path;
- `tools.functions[]` and `tools.environment` as `rewards[].name`; `model.chat_template` when it ends in `.jinja` or
  holds a `/` (else it names a template TRL ships).

Absolute paths stay as written; `~` is expanded. A value that certainly is a path, missing in the recipe's
directory but present in the current directory, is an error naming the path to write (the rule changed: such
paths used to start from the current directory). Values of `trainer.extra_args` are passed to TRL as written.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from colocate_rl.errors import UserError

# The data files colocate_rl.prompts loads (its FILE_KINDS; a test keeps the two equal).
DATA_FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
# (section, key, kind) of every path-like key; `rewards[].name` and `rewards[].model` are walked separately.
PATH_KEYS = (
    ("model", "name", "model"),
    ("data", "source", "data"),
    ("eval", "source", "data"),
    ("distributed", "deepspeed", "deepspeed"),
    ("output", "run_dir", "output"),
    ("model", "chat_template", "template"),
    ("tools", "environment", "reward"),
)


def _slots(data: Any) -> Iterator[tuple[dict, str, str, str]]:
    """(mapping, key, kind, dotted key) of every path-like string value of a recipe mapping, in a fixed order."""
    if not isinstance(data, dict):
        return
    for section, key, kind in PATH_KEYS:
        mapping = data.get(section)
        if isinstance(mapping, dict) and isinstance(mapping.get(key), str):
            yield mapping, key, kind, f"{section}.{key}"
    functions = (data.get("tools") or {}).get("functions") if isinstance(data.get("tools"), dict) else None
    for i, name in enumerate(functions if isinstance(functions, list) else ()):
        if isinstance(name, str):
            yield functions, i, "reward", f"tools.functions[{i}]"
    rewards = data.get("rewards")
    for i, reward in enumerate(rewards if isinstance(rewards, list) else ()):
        for key, kind in (("name", "reward"), ("model", "model")):
            if isinstance(reward, dict) and isinstance(reward.get(key), str):
                yield reward, key, kind, f"rewards[{i}].{key}"


def _is_path(kind: str, value: str) -> bool | None:
    """True: `value` (a reward: the part before the `:`) is a path; False: a name; None: a path only if it exists."""
    if not value or value.startswith("builtin:"):
        return False
    if kind == "reward":
        return value.endswith(".py") or "/" in value or os.sep in value
    if kind == "template":  # a .jinja file, or the name of a template TRL ships
        return value.endswith(".jinja") or "/" in value or os.sep in value
    if kind == "output" or value.startswith(("./", "../", "~")) or value in (".", "..") or os.path.isabs(value):
        return True
    if kind == "data" and value.lower().endswith(DATA_FILE_SUFFIXES):
        return True
    if kind == "deepspeed":
        from colocate_rl.recipe.shipped import shipped_deepspeed_configs

        if value in shipped_deepspeed_configs():
            return False
        if value.endswith(".json") or "/" in value or value.startswith("."):
            return True
    return None


def _resolve(kind: str, value: str, key: str, base: Path, cwd: Path) -> str:
    """`value` with its path made absolute against `base` (unchanged when it holds none). Fails (UserError) on a
    relative path that is certainly one and exists only in `cwd`."""
    suffix = ""
    if kind == "reward":  # path/to/file.py:function; a built-in name has no `:`
        target, sep, function = value.strip().rpartition(":")
        if not sep:
            return value
        value, suffix = target, sep + function
    is_path = _is_path(kind, value)
    if is_path is False:
        return value + suffix
    value = os.path.expanduser(value)
    if os.path.isabs(value):
        return value + suffix
    here, there = os.path.normpath(base / value), os.path.normpath(cwd / value)
    if is_path is None:  # a name unless it exists: in the recipe's directory, else (as before) in the current one
        found = here if os.path.lexists(here) else there if os.path.lexists(there) else None
        return (found or value) + suffix
    if kind != "output" and here != there and not os.path.lexists(here) and os.path.lexists(there):
        raise UserError(
            f"{key}: '{value}' is not in the recipe's directory {base} (relative paths in a recipe start there) but "
            f"is in the current directory; write '{os.path.relpath(there, base)}' or an absolute path"
        )
    return here + suffix


def resolve_paths(
    data: dict[str, Any], base: Path, *, cwd: Path | None = None, overridden: Iterable[str] = ()
) -> dict[str, Any]:
    """A copy of the recipe mapping `data` whose relative paths (`PATH_KEYS`) are absolute, starting from `base`
    (the recipe file's directory); those under an `overridden` dotted key are left as they are (an override
    replaces them). Values of the wrong type are left for the schema. Fails (UserError, one line per key) on a
    relative path that exists only in `cwd` (default: the current directory)."""
    base, cwd = Path(os.path.abspath(base)), Path(os.path.abspath(cwd or os.getcwd()))
    result, problems, overridden = copy.deepcopy(data), [], tuple(overridden)
    for mapping, key, kind, dotted in _slots(result):
        if any(dotted == k or dotted.startswith((f"{k}.", f"{k}[")) for k in overridden):
            continue
        try:
            mapping[key] = _resolve(kind, mapping[key], dotted, base, cwd)
        except UserError as e:
            problems += e.lines
    if problems:
        raise UserError(*problems)
    return result


def resolve_override_paths(overrides: Mapping[str, Any], cwd: Path | None = None) -> dict[str, Any]:
    """`--set` overrides (dotted key → value) whose relative paths are absolute, starting from `cwd` (default:
    the current directory), where they were typed."""
    cwd = cwd or Path.cwd()
    out = {}
    for key, value in overrides.items():
        parts = key.split(".")
        nested: Any = value
        for part in reversed(parts):
            nested = {part: nested}
        nested = resolve_paths(nested, cwd, cwd=cwd)
        for part in parts:
            nested = nested[part]
        out[key] = nested
    return out


def keep_spelling(written: dict[str, Any], resolved: dict[str, Any], target_dir: Path) -> dict[str, Any]:
    """`resolved` (its paths absolute) for a recipe file to be written in `target_dir`: each path spelled as in
    `written` (the same mapping before `resolve_paths`) where that names the same file from there."""
    rebased = resolve_paths(written, target_dir, cwd=target_dir)
    result = copy.deepcopy(resolved)
    for (mapping, key, _, _), (as_written, _, _, _), (again, _, _, _) in zip(
        _slots(result), _slots(written), _slots(rebased), strict=True
    ):
        if again[key] == mapping[key]:
            mapping[key] = as_written[key]
    return result
