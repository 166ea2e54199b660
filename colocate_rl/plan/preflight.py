"""The pre-flight: everything a command reads of the files and code a recipe names, read once.

`preflight(recipe)` reads the model's config.json (a local directory's; a built-in's layout), the data file's first
rows, each reward model's config.json (a hub one's fetched, config only), builds the model on the meta device to
check LoRA target names, imports every reward module or file and calls each reward function once on a sample
completion, imports every tool and builds one environment (`colocate_rl.plan.tools`) (again once per row sample of an explicit `eval.source`). It writes nothing and downloads nothing else (a
hub dataset is not opened; a hub model's own config is fetched only by the memory estimate, once per process). Its
result is frozen: binding to a host, choosing the `auto` values, estimating and recommending are pure functions of
it and the recipe (`colocate_rl.plan.resolve`, `colocate_rl.memory`), so a command that plans many variants of one
recipe (`mem-probe --estimate`) reads and runs the user's code once. Problems are collected, not raised: the binding
raises them together with its own. Reward code runs under `colocate_rl.rewards.time_limit` (SIGALRM in the main
thread): an import or a sample call that does not return in time is a problem line, as is one that calls sys.exit().
What only a launch needs (`launch_problems`: a local model's tokenizer and weights; a hub model or dataset when the
hub cannot be reached and the cache lacks it) is kept apart: planning for another machine or estimating needs none.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from colocate_rl.builtin_model import LAYOUTS, builtin_layout
from colocate_rl.data_check import DataSample
from colocate_rl.errors import UserError
from colocate_rl.model_config import (
    TOKENIZER_FILES,
    gguf_problem,
    has_chat_template,
    hub_model_problems,
    model_files_problems,
    model_type_problem,
)
from colocate_rl.plan.evaluation import check_eval
from colocate_rl.plan.lora import check_lora_targets
from colocate_rl.plan.tools import check_tools
from colocate_rl.prompt_length import LongestPrompt, longest_prompt
from colocate_rl.recipe.schema import Recipe


def _reads(recipe: Recipe) -> str:
    """The parts of `recipe` the pre-flight reads, as one comparable string."""
    parts = {
        "model": recipe.model.model_dump(mode="json", include={"name", "lora", "chat_template"}),
        "tools": recipe.tools.model_dump(mode="json", include={"functions", "environment"}),
        "data": recipe.data.model_dump(mode="json"),
        "rewards": [r.model_dump(mode="json") for r in recipe.rewards],
        "eval": recipe.eval.model_dump(mode="json"),
        "seed": recipe.trainer.seed,
        "trust_remote_code": recipe.trainer.extra_args.get("trust_remote_code"),
    }
    return json.dumps(parts, sort_keys=True, default=str)


@dataclass(frozen=True)
class Preflight:
    """What the recipe's files and code said, read once."""

    reads: str  # the recipe parts it was read for (`matches`)
    builtin_layout: str | None  # model.name is builtin:<layout>
    model_config: dict[str, Any] | None  # a built-in's or local directory's config.json; None for a hub model
    reward_model_configs: Mapping[str, dict[str, Any]]  # rewards[*].model → its config.json
    sample: DataSample | None  # data.source's first rows; None for a hub dataset or data that was refused
    problems: tuple[str, ...] = ()  # model, data and reward lines, in that order
    eval_problems: tuple[str, ...] = ()  # the eval section's (besides its schedule)
    launch_problems: tuple[str, ...] = ()  # what the ranks would miss on this machine (see the module docstring)
    # the data's longest prompt: measured (`longest_prompt`) only when asked for, by a plan for GPUs (~5 s)
    measure_prompt: Callable[[], LongestPrompt | None] = field(default=lambda: None, compare=False, repr=False)

    @functools.cached_property
    def longest_prompt(self) -> LongestPrompt | None:
        """The data's longest prompt in tokens where it can be measured here (`colocate_rl.prompt_length`)."""
        return self.measure_prompt()

    def matches(self, recipe: Recipe) -> bool:
        """Whether this pre-flight read what `recipe` names (a variant that changes only other keys reuses it)."""
        return self.reads == _reads(recipe)


