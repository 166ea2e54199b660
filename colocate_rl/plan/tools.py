"""The `tools:` section and `model.chat_template` checked before launch (part of the pre-flight, which runs user code
once): every tool imports and has the schema TRL renders, the environment factory builds an environment with
`reset` and schema'd methods, the names are unique, and the chat template renders a tool-calling conversation in a
form TRL can parse. Problems are returned as lines naming the key; nothing is raised.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Callable
from pathlib import Path

from colocate_rl import algorithms
from colocate_rl.errors import UserError, hint_suffix, one_line
from colocate_rl.recipe.schema import Recipe

# Relied on: trl 1.16's `add_response_schema` parses the tool calls of exactly these templates it ships, recognised
# by their text (tests/test_tools.py checks this list against TRL itself); a tokenizer that already carries a
# `response_template` or `response_schema` is parsed by it instead.
TRL_PARSED_TEMPLATES = (
    "deepseek_r1_distill",
    "gemma4",
    "gemma4_v2",
    "gemma4_v3",
    "gemma4_v4",
    "gemma4_v5",
    "glm4moe",
    "gptoss",
    "lfm2_2_5",
    "lfm2_2_5_v2",
    "lfm2_2_5_vl",
    "lfm2_v2",
    "llama3_1",
    "llama3_2",
    "nemotron_3_5_lightning",
    "nemotron_3_nano",
    "nemotron_3_super",
    "nemotron_3_ultra",
    "qwen2_5",
    "qwen3",
    "qwen3_5_nothink",
    "qwen3_5_think",
    "qwen3_6",
    "qwen3_8",
    "qwen3_instruct_2507",
    "qwen3_vl",
)
TEMPLATE_KEY = "model.chat_template"


def trl_templates_dir() -> Path:
    """The chat templates TRL ships (found without importing TRL)."""
    spec = importlib.util.find_spec("trl")
    return Path(next(iter(spec.submodule_search_locations))) / "chat_templates"


def read_chat_template(value: str) -> str:
    """The text `model.chat_template` names: a `.jinja` file, or a template TRL ships by name. UserError naming the
    key when neither reads."""
    if value.endswith(".jinja") or os.sep in value or "/" in value:
        path = Path(value).expanduser()
        try:
            return path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"{TEMPLATE_KEY}: cannot read '{value}' ({one_line(e)}); fix the path") from None
    names = sorted(p.stem for p in trl_templates_dir().glob("*.jinja"))
    if value not in names:
        raise UserError(
            f"{TEMPLATE_KEY}: '{value}' is neither a .jinja file nor a template TRL ships{hint_suffix(value, names)}; "
            f"TRL parses the tool calls of: {', '.join(TRL_PARSED_TEMPLATES)}"
        )
    return (trl_templates_dir() / f"{value}.jinja").read_text()


def _model_template(recipe: Recipe, layout: str | None) -> tuple[str | None, dict]:
    """(chat template text, tokenizer_config.json) of the recipe's model as the ranks will see it; None where it is
    not known before launch (a hub model: TRL checks it on the ranks)."""
    if recipe.model.chat_template is not None:
        return read_chat_template(recipe.model.chat_template), {}
    if layout is not None:
        from colocate_rl.builtin_model import layout_chat_template

        return layout_chat_template(layout), {}
    path = Path(recipe.model.name).expanduser()
    try:
        config = json.loads((path / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        config = {}
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if template is None and (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()
    return template if isinstance(template, str) else None, config


def template_problems(template: str, tokenizer_config: dict, tools: list[Callable]) -> list[str]:
    """Whether `template` renders a user → assistant tool call → tool result conversation with `tools`, keeping the
    call's name and arguments and the result (TRL's `supports_tool_calling` test), and TRL can parse the calls."""
    from transformers.utils import get_json_schema
    from transformers.utils.chat_template_utils import render_jinja_template

    call = {"type": "function", "function": {"name": "tool_name_a8f3", "arguments": {"arg_key_b9d4": "arg_val_d6e7"}}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "tool_name_a8f3", "content": "tool_content_c4f9"},
    ]
    special = {"bos_token": "", "eos_token": ""}  # what templates may name; the model's own where it says
    special.update({k: v for k, v in tokenizer_config.items() if k in special and isinstance(v, str)})
    fix = f"set {TEMPLATE_KEY} to a template that supports tools, e.g. qwen2_5 (for ChatML models such as SmolLM2)"
    try:
        rendered, _ = render_jinja_template(
            conversations=[messages], tools=[get_json_schema(t) for t in tools], chat_template=template, **special
        )
    except Exception as e:  # the template's own error (a role it refuses, content it indexes)
        return [f"{TEMPLATE_KEY}: the model's chat template cannot render tool calls ({one_line(e)}); {fix}"]
    if not all(s in rendered[0] for s in ("tool_name_a8f3", "arg_key_b9d4", "arg_val_d6e7", "tool_content_c4f9")):
        return [f"{TEMPLATE_KEY}: the model's chat template drops tool calls or tool results; {fix}"]
    known = {(trl_templates_dir() / f"{n}.jinja").read_text() for n in TRL_PARSED_TEMPLATES}
    if template not in known and not ({"response_template", "response_schema"} & set(tokenizer_config)):
        return [f"{TEMPLATE_KEY}: TRL cannot parse tool calls in this chat template (it knows its own by name); {fix}"]
    return []


def check_tools(recipe: Recipe, layout: str | None) -> tuple[list[str], Callable | None]:
    """Every problem of the `tools:` section and of `model.chat_template` (see the module docstring), and the
    environment factory when it built an environment (the rewards' sample call gets environments too). Imports the
    tool and environment code and builds one environment, under the pre-flight's time limit."""
    problems, factory = _tool_problems(recipe, layout)
    return problems, (factory if not problems else None)


def _tool_problems(recipe: Recipe, layout: str | None) -> tuple[list[str], Callable | None]:
    from colocate_rl.rewards import time_limit
    from colocate_rl.tools import environment_tools, resolve_environment, resolve_tool, schema_problem

    section, problems, factory = recipe.tools, [], None
    if not section.active:
        if recipe.model.chat_template is not None:
            try:
                read_chat_template(recipe.model.chat_template)
            except UserError as e:
                problems += e.lines
        return problems, None
    if not recipe.data.chat:
        problems.append("tools: tool calls are chat messages; set data.chat: true (or drop tools)")
    if algorithms.get(recipe.algorithm).trainer != "grpo":
        problems.append(
            f"tools: algorithm {recipe.algorithm} runs TRL's RLOOTrainer, which has no tool loop; use grpo or one of "
            "the GRPO variants (dapo, dr_grpo, gspo, ...)"
        )
    tools: list[Callable] = []
    for i, name in enumerate(section.functions):
        key = f"tools.functions[{i}]"
        try:
            with time_limit(key, f"importing tool '{name}'"):
                fn = resolve_tool(name, key=key)
        except UserError as e:
            problems += e.lines
            continue
        problem = schema_problem(fn, key)
        problems += [problem] if problem else []
        tools += [] if problem else [fn]
    if section.environment is not None:
        key = "tools.environment"
        try:
            with time_limit(key, f"importing and building environment '{section.environment}'"):
                factory = resolve_environment(section.environment, key=key)
                try:
                    environment = factory()
                except Exception as e:
                    raise UserError(f"{key}: building an environment failed: {one_line(e)}; fix the factory") from e
        except UserError as e:
            return problems + e.lines, None
        if not callable(getattr(environment, "reset", None)):
            problems.append(f"{key}: {type(environment).__name__} has no reset method; TRL starts each episode with it")
        if not recipe.rewards and not callable(getattr(environment, "get_reward", None)):
            problems.append(
                f"rewards: none given and tools.environment's {type(environment).__name__} has no get_reward(); "
                "add a reward under rewards: or a get_reward() method that scores the episode"
            )
        for method in environment_tools(environment):
            problem = schema_problem(method, key)
            problems += [problem] if problem else []
            tools += [] if problem else [method]
    names = [t.__name__ for t in tools]
    for name in sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"tools: two tools are named '{name}'; the model calls a tool by name, so rename one")
    if not problems and tools:
        try:
            template, config = _model_template(recipe, layout)
        except UserError as e:
            return problems + e.lines, factory
        if template is not None:
            problems += template_problems(template, config, tools)
    return problems, factory


def check_tool_layout(recipe: Recipe, backend: str, nproc: int, deepspeed: dict | None) -> list[str]:
    """Layouts whose generation is a collective across ranks, which a tool loop cannot be: each rank runs another
    number of turns (only the episodes that called a tool go on), so ranks would wait on each other forever."""
    from colocate_rl.plan.deepspeed import ZeroLayout

    if not recipe.tools.active:
        return []
    problems = []
    if backend == "transformers" and nproc * recipe.distributed.nnodes > 1 and ZeroLayout.of(deepspeed).stage == 3:
        problems.append(
            "tools: with the transformers backend, ZeRO-3 gathers the weights on every rank at every generation, "
            "and ranks run different numbers of tool turns; use distributed.deepspeed: null (DDP) or ZeRO-1/2"
        )
    if recipe.generation.tensor_parallel_size > 1:
        problems.append(
            "tools: generation.tensor_parallel_size > 1 generates for a rank group together, and ranks run different "
            "numbers of tool turns; use tensor_parallel_size: 1"
        )
    return problems
