"""Files shipped with colocate-rl: recipes and DeepSpeed configs.

In a source checkout they live at the repository root (`recipes/`, `deepspeed_configs/`); an
installed wheel carries them inside the package (`colocate_rl/_shipped/`).
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent.parent  # colocate_rl/


def shipped_dir(kind: str) -> Path:
    """`kind` is `recipes` or `deepspeed_configs`."""
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


def recipe_summary(path: Path) -> str:
    """The first comment line of a recipe file (its one-line description)."""
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
    return ""
