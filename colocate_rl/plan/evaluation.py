"""The `eval:` section checked before launch: its schedule, that the evaluated prompts are held out from training,
and an explicit `eval.source`'s first rows (read by the pre-flight, `colocate_rl.plan.preflight`); how many rows of
the data file training leaves to evaluation. Torch-free; nothing is downloaded (a hub dataset is not opened)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from colocate_rl.data_check import DataSample, inspect_data
from colocate_rl.errors import UserError
from colocate_rl.prompts import DEFAULT_BUILTIN_SIZE, builtin_rows, heldout_builtin_rows, source_kind

if TYPE_CHECKING:
    from colocate_rl.recipe.schema import Recipe

BUILTIN_MAX_EVAL_SAMPLES = 10_000  # held-out prompts of a built-in task (digits has ~16,000 distinct prompts)


def _as_eval_source(lines: list[str]) -> list[str]:
    """inspect_data's lines about data.source, said of eval.source."""
    return [
        "eval.source:" + line.removeprefix("data.source:") if line.startswith("data.source:") else line
        for line in lines
    ]


def held_out_rows(recipe: Recipe) -> int:
    """Rows at the end of a local data.source file that training leaves out, because evaluation holds them out."""
    ev = recipe.eval
    if ev.every_steps is None or ev.source is not None or source_kind(recipe.data.source) != "file":
        return 0
    return ev.num_samples


def check_eval_schedule(recipe: Recipe) -> list[str]:
    """`eval.every_steps` within trainer.max_steps (reads nothing)."""
    every, max_steps = recipe.eval.every_steps, recipe.trainer.max_steps
    if every is None or every <= max_steps:
        return []
    return [
        f"eval.every_steps: {every} is more than trainer.max_steps ({max_steps}). Fix: set at most "
        f"{max_steps} (evaluation also runs after the last step)."
    ]


def check_eval(recipe: Recipe, train: DataSample | None, rewards: Mapping[int, Callable]) -> list[str]:
    """The `eval.*` problems besides its schedule, given what `inspect_data` saw of data.source (`train`; None when
    it was refused or is a hub dataset) and the reward functions that imported (`rewards`: index in recipe.rewards →
    function): eval.source not data.source; a built-in task with eval.num_samples prompts training does not use; a
    local file keeping rows to train on; a hub dataset's eval.split not data.split; an explicit eval.source readable,
    with the prompt column, enough rows and the columns the rewards need (each reward called once on its first
    rows)."""
    ev, data, seed = recipe.eval, recipe.data, recipe.trainer.seed
    if ev.every_steps is None:
        return []
    problems, n = [], ev.num_samples
    source = ev.source if ev.source is not None else data.source
    kind = source_kind(source)
    if kind == "builtin" and n > BUILTIN_MAX_EVAL_SAMPLES:
        return [*problems, f"eval.num_samples: {n} prompts of {source}. Fix: use at most {BUILTIN_MAX_EVAL_SAMPLES}."]
    if ev.source is not None and ev.source.strip() == data.source.strip():
        problems.append(
            "eval.source: is data.source, so evaluation would score prompts training uses. Fix: remove eval.source "
            "(null holds out part of data.source) or name other prompts."
        )
    elif ev.source is None and kind == "builtin":
        if train is not None:  # else data.source is refused already
            task = source.removeprefix("builtin:")
            training = [r["prompt"] for r in builtin_rows(task, data.num_samples or DEFAULT_BUILTIN_SIZE, seed)]
            try:
                heldout_builtin_rows(task, n, seed, training)
            except UserError as e:
                problems += e.lines
    elif ev.source is None and kind == "file":
        total = train.total if train is not None else None  # None: a file larger than validation reads
        if total is not None and total <= n:
            problems.append(
                f"eval.num_samples: the last {n} rows of '{source}' are held out for evaluation, which leaves none of "
                f"its {total} rows to train on. Fix: lower eval.num_samples or set eval.source."
            )
        elif total is not None and data.num_samples is not None and data.num_samples > total - n:
            problems.append(
                f"data.num_samples: {data.num_samples} but '{source}' has {total} rows and its last {n} are held out "
                f"for evaluation (eval.num_samples). Fix: set it to at most {total - n}, or lower eval.num_samples."
            )
    elif ev.source is None and ev.split == data.split:
        problems.append(
            f"eval.split: '{ev.split}' is data.split, so evaluation would score prompts training uses. Fix: set "
            f"eval.split to a held-out split of '{source}' (such as test), or set eval.source."
        )
    elif ev.source is not None:
        try:
            sample = inspect_data(
                ev.source, prompt_field=data.prompt_field, chat=data.chat, system_prompt=data.system_prompt
            )
            if kind == "builtin":
                heldout_builtin_rows(source.removeprefix("builtin:"), n, seed)
        except UserError as e:
            return problems + _as_eval_source(e.lines)
        if sample is not None and sample.total is not None and n > sample.total and kind == "file":
            problems.append(
                f"eval.num_samples: {n} but '{ev.source}' has {sample.total} rows. Fix: set it to at most "
                f"{sample.total}, or add rows."
            )
        if sample is not None:
            problems += _check_rewards_on(recipe, sample, rewards)
    return problems


def _check_rewards_on(recipe: Recipe, sample: DataSample, rewards: Mapping[int, Callable]) -> list[str]:
    """Each reward function finds its columns in eval.source and returns a number per completion on its first rows
    (a reward that does not import is reported by the data.source checks, not again here)."""
    from colocate_rl.data_check import check_reward_on_sample
    from colocate_rl.rewards import reward_columns

    problems = []
    for i, fn in rewards.items():
        reward = recipe.rewards[i]
        missing = [c for c in reward_columns(reward.name) if c not in sample.columns]
        if missing:
            problems.append(
                f"eval.source: '{sample.source}' has no column {', '.join(missing)}, which rewards[{i}].name "
                f"{reward.name} needs (it has {', '.join(sample.columns)}). Fix: evaluate on prompts with that column."
            )
            continue
        try:
            check_reward_on_sample(fn, reward.name, sample, key="eval.source", chat=recipe.data.chat)
        except UserError as e:
            problems += e.lines
    return problems
