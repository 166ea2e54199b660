"""The RL algorithms a recipe names in `algorithm:`, one declaration per module of this package.

Each module `<name>.py` holds `ALGORITHM = Algorithm(...)`: the TRL trainer it runs on, the TRL config arguments it
presets and what it needs from the recipe. Adding an algorithm is adding one such file. Torch-free: TRL is imported
only by `trainer_classes`, on the ranks.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from colocate_rl.errors import UserError, did_you_mean

# The recipe (colocate_rl.recipe.schema.Recipe) is a higher layer: checks take it as any object with its fields.
Recipe = Any

# TRL's config and trainer class of each trainer kind
TRAINERS = {"grpo": ("GRPOConfig", "GRPOTrainer"), "rloo": ("RLOOConfig", "RLOOTrainer")}


@dataclass(frozen=True)
class Algorithm:
    name: str  # the module's name, as a recipe writes it
    summary: str  # what it changes against TRL's trainer as shipped, one sentence for the recipe guide
    paper: str  # the paper's title
    url: str  # the paper's arXiv page (or, without a paper, the TRL documentation)
    trainer: Literal["grpo", "rloo"]  # TRL's GRPOTrainer/GRPOConfig or RLOOTrainer/RLOOConfig
    preset: Mapping[str, Any] = field(default_factory=dict)  # TRL config arguments; trainer.extra_args overrides
    defining: tuple[str, ...] = ()  # preset keys that make the algorithm what it is: extra_args may not change them
    checks: tuple[Callable[[Recipe], list[str]], ...] = ()  # what it needs from the recipe: error lines naming keys

    @property
    def config_name(self) -> str:
        return TRAINERS[self.trainer][0]

    @property
    def defining_items(self) -> set[tuple[str, Any]]:
        return {(key, self.preset[key]) for key in self.defining}

    def conflict(self, key: str, value: Any) -> str | None:
        """Why `trainer.extra_args.<key>: value` contradicts this algorithm (a defining key set otherwise), or None."""
        if key == "scale_rewards" and isinstance(value, bool):  # TRL reads true/false as "group"/"none"
            value = "group" if value else "none"
        if key not in self.defining or value == self.preset[key]:
            return None
        wanted = {**self.preset, key: value}  # the algorithm that runs as asked, if one does
        others = [a.name for a in registry().values() if key in a.defining and wanted.items() >= a.defining_items]
        fix = f"choose algorithm: {others[0]}" if others else f"choose algorithm: {self.trainer} and set it there"
        return (
            f"trainer.extra_args.{key}: algorithm {self.name} runs with {key} {self.preset[key]!r}, not {value!r}; "
            f"remove the key, or {fix}"
        )

    def problems(self, recipe: Recipe) -> list[str]:
        """What the recipe lacks for this algorithm: one line per problem, naming the key."""
        return [line for check in self.checks for line in check(recipe)]


def _order(name: str) -> tuple[bool, str]:
    return name not in TRAINERS, name


@functools.cache
def registry() -> dict[str, Algorithm]:
    """Every algorithm of this package by name (the `ALGORITHM` of each module not starting with `_`): the trainers as
    TRL ships them (grpo, rloo) first, then by name."""
    found = {}
    modules = sorted((m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")), key=_order)
    for module in modules:
        algorithm = importlib.import_module(f"{__name__}.{module}").ALGORITHM
        if algorithm.name != module or algorithm.trainer not in TRAINERS:
            raise RuntimeError(f"{__name__}.{module}: ALGORITHM must be named {module!r} and run on grpo or rloo")
        found[module] = algorithm
    return found


def check_name(name: str) -> str:
    """`name` when it is a registered algorithm; ValueError with the closest name and the choices otherwise."""
    known = registry()
    if name not in known:
        hint = did_you_mean(name, known)
        choices = ", ".join(known)
        raise ValueError(
            f"unknown algorithm; {hint} (known: {choices})" if hint else f"unknown algorithm; choose one of {choices}"
        )
    return name


def get(name: str) -> Algorithm:
    """The algorithm called `name`. Fails (UserError) for a name no module declares (a run directory written by a
    version that had it)."""
    try:
        return registry()[check_name(name)]
    except ValueError as e:
        raise UserError(f"algorithm: {name!r}: {e}")


def trainer_classes(name: str) -> tuple[type, type]:
    """(TRL config class, TRL trainer class) of algorithm `name`; imports TRL (rank side)."""
    import trl

    config, trainer = TRAINERS[get(name).trainer]
    return getattr(trl, config), getattr(trl, trainer)
