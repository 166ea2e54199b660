"""Pydantic validation errors of a recipe as one line each: `dotted.key: problem (got value); fix`."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from colocate_rl.errors import did_you_mean
from colocate_rl.recipe.schema import Recipe


def model_of(annotation: Any) -> type[BaseModel] | None:
    """The pydantic section model inside an annotation such as `X`, `list[X]` or `X | None`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = model_of(arg)
        if found is not None:
            return found
    return None


def _field_path(loc: tuple) -> tuple:
    """`loc` without pydantic's union tags (e.g. `constrained-int`): only list indices and recipe keys."""
    model: type[BaseModel] | None = Recipe
    path: list = []
    for part in loc:
        if isinstance(part, int):
            path.append(part)
        elif model is not None and part in model.model_fields:
            path.append(part)
            model = model_of(model.model_fields[part].annotation)
        else:
            break
    return tuple(path)


def _section_keys(path: tuple) -> list[str]:
    model: type[BaseModel] | None = Recipe
    for part in path:
        if isinstance(part, str) and model is not None:
            model = model_of(model.model_fields[part].annotation)
    return list(model.model_fields) if model is not None else []


def _dotted(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "recipe"


def _message(err: dict) -> str:
    """pydantic's message for one error, with what to write instead where pydantic's own says too little."""
    msg = err["msg"].removeprefix("Value error, ")
    value = err.get("input")
    if err["type"] == "int_type":  # a whole number only (schema.Count): say what is wrong with what was written
        if isinstance(value, bool):
            return f"{msg}, not true/false"
        if isinstance(value, float):
            return f"{msg}: a whole number written without a decimal point or exponent"
        if isinstance(value, str):
            if value.strip().lstrip("+-").isdigit():
                return f"{msg}, not text: remove the quotes"
            return f"{msg}, unable to parse string as an integer"
    return msg


def format_errors(errors: list[dict]) -> list[str]:
    grouped: dict[tuple, list[dict]] = {}
    for err in errors:
        loc = tuple(err["loc"])
        if err["type"] == "extra_forbidden":
            grouped.setdefault(loc, []).append(err)
            continue
        path = _field_path(loc)
        grouped.setdefault(path, []).append(err)
    lines = []
    for path, errs in grouped.items():
        first = errs[0]
        dotted = _dotted(path)
        if first["type"] == "extra_forbidden":
            known = _section_keys(path[:-1])
            hint = did_you_mean(str(path[-1]), known) or f"known keys here: {', '.join(known)}"
            lines.append(f"{dotted}: unknown key; {hint}")
        elif first["type"] in ("model_type", "model_attributes_type", "dict_type"):
            lines.append(f"{dotted}: must be a section (a mapping of keys), got {first.get('input')!r}")
        elif first["type"] == "missing":
            lines.append(f"{dotted}: required key is missing; add it to the recipe")
        else:
            msgs = list(dict.fromkeys(_message(e) for e in errs))
            value = first.get("input")
            shown = "a mapping" if isinstance(value, dict) else "a list" if isinstance(value, list) else repr(value)
            text = " or ".join(m[0].lower() + m[1:] for m in msgs)
            if first["type"] == "value_error" and isinstance(value, dict):  # a section's own check: says it all
                key, _, rest = text.partition(": ")  # "key: …" names the section's key it is about
                lines.append(f"{dotted}.{key}: {rest}" if rest and key in _section_keys(path) else f"{dotted}: {text}")
                continue
            lines.append(f"{dotted}: {text} (got {shown})")
    return lines
