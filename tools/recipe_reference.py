#!/usr/bin/env python3
"""Rewrite the recipe reference table and the algorithms table in docs/guide/recipes.md from the code (tests fail when
either is stale)."""

from pathlib import Path

from colocate_rl.recipe.reference import (
    ALGORITHMS_BEGIN,
    ALGORITHMS_END,
    BEGIN,
    END,
    algorithms_table,
    recipe_reference,
)

target = Path(__file__).resolve().parent.parent / "docs" / "guide" / "recipes.md"
text = target.read_text()
for begin, end, table in ((BEGIN, END, recipe_reference), (ALGORITHMS_BEGIN, ALGORITHMS_END, algorithms_table)):
    if begin not in text or end not in text:
        raise SystemExit(f"{target}: add the markers {begin!r} and {end!r} where the table goes")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    text = head + table() + tail
target.write_text(text)
print(f"updated {target}")
