"""Reading a recipe: YAML → mapping, `--set` overrides (dotted key → value) applied, validated into a Recipe.

Precedence is defaults < recipe file < overrides. Every problem is reported at once (UserError, one line each);
nothing here touches the filesystem beyond reading the recipe.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from colocate_rl.errors import UserError
from colocate_rl.recipe.messages import format_errors
from colocate_rl.recipe.schema import Recipe


def read_yaml(path: Path) -> dict[str, Any]:
    """Parse a recipe file into a mapping. Fails (UserError) on a missing file, YAML syntax or a non-mapping."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise UserError(
            f"{path}: recipe file not found; check the path or run `colocate-rl recipes` to list shipped ones"
        )
    except OSError as e:
        raise UserError(f"{path}: cannot read recipe ({e.strerror})")
    try:
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise UserError(f"{where}: invalid YAML: {e.problem or e.context}; fix the syntax at that line")
    except yaml.YAMLError as e:
        raise UserError(f"{path}: invalid YAML: {e}")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"{path}: a recipe must be a YAML mapping of sections (model:, data:, rewards:, ...)")
    return data


def parse_sets(items: list[str]) -> dict[str, Any]:
    """`--set KEY=VALUE` strings as overrides: dotted key → value (parsed as YAML). A key given twice keeps its last
    value, in the position of its last occurrence. Fails (UserError) on an item without a dotted key."""
    overrides: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise UserError(f"--set {item!r}: expected KEY=VALUE with a dotted key, e.g. --set trainer.max_steps=20")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        overrides.pop(key, None)
        overrides[key] = value
    return overrides


def format_sets(overrides: Mapping[str, Any]) -> list[str]:
    """Overrides as `KEY=VALUE` strings that `--set` (and `parse_sets`) read back to the same values."""
    import json

    return [f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in overrides.items()]


def apply_overrides(data: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `data` with each `dotted.key → value` of `overrides` set, in order. Fails (UserError) when a key
    runs through a value that is not a section."""
    result = copy.deepcopy(data)
    for key, value in overrides.items():
        node = result
        parts = key.split(".")
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise UserError(f"--set {key}=...: '{'.'.join(parts[: depth + 1])}' is not a section")
            node = child
        node[parts[-1]] = copy.deepcopy(value)
    return result


def parse_recipe(data: dict[str, Any], source: str = "recipe") -> Recipe:
    """Validate a mapping against the schema; every problem becomes one line of the UserError."""
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        raise UserError(*format_errors(e.errors(include_url=False)))


def load_recipe(path: str | Path, overrides: Mapping[str, Any] | None = None) -> Recipe:
    """Read, override and validate a recipe file (no cross-field checks: see `colocate_rl.plan.resolve`)."""
    data = apply_overrides(read_yaml(Path(path)), overrides or {})
    return parse_recipe(data, str(path))


def dump_recipe(recipe: Recipe, exclude: dict | None = None) -> str:
    """The fully resolved recipe (defaults included) as YAML, as written to the run directory; `exclude` is
    pydantic's nested exclude (e.g. `{"distributed": {"node_rank"}}` for the file all nodes share)."""
    return yaml.safe_dump(recipe.model_dump(mode="json", exclude=exclude), sort_keys=False, default_flow_style=False)


def write_recipe_copy(target: Path, source: Path, overrides: Mapping[str, Any], header: str) -> None:
    """A copy of the recipe at `source` with `overrides` applied and a `# header` line, written whole or not at all
    (temporary file + rename). Fails (UserError) when the target's directory does not exist."""
    import os

    if not target.parent.is_dir():
        raise UserError(f"--write: {target.parent} is not a directory; create it or choose another file name")
    text = f"# {header}\n" + yaml.safe_dump(apply_overrides(read_yaml(source), overrides), sort_keys=False)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
