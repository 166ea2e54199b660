"""Reading a recipe: YAML → mapping, `--set` overrides (dotted key → value) applied, validated into a Recipe.

Precedence is defaults < recipe file < overrides. Every problem is reported at once (UserError, one line each);
nothing here touches the filesystem beyond reading the recipe.
"""

from __future__ import annotations

import copy
import os
import re
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from colocate_rl.errors import UserError
from colocate_rl.recipe.messages import format_errors
from colocate_rl.recipe.schema import Recipe

MAX_RECIPE_BYTES = 1 << 20  # a recipe is a small text file; anything larger is not one
MAX_YAML_ALIASES = 100  # `*name` references in one document: a recipe needs a handful
MAX_YAML_VALUES = 100_000  # values after expanding aliases (a "billion laughs" document expands to 10**9)
MAX_YAML_DEPTH = 64  # nesting of mappings and lists
# Key names that hold a secret: one of these words (`hub_token`, `db_password`) or phrases (`wandb_api_key`), but not
# a tokenizer's special tokens (`pad_token`, `eos_token_id`).
SECRET_WORDS = {"token", "password", "passwd", "secret", "apikey", "credentials"}
SECRET_PHRASES = ("api_key", "private_key", "access_key")
NOT_SECRET = re.compile(r"^(pad|eos|bos|unk|sep|cls|mask)_token$|token_ids?$")


class _YamlProblem(yaml.YAMLError):
    """A YAML document this package refuses to read, with the line it is about (a ready message)."""

    def __init__(self, message: str, mark: yaml.Mark | None = None):
        super().__init__(message)
        self.message, self.mark = message, mark


