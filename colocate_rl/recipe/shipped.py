"""Files shipped with colocate-rl: recipes, DeepSpeed configs and the cluster launch scripts.

In a source checkout they live at the repository root (`recipes/`, `deepspeed_configs/`, `scripts/`); an
installed wheel carries them inside the package (`colocate_rl/_shipped/`).
"""

from __future__ import annotations

import re
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent.parent  # colocate_rl/


def shipped_dir(kind: str) -> Path:
    """`kind` is `recipes`, `deepspeed_configs` or `scripts`."""
    for candidate in (_PACKAGE / "_shipped" / kind, _PACKAGE.parent / kind):
        if candidate.is_dir():
            return candidate
    return _PACKAGE.parent / kind


def shipped_recipes() -> dict[str, Path]:
    """Recipe name (file stem) → path, sorted by name."""
    return {p.stem: p for p in sorted(shipped_dir("recipes").glob("*.yaml"))}


def shipped_deepspeed_configs() -> dict[str, Path]:
    """DeepSpeed config name (file stem) → path."""
    return {p.stem: p for p in sorted(shipped_dir("deepspeed_configs").glob("*.json"))}


def shipped_scripts() -> dict[str, Path]:
    """Launch scripts for clusters (Slurm, several nodes by hand, one node): file name → path."""
    return {p.name: p for p in sorted(shipped_dir("scripts").glob("*")) if p.is_file()}


def recipe_summary(path: Path) -> str:
    """The first sentence of a shipped file's opening comment (a script's `#!` line skipped): what it runs, in one
    line of `colocate-rl recipes`."""
    lines = path.read_text().splitlines()
    start = 1 if lines and lines[0].startswith("#!") else 0
    header = []
    for line in lines[start:]:
        if not line.startswith("#") or not line.strip("# "):
            break
        header.append(line.lstrip("# ").strip())
    text = " ".join(header)
    end = re.search(r"\.(\s|$)", text)
    return text[: end.start() + 1] if end else text


def find_recipe(recipe: str) -> Path:
    """A recipe argument as a path: an existing file, anything that looks like a path, or a shipped recipe's name.
    Fails (UserError) on a name that is neither."""
    from colocate_rl.errors import UserError, did_you_mean

    path = Path(recipe)
    if path.exists() or path.suffix in (".yaml", ".yml") or "/" in recipe:
        return path
    shipped = shipped_recipes()
    if recipe in shipped:
        return shipped[recipe]
    hint = did_you_mean(recipe, shipped)
    raise UserError(f"{recipe}: no such recipe file or shipped recipe; " + (hint or f"shipped: {', '.join(shipped)}"))
