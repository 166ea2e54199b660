"""Value types and parsers the recipe's sections share: sizes, whole numbers, seeds, Hub repo ids."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import NonNegativeInt, PositiveInt, Strict

SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}


def parse_size(value: int | str) -> int:
    """Bytes from an int or a size string such as `12GiB`, `512 MiB`, `8e9`. Raises ValueError otherwise."""
    if isinstance(value, bool):
        raise ValueError("expected a size such as 12GiB")
    if isinstance(value, (int, float)):
        size = float(value)
    elif not isinstance(value, str):
        raise ValueError("expected bytes or a size such as 12GiB, 512MiB, 20GB")
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in SIZE_UNITS:
            raise ValueError("expected bytes or a size such as 12GiB, 512MiB, 20GB")
        size = float(match.group(1)) * SIZE_UNITS[unit]
    if size < 1:
        raise ValueError("must be a positive size")
    return int(size)


# Whole numbers as written: pydantic alone would take 8.0, 1.0e+9 or "8" for an int and true for 1.
Count = Annotated[PositiveInt, Strict()]
Index = Annotated[NonNegativeInt, Strict()]
MAX_STEPS = 10_000_000  # trainer.max_steps: months at a second a step; 10**30 would only train without end
SEED_MAX = 2**32 - 1  # numpy's seeding (transformers' set_seed) takes 0 … 2**32 - 1
# A Hub repo id as huggingface_hub's validate_repo_id takes it: `name` or `owner/name`, each part 1-96 letters, digits,
# '-', '_' and '.' that starts and ends with a letter, digit or '_'; no '--' or '..', no '.git' at the end.
_HUB_PART = r"\w(?:[\w.-]{0,94}\w)?"
HUB_REPO_ID = re.compile(rf"(?:{_HUB_PART}/)?{_HUB_PART}", re.ASCII)


def whole(value: Any) -> Any:
    """A number as written for a choice of whole numbers (`sleep_level`, `zero_stage`): true or 2.0 is refused."""
    if isinstance(value, (bool, float)):
        raise ValueError(f"must be written as a whole number such as 2, not {str(value).lower()}")
    return value


def some_modules(value: Any) -> Any:
    """`model.lora.target_modules` as written: an empty list would adapt nothing (PEFT refuses it on every rank)."""
    if isinstance(value, list) and not value:
        raise ValueError("an empty list adapts nothing; name the modules (such as q_proj, v_proj) or write all-linear")
    return value


def check_repo_id(value: Any) -> None:
    """Raise ValueError unless `value` is a Hub repo id (`output.push_to_hub`)."""
    if isinstance(value, bool):
        raise ValueError("must name the repo to push to, such as your-name/my-model")
    if not isinstance(value, str) or not HUB_REPO_ID.fullmatch(value) or "--" in value or ".." in value:
        raise ValueError(
            "must be a Hub repo id such as your-name/my-model or my-model (letters, digits, '-', '_' and '.'; "
            "at most 96 characters a part)"
        )
    if value.endswith(".git"):
        raise ValueError("must not end in .git: give the repo id, such as your-name/my-model")
