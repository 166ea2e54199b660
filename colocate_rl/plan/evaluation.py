"""The `eval:` section checked before launch: its schedule, that the evaluated prompts are held out from training,
and an explicit `eval.source`'s first rows. Torch-free; nothing is downloaded (a hub dataset is not opened)."""

from __future__ import annotations

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


def check_eval(recipe: Recipe, train: DataSample | None) -> list[str]:
    """The `eval.*` problems, given what `inspect_data` saw of data.source (`train`; None when it was refused or is
    a hub dataset): every_steps within trainer.max_steps; eval.source not data.source; a built-in task with
    eval.num_samples prompts training does not use; a local file keeping rows to train on; a hub dataset's
    eval.split not data.split; an explicit eval.source readable, with the prompt column, enough rows and the columns
    the rewards need (each reward called once on its first rows)."""
    ev, data, seed = recipe.eval, recipe.data, recipe.trainer.seed
    if ev.every_steps is None:
        return []
    problems, n, max_steps = [], ev.num_samples, recipe.trainer.max_steps
    if ev.every_steps > max_steps:
        problems.append(
            f"eval.every_steps: {ev.every_steps} is more than trainer.max_steps ({max_steps}). Fix: set at most "
            f"{max_steps} (evaluation also runs after the last step)."
        )
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
            problems += _check_rewards_on(recipe, sample)
    return problems


def _check_rewards_on(recipe: Recipe, sample: DataSample) -> list[str]:
    """Each reward function finds its columns in eval.source and returns a number per completion on its first rows
    (a reward that does not import is reported by the data.source checks, not again here)."""
    from colocate_rl.data_check import check_reward_on_sample
    from colocate_rl.rewards import resolve_reward, reward_columns

    problems = []
    for i, reward in enumerate(recipe.rewards):
        if getattr(reward, "model", None) is not None:  # a reward model scores any text
            continue
        try:
            fn = resolve_reward(reward.name, key=f"rewards[{i}].name")
        except UserError:
            continue
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
