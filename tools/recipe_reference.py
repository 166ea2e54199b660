#!/usr/bin/env python3
"""Rewrite the recipe reference table in docs/guide/recipes.md from the schema (tests fail when it is stale)."""

from pathlib import Path

from colocate_rl.recipe.reference import BEGIN, END, recipe_reference

target = Path(__file__).resolve().parent.parent / "docs" / "guide" / "recipes.md"
text = target.read_text()
if BEGIN not in text or END not in text:
    raise SystemExit(f"{target}: add the markers {BEGIN!r} and {END!r} where the table goes")
head, rest = text.split(BEGIN, 1)
_, tail = rest.split(END, 1)
target.write_text(head + recipe_reference() + tail)
print(f"updated {target}")