def _check_model(recipe: Recipe) -> tuple[str | None, dict[str, Any] | None, list[str]]:
    """(built-in layout, config.json, problems) of model.name; a hub model's config is not fetched here."""
    name = recipe.model.name
    try:
        layout = builtin_layout(name)
    except UserError as e:
        return None, None, e.lines
    if layout is not None:
        return layout, {"model_type": "qwen2", **LAYOUTS[layout]}, []
    gguf = gguf_problem(name, "model.name")
    if gguf:
        return None, None, [gguf]
    path = Path(name).expanduser()
    local = name.startswith((".", "/", "~")) or os.path.exists(path)  # never raises, unlike Path.exists
    config = path / "config.json"
    if local and not os.path.lexists(config):
        return (
            None,
            None,
            [
                f"model.name: '{name}' is not a model directory (no config.json); "
                "give a local model directory, a hub id, or builtin:tiny"
            ],
        )
    if local:
        data, problems = _read_model_config(config)
        trust = recipe.trainer.extra_args.get("trust_remote_code") is True
        problem = data and model_type_problem(data, str(config), "model.name", trust)
        return (None, None, [problem]) if problem else (None, data, problems)
    return None, None, []


def _launch_problems(recipe: Recipe, layout: str | None, config: dict[str, Any] | None, model_ok: bool) -> list[str]:
    """What the ranks would miss here: a local model's tokenizer and weights (once its config.json was read), a hub
    model or hub dataset (data.source, eval.source) that cannot be fetched and is not cached."""
    from colocate_rl.data_check import hub_dataset_problem

    name, problems = recipe.model.name, []
    if model_ok and layout is None:
        local = config is not None
        folder = Path(name).expanduser()
        problems += model_files_problems(folder, f"'{name}'", "model.name") if local else []
        tokenizer = local and any((folder / f).is_file() for f in TOKENIZER_FILES)  # else named above
        if tokenizer and recipe.data.chat and recipe.model.chat_template is None and not has_chat_template(folder):
            problems.append(
                f"model.name: '{name}' has no chat template and data.chat is true; TRL formats every prompt with the "
                "model's chat template: set model.chat_template (a .jinja file), add one to the tokenizer "
                "(chat_template.jinja), or set data.chat: false"
            )
        problems += hub_model_problems(name, "model.name") if not local else []
    for source, key in ((recipe.data.source, "data.source"), (recipe.eval.source, "eval.source")):
        problem = source and hub_dataset_problem(source, key)
        if problem:
            problems.append(problem)
    return problems


def _read_model_config(config: Path) -> tuple[dict[str, Any] | None, list[str]]:
    """A local model's config.json, read as transformers reads it: a JSON object naming its `model_type`."""
    from colocate_rl.recipe.load import read_text_file

    fix = "fix the file, or point model.name at a complete model directory"
    try:
        data = json.loads(read_text_file(config, "model config", limit=16 << 20))
    except UserError as e:
        return None, [f"model.name: {line}" for line in e.lines]
    except json.JSONDecodeError as e:
        return None, [f"model.name: {config}:{e.lineno}:{e.colno}: invalid JSON ({e.msg}); {fix}"]
    if not isinstance(data, dict):
        kind = "a list" if isinstance(data, list) else "text" if isinstance(data, str) else repr(data)
        return None, [f"model.name: {config} holds {kind}, not a JSON object; {fix}"]
    if not isinstance(data.get("model_type"), str) or not data["model_type"]:
        return None, [
            f"model.name: {config} names no model_type (transformers needs it to pick the model class); {fix}"
        ]
    return data, []