class _RecipeLoader(yaml.SafeLoader):
    """PyYAML's safe loader that refuses a key given twice in one mapping (PyYAML keeps the last silently) and more
    than MAX_YAML_ALIASES aliases."""

    def __init__(self, stream):
        super().__init__(stream)
        self.aliases = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > MAX_YAML_ALIASES:
                raise _YamlProblem(
                    f"more than {MAX_YAML_ALIASES} YAML aliases (*name); write the values out instead",
                    self.peek_event().start_mark,
                )
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first: dict[Any, yaml.Mark] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` merges; its keys may be overridden
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    earlier = first.get(key)
                except TypeError:  # an unhashable key: PyYAML reports it
                    continue
                if earlier is not None:
                    raise _YamlProblem(
                        f"duplicate key '{key}' (first at line {earlier.line + 1}); keep one of them (YAML would "
                        "silently use the last)",
                        key_node.start_mark,
                    )
                first[key] = key_node.start_mark
        return super().construct_mapping(node, deep)


def _check_expansion(data: Any) -> str | None:
    """Why `data` (as loaded, aliases shared) is too big or deep once its aliases are expanded, or None."""
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(obj: Any, depth: int) -> int:
        if not isinstance(obj, (dict, list)):
            return 1
        if depth > MAX_YAML_DEPTH:
            raise _YamlProblem(f"nested deeper than {MAX_YAML_DEPTH} levels; a recipe is a few levels deep")
        key = id(obj)
        if key in active:
            raise _YamlProblem("a YAML alias refers to a value that contains it (a recursive value); remove it")
        if key not in sizes:
            active.add(key)
            items = obj.values() if isinstance(obj, dict) else obj
            total = 1
            for item in items:
                total += size(item, depth + 1)
                if total > MAX_YAML_VALUES:
                    raise _YamlProblem(
                        f"expands to more than {MAX_YAML_VALUES} values through YAML aliases (an alias bomb?); "
                        "write the values out or use fewer aliases"
                    )
            active.discard(key)
            sizes[key] = total
        return sizes[key]

    try:
        size(data, 0)
    except _YamlProblem as e:
        return e.message
    return None


class _SetLoader(_RecipeLoader):
    """The recipe loader for `--set` values, which also reads 1e-5 (no dot) as a number, as YAML 1.2 does."""


class _SetDumper(yaml.SafeDumper):
    """Writes what `_SetLoader` reads back the same (quotes the text 1e-5)."""


for _side in (_SetLoader, _SetDumper):
    _side.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)[eE][-+]?[0-9]+$"),
        list("-+.0123456789"),
    )


def _parse_yaml(text: str, loader: type[_RecipeLoader] = _RecipeLoader) -> Any:
    """YAML text → data under the recipe's rules; raises _YamlProblem (a rule) or yaml.YAMLError (syntax)."""
    try:
        data = yaml.load(text, Loader=loader)  # a SafeLoader subclass: plain data only
    except RecursionError:
        raise _YamlProblem("nested too deeply; a recipe is a few levels deep")
    problem = _check_expansion(data)
    if problem is not None:
        raise _YamlProblem(problem)
    return data


def load_yaml_text(text: str, source: str) -> Any:
    """Parse YAML text with the recipe's rules: no key twice in one mapping, at most MAX_YAML_ALIASES aliases, at
    most MAX_YAML_VALUES values once aliases are expanded, no deeper than MAX_YAML_DEPTH. Fails (UserError naming
    `source` and the line) otherwise."""
    try:
        return _parse_yaml(text)
    except _YamlProblem as e:
        where = f"{source}:{e.mark.line + 1}" if e.mark is not None else source
        raise UserError(f"{where}: {e.message}")
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        raise UserError(f"{where}: invalid YAML: {e.problem or e.context}; fix the syntax at that line")
    except yaml.YAMLError as e:
        raise UserError(f"{source}: invalid YAML: {' '.join(str(e).split())}")


def read_text_file(path: Path, what: str, limit: int = MAX_RECIPE_BYTES) -> str:
    """The UTF-8 text of a regular file of at most `limit` bytes. A FIFO, a device or a directory is refused before
    anything is read from it (opening a FIFO for reading would block). Fails (UserError naming `path`) otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise UserError(f"{path}: {what} not found; check the path")
    except IsADirectoryError:
        raise UserError(f"{path}: is a directory, not a {what}; give the file's path")
    except OSError as e:
        raise UserError(f"{path}: cannot read {what} ({e.strerror}); check the path and its permissions")
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        if stat.S_ISDIR(mode):
            raise UserError(f"{path}: is a directory, not a {what}; give the file's path")
        raise UserError(f"{path}: is not a regular file (a FIFO, socket or device); give the path of a {what} on disk")
    with os.fdopen(fd, "rb") as f:
        try:
            data = f.read(limit + 1)
        except OSError as e:
            raise UserError(f"{path}: cannot read {what} ({e.strerror}); check the file")
    if len(data) > limit:
        raise UserError(f"{path}: larger than {limit // 1024} KiB, too large for a {what}; check the path")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise UserError(f"{path}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x}); save the {what} as UTF-8")


def read_yaml(path: Path) -> dict[str, Any]:
    """Parse a recipe file into a mapping. Fails (UserError) on a missing or non-regular file, a file that is not
    UTF-8, YAML syntax, a duplicate key, too many aliases or a non-mapping."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        raise UserError(
            f"{path}: recipe file not found; check the path or run `colocate-rl recipes` to list shipped ones"
        )
    data = load_yaml_text(read_text_file(path, "recipe"), str(path))
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"{path}: a recipe must be a YAML mapping of sections (model:, data:, rewards:, ...)")
    return data


def _secret_name(name: str) -> bool:
    name = name.lower().replace("-", "_")
    if NOT_SECRET.search(name):
        return False
    return bool(set(re.split(r"[^a-z0-9]+", name)) & SECRET_WORDS) or any(p in name for p in SECRET_PHRASES)


def secret_keys(data: Any, prefix: str = "", named: bool = False) -> list[str]:
    """Dotted keys of `data` whose name, or an enclosing key's (`named`), says they hold a secret (a token, password,
    API key) and that hold one (text or a number; not null, empty or true/false): the recipe goes to the run dir."""
    found, items = [], data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for key, value in items:
        dotted = f"{prefix}[{key}]" if isinstance(key, int) else f"{prefix}.{key}" if prefix else str(key)
        secret = named or (isinstance(key, str) and _secret_name(key))
        if isinstance(value, (dict, list)):
            found += secret_keys(value, dotted, secret)
        elif secret and value not in (None, "") and not isinstance(value, bool):
            found.append(dotted)
    return found


def _text_key(key: str) -> bool:
    """Whether the schema field at the dotted `key` holds text: `str` (optional or not) or a choice of strings."""
    import types
    import typing

    from pydantic import BaseModel

    def kinds_of(annotation: Any) -> list[Any]:  # `A | B | None` → [A, B]
        union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
        return [a for a in (typing.get_args(annotation) if union else (annotation,)) if a is not type(None)]

    model: Any = Recipe
    kinds: list[Any] = []
    for part in key.split("."):
        field = model.model_fields.get(part) if model is not None else None
        if field is None:
            return False
        kinds = kinds_of(field.annotation)
        sections = [k for k in kinds if isinstance(k, type) and issubclass(k, BaseModel)]  # model.lora: a section
        model = sections[0] if len(sections) == 1 else None
    return bool(kinds) and all(
        kind is str
        or (typing.get_origin(kind) is typing.Literal and all(isinstance(v, str) for v in typing.get_args(kind)))
        for kind in kinds
    )


def parse_set_value(key: str, raw: str) -> Any:
    """The value `--set KEY=RAW` gives: for a text key (`_text_key`: data.system_prompt, model.name, ...) the text
    as typed (inside its quotes when it is one quoted YAML string), `null` meaning null; for any other key the YAML value (1e-5 a number; text that is not YAML, the
    text). Fails (UserError) on YAML this package refuses (an alias bomb)."""
    if _text_key(key):
        if len(raw) > 1 and raw[0] == raw[-1] and raw[0] in "'\"":  # quoted as YAML text: the text inside
            try:
                quoted = _parse_yaml(raw, _SetLoader)
            except (_YamlProblem, yaml.YAMLError):
                quoted = None
            if isinstance(quoted, str):
                return quoted
        return None if raw == "null" else raw
    if not raw.strip():
        return ""
    try:
        return _parse_yaml(raw, _SetLoader)
    except _YamlProblem as e:
        raise UserError(f"--set {key}: {e.message}")
    except yaml.YAMLError:  # not YAML: the text itself
        return raw


def _split_set(item: str, option: str) -> tuple[str, str]:
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise UserError(f"{option} {item!r}: expected KEY=VALUE with a dotted key, e.g. --set trainer.max_steps=20")
    return key, raw


def parse_sets(items: Sequence[str], strings: Sequence[str] = ()) -> dict[str, Any]:
    """`--set KEY=VALUE` strings (`parse_set_value`), then `--set-str KEY=VALUE` strings (always the text as
    typed), as overrides: dotted key → value. A key given twice keeps its last value, in the position of its last
    occurrence. Fails (UserError) on an item without a dotted key."""
    overrides: dict[str, Any] = {}
    for option, entries in (("--set", items), ("--set-str", strings)):
        for item in entries:
            key, raw = _split_set(item, option)
            overrides.pop(key, None)
            overrides[key] = raw if option == "--set-str" else parse_set_value(key, raw)
    return overrides


def format_sets(overrides: Mapping[str, Any]) -> list[str]:
    """Overrides as `KEY=VALUE` strings that `--set` (and `parse_sets`) read back to the same values. Fails
    (ValueError) on one `--set` cannot give."""
    import json

    def same(a: Any, b: Any) -> bool:  # 1, 1.0 and true differ
        return json.dumps(a, sort_keys=True, default=repr) == json.dumps(b, sort_keys=True, default=repr)

    items = []
    for key, value in overrides.items():
        if isinstance(value, str):
            candidates = [value, json.dumps(value)]
        elif isinstance(value, (dict, list)):  # YAML flow style keeps 1.0e-05 a number and quotes `yes`
            candidates = [
                yaml.dump(value, Dumper=_SetDumper, default_flow_style=True, sort_keys=False, width=1 << 30).strip()
            ]
        else:
            candidates = [json.dumps(value)]
        text = next((c for c in candidates if same(parse_set_value(key, c), value)), None)
        if text is None:
            raise ValueError(
                f"--set cannot give {key}={value!r}" + ("; --set-str can" if isinstance(value, str) else "")
            )
        items.append(f"{key}={text}")
    return items


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
    """Validate a mapping against the schema; every problem becomes one line of the UserError. A secret in the
    recipe (`secret_keys`) is one too: the recipe is copied into the run directory."""
    secrets = [
        f"{key}: looks like a secret, and the recipe is copied into the run directory (recipe.yaml, launch.json) "
        "where anyone who can read it sees it; remove it and put it in the environment instead (HF_TOKEN, "
        "WANDB_API_KEY, ...)"
        for key in secret_keys(data)
    ]
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as e:
        raise UserError(*secrets, *format_errors(e.errors(include_url=False)))
    if secrets:
        raise UserError(*secrets)
    return recipe


def load_recipe(path: str | Path, overrides: Mapping[str, Any] | None = None) -> Recipe:
    """Read, override and validate a recipe file (no cross-field checks: see `colocate_rl.plan.resolve`). Paths are
    taken as written: for a run directory's recipe.yaml, which holds them absolute (`colocate_rl.pipeline`
    resolves a user's recipe, `colocate_rl.recipe.paths`)."""
    data = apply_overrides(read_yaml(Path(path)), overrides or {})
    return parse_recipe(data, str(path))


def dump_recipe(recipe: Recipe, exclude: dict | None = None) -> str:
    """The fully resolved recipe (defaults included) as YAML, as written to the run directory; `exclude` is
    pydantic's nested exclude (e.g. `{"distributed": {"node_rank"}}` for the file all nodes share)."""
    return yaml.safe_dump(recipe.model_dump(mode="json", exclude=exclude), sort_keys=False, default_flow_style=False)


def write_recipe_copy(
    target: Path, source: Path, overrides: Mapping[str, Any], header: str, cwd: Path | None = None
) -> None:
    """A copy of the recipe at `source` with `overrides` (typed in `cwd`, default the current directory) applied and
    a `# header` line, written whole or not at all (temporary file + rename). Its paths name the same files as the
    recipe's and the overrides': as written where that still holds from the target's directory, else absolute.
    Fails (UserError) when the target's directory does not exist."""
    from colocate_rl.recipe.paths import keep_spelling, resolve_override_paths, resolve_paths

    if not target.parent.is_dir():
        raise UserError(f"--write: {target.parent} is not a directory; create it or choose another file name")
    data = read_yaml(source)
    resolved = apply_overrides(
        resolve_paths(data, Path(source).parent, cwd=cwd, overridden=overrides), resolve_override_paths(overrides, cwd)
    )
    copied = keep_spelling(apply_overrides(data, overrides), resolved, target.parent)
    text = f"# {header}\n" + yaml.safe_dump(copied, sort_keys=False)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