def _check_data(recipe: Recipe) -> tuple[DataSample | None, list[str]]:
    """The prompts' first rows as the ranks will load them (None for a hub dataset, not opened before launch)."""
    from colocate_rl.data_check import inspect_data

    data = recipe.data
    try:
        sample = inspect_data(
            data.source,
            prompt_field=data.prompt_field,
            chat=data.chat,
            system_prompt=data.system_prompt,
            num_samples=data.num_samples,
            seed=recipe.trainer.seed,
        )
    except UserError as e:
        return None, e.lines
    return sample, []


def _check_rewards(
    recipe: Recipe, sample: DataSample | None, environment: Callable | None = None
) -> tuple[dict[int, Callable], dict[str, dict[str, Any]], list[str]]:
    """(the reward functions that imported by index, reward models' configs, problems). Every reward function
    imports, finds the columns it needs in the data, and returns one number per completion when called once on a
    sample completion of the data's first rows (not for a hub dataset, which is not opened); every reward model is a
    one-label sequence classifier (its config read, the model not loaded)."""
    from colocate_rl.data_check import check_reward_on_sample
    from colocate_rl.model_config import check_reward_model
    from colocate_rl.rewards import is_async, resolve_reward, reward_columns, time_limit

    functions, configs, problems = {}, {}, []
    if not recipe.rewards and recipe.tools.environment is None:
        problems.append(
            "rewards: none given; add one (e.g. rewards: [{name: answer_match}]), or score episodes with a "
            "tools.environment whose class has get_reward()"
        )
    for i, reward in enumerate(recipe.rewards):
        if reward.model is not None:
            try:
                configs[reward.model] = check_reward_model(
                    reward.model, key=f"rewards[{i}].model", chat=recipe.data.chat
                )
            except UserError as e:
                problems.extend(e.lines)
            continue
        key = f"rewards[{i}].name"
        try:
            with time_limit(key, f"importing reward '{reward.name}'"):
                fn = functions[i] = resolve_reward(reward.name, key=key)
        except UserError as e:
            problems.extend(e.lines)
            continue
        if reward.processes not in ("auto", 1) and is_async(fn):
            problems.append(
                f"rewards[{i}].processes: {reward.name} is async (it awaits, e.g. a judge's answers) and runs on the "
                "trainer's event loop; drop processes"
            )
        if sample is None:
            continue
        missing = [c for c in reward_columns(reward.name) if c not in sample.columns]
        if missing:
            problems.append(
                f"{key}: {reward.name} needs the column(s) {', '.join(missing)} and data.source "
                f"'{recipe.data.source}' has only {', '.join(sample.columns)}; use data with an {missing[0]} column "
                "(e.g. builtin:arithmetic) or another reward"
            )
            continue
        try:
            check_reward_on_sample(
                fn,
                reward.name,
                sample,
                key=key,
                chat=recipe.data.chat,
                max_steps=recipe.trainer.max_steps,
                environment=environment,
            )
        except UserError as e:
            problems.extend(e.lines)
    return functions, configs, problems


def preflight(recipe: Recipe) -> Preflight:
    """Read what `recipe` names and run its reward code, once (see the module docstring). Never raises UserError:
    the problems travel in the result."""
    layout, config, model_problems = _check_model(recipe)
    model_problems = model_problems or check_lora_targets(recipe, config)
    sample, data_problems = _check_data(recipe)
    tool_problems, environment = check_tools(recipe, layout) if not model_problems else ([], None)
    functions, reward_configs, reward_problems = _check_rewards(recipe, sample, environment)
    return Preflight(
        reads=_reads(recipe),
        builtin_layout=layout,
        model_config=config,
        reward_model_configs=reward_configs,
        sample=sample,
        problems=(*model_problems, *data_problems, *reward_problems, *tool_problems),
        eval_problems=tuple(check_eval(recipe, sample, functions)),
        launch_problems=tuple(_launch_problems(recipe, layout, config, not model_problems)),
        measure_prompt=(
            functools.partial(longest_prompt, recipe, recipe.model.name, layout)
            if config is not None and not model_problems and not data_problems
            else lambda: None
        ),
    )
