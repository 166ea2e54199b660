"""Two frictions of recipes on the command line: relative paths start from the recipe file's directory (`--set`
values from the current one) and are absolute from then on; `--set` reads a text key's value as the text typed."""

import json
import os
from datetime import datetime
from pathlib import Path

import pytest
import yaml
from conftest import assert_user_error, cli_here, write_recipe

from colocate_rl.errors import UserError
from colocate_rl.pipeline import load_resolved, plan_run
from colocate_rl.plan.host import planning_host
from colocate_rl.prompts import FILE_KINDS
from colocate_rl.recipe.load import format_sets, load_recipe, parse_sets, read_yaml, write_recipe_copy
from colocate_rl.recipe.paths import DATA_FILE_SUFFIXES, resolve_override_paths, resolve_paths
from colocate_rl.recipe.shipped import shipped_recipes

REWARD = "def score(prompts, completions, **kwargs):\n    return [float(len(c)) for c in completions]\n"
SMALL = {"max_steps": 2, "num_generations": 2, "per_device_train_batch_size": 2, "max_completion_length": 8}


def same(a, b) -> bool:
    """Equal values of equal types (1, 1.0 and true differ)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


# ---------------------------------------------------------------------------------------------- --set


@pytest.mark.parametrize(
    "item, key, value",
    [
        ("data.system_prompt=Answer: think step by step", "data.system_prompt", "Answer: think step by step"),
        ("data.system_prompt=# heading", "data.system_prompt", "# heading"),
        ("data.system_prompt=yes", "data.system_prompt", "yes"),
        ("data.system_prompt= [spaced] ", "data.system_prompt", " [spaced] "),
        ("data.system_prompt=null", "data.system_prompt", None),
        ("data.system_prompt=", "data.system_prompt", ""),
        ("model.name=Qwen/Qwen2.5-0.5B", "model.name", "Qwen/Qwen2.5-0.5B"),
        ("distributed.rdzv_id=0123", "distributed.rdzv_id", "0123"),  # text: the leading zero stays
        ("distributed.deepspeed=null", "distributed.deepspeed", None),
        ("eval.split=no", "eval.split", "no"),
        ("model.dtype=float32", "model.dtype", "float32"),  # a choice of strings is text too
        ("trainer.learning_rate=1e-5", "trainer.learning_rate", 1e-5),
        ("trainer.learning_rate=3.0E-6", "trainer.learning_rate", 3e-6),
        ("trainer.max_steps=20", "trainer.max_steps", 20),
        ("generation.check_weights=false", "generation.check_weights", False),
        ("distributed.zero_stage=auto", "distributed.zero_stage", "auto"),
        ("distributed.zero_stage=2", "distributed.zero_stage", 2),
        ("trainer.extra_args={top_p: 0.9}", "trainer.extra_args", {"top_p": 0.9}),
        ("trainer.extra_args={epsilon: 1e-4, tag: 'yes'}", "trainer.extra_args", {"epsilon": 1e-4, "tag": "yes"}),
        ("trainer.extra_args.scale_rewards=none", "trainer.extra_args.scale_rewards", "none"),
        (
            "distributed.deepspeed_overrides={zero_optimization: {stage: 2}}",
            "distributed.deepspeed_overrides",
            {"zero_optimization": {"stage": 2}},
        ),
        ("output.report_to=[tensorboard]", "output.report_to", ["tensorboard"]),
        ("model.lora=true", "model.lora", True),
    ],
)
def test_set_reads_text_keys_as_typed_and_other_keys_as_yaml(item, key, value):
    got = parse_sets([item])[key]
    assert same(got, value), got
    assert same(parse_sets(format_sets({key: got}))[key], got)  # and back: format_sets is exact


def test_set_values_pass_the_schema(tmp_path):
    sets = [
        "data.system_prompt=Answer: think step by step",
        "trainer.learning_rate=1e-5",
        "trainer.extra_args={top_p: 0.9}",
        "model.name=Qwen/Qwen2.5-0.5B",
        "name=yes",
    ]
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", {"rewards": [{"name": "digit_share"}]}), parse_sets(sets))
    assert recipe.data.system_prompt == "Answer: think step by step" and recipe.trainer.learning_rate == 1e-5
    assert recipe.trainer.extra_args == {"top_p": 0.9} and recipe.model.name == "Qwen/Qwen2.5-0.5B"
    assert recipe.name == "yes"


def test_set_str_is_always_text_and_comes_after_every_set():
    overrides = parse_sets(
        ["data.system_prompt=first", "trainer.max_steps=3"],
        ["data.system_prompt=null", "trainer.extra_args.tag=yes"],
    )
    assert overrides == {"trainer.max_steps": 3, "data.system_prompt": "null", "trainer.extra_args.tag": "yes"}
    assert list(overrides) == ["trainer.max_steps", "data.system_prompt", "trainer.extra_args.tag"]
    with pytest.raises(UserError, match="^--set-str 'nokey': expected KEY=VALUE"):
        parse_sets([], ["nokey"])


def test_format_sets_is_exact_or_says_why_not():
    overrides = {
        "trainer.extra_args.tag": "yes",  # text in a key that is read as YAML: quoted
        "trainer.extra_args.eps": "1e-4",  # text that --set would read as a number: quoted
        "trainer.extra_args.nested": {"a": "1e-4", "b": 1e-4, "c": [True, "true", None]},
        "trainer.learning_rate": 1e-5,
        "generation.vllm_gpu_memory_utilization": 0.3,
        "data.system_prompt": "multi\nline: with # and 'quotes'",
        "checkpoint.every_steps": None,
    }
    assert same(parse_sets(format_sets(overrides)), overrides)
    assert list(parse_sets(format_sets(overrides))) == list(overrides)
    # the text null of a text key, and text in quotes: quoted once more
    for text in ("null", '"quoted"', "'single'"):
        assert parse_sets(format_sets({"data.system_prompt": text})) == {"data.system_prompt": text}
    # a text key's value in quotes is the text inside (as a recipe file reads it)
    assert parse_sets(['distributed.deepspeed="zero3"', "data.system_prompt='null'"]) == {
        "distributed.deepspeed": "zero3",
        "data.system_prompt": "null",
    }


# ---------------------------------------------------------------------------------------------- paths


@pytest.fixture
def project(tmp_path, monkeypatch):
    """configs/ holds a recipe and its files; the command runs in work/, elsewhere."""
    configs, work = tmp_path / "configs", tmp_path / "work"
    for d in (configs / "data", configs / "rewards", configs / "models" / "m", work):
        d.mkdir(parents=True)
    (configs / "data" / "train.jsonl").write_text('{"prompt": "Count to 3."}\n{"prompt": "Count to 4."}\n')
    (configs / "rewards" / "mine.py").write_text(REWARD)
    (configs / "ds.json").write_text('{"zero_optimization": {"stage": 2}}')
    (configs / "models" / "m" / "config.json").write_text('{"model_type": "qwen2"}')
    monkeypatch.chdir(work)
    return configs, work


def test_relative_paths_start_from_the_recipe_directory(project):
    configs, work = project
    data = {
        "model": {"name": "models/m"},  # no ./ but exists beside the recipe: a local directory
        "data": {"source": "data/train.jsonl"},
        "eval": {"source": "./data/train.jsonl"},
        "rewards": [{"name": "rewards/mine.py:score"}, {"name": "digit_share"}, {"name": "os.path:join"}],
        "distributed": {"deepspeed": "ds.json"},
        "output": {"run_dir": "../runs/one"},
    }
    got = resolve_paths(data, configs)
    assert got == {
        "model": {"name": str(configs / "models" / "m")},
        "data": {"source": str(configs / "data" / "train.jsonl")},
        "eval": {"source": str(configs / "data" / "train.jsonl")},
        "rewards": [{"name": f"{configs}/rewards/mine.py:score"}, {"name": "digit_share"}, {"name": "os.path:join"}],
        "distributed": {"deepspeed": str(configs / "ds.json")},
        "output": {"run_dir": str(configs.parent / "runs" / "one")},
    }
    assert data["data"]["source"] == "data/train.jsonl"  # the input is not changed


def test_names_absolute_paths_and_home_are_kept_or_expanded(project):
    configs, work = project
    names = {
        "model": {"name": "Qwen/Qwen2.5-0.5B"},  # a hub id: nothing of that name here or there
        "data": {"source": "openai/gsm8k"},
        "rewards": [{"name": "digit_share"}, {"model": "org/reward-model"}],
        "distributed": {"deepspeed": "zero3"},  # a shipped config's name, not a file beside the recipe
    }
    assert resolve_paths(names, configs) == names
    assert resolve_paths({"model": {"name": "builtin:tiny"}, "data": {"source": "builtin:digits"}}, configs) == {
        "model": {"name": "builtin:tiny"},
        "data": {"source": "builtin:digits"},
    }
    absolute = {"data": {"source": "/srv/d.jsonl"}, "output": {"run_dir": "/runs/x"}}
    assert resolve_paths(absolute, configs) == absolute
    home = resolve_paths({"data": {"source": "~/d.jsonl"}}, configs)["data"]["source"]
    assert home == os.path.expanduser("~/d.jsonl") and os.path.isabs(home)
    # wrong types are the schema's to report
    assert resolve_paths({"data": {"source": 5}, "rewards": "x"}, configs) == {"data": {"source": 5}, "rewards": "x"}


def test_an_ambiguous_name_found_only_here_keeps_the_old_meaning(project):
    configs, work = project
    (work / "org" / "local-model").mkdir(parents=True)
    got = resolve_paths({"model": {"name": "org/local-model"}}, configs)
    assert got == {"model": {"name": str(work / "org" / "local-model")}}


def test_a_path_found_only_in_the_current_directory_is_an_error_naming_the_fix(project):
    configs, work = project
    (work / "mine.jsonl").write_text('{"prompt": "a"}\n')
    (work / "r.py").write_text(REWARD)
    with pytest.raises(UserError) as info:
        resolve_paths({"data": {"source": "mine.jsonl"}, "rewards": [{"name": "r.py:score"}]}, configs)
    assert info.value.lines == [
        f"data.source: 'mine.jsonl' is not in the recipe's directory {configs} (relative paths in a recipe start "
        "there) but is in the current directory; write '../work/mine.jsonl' or an absolute path",
        f"rewards[0].name: 'r.py' is not in the recipe's directory {configs} (relative paths in a recipe start "
        "there) but is in the current directory; write '../work/r.py' or an absolute path",
    ]


def test_set_paths_start_from_the_current_directory(project):
    configs, work = project
    got = resolve_override_paths(
        {"data.source": "d.jsonl", "rewards": [{"name": "r.py:f"}], "data": {"source": "builtin:digits"}, "x.y": 1}
    )
    assert got == {
        "data.source": str(work / "d.jsonl"),
        "rewards": [{"name": f"{work}/r.py:f"}],
        "data": {"source": "builtin:digits"},
        "x.y": 1,
    }


def test_data_suffixes_are_the_loaded_file_kinds():
    assert set(DATA_FILE_SUFFIXES) == set(FILE_KINDS)


@pytest.mark.parametrize("name", sorted(shipped_recipes()))
def test_shipped_recipes_name_no_paths(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = shipped_recipes()[name]
    assert resolve_paths(read_yaml(path), path.parent) == read_yaml(path)


def test_run_dir_recipe_holds_absolute_paths_and_reads_back_from_anywhere(project, tmp_path, monkeypatch):
    configs, work = project
    recipe = configs / "r.yaml"
    write_recipe(
        recipe,
        {
            "data": {"source": "data/train.jsonl", "chat": False},
            "rewards": [{"name": "rewards/mine.py:score"}],
            "trainer": SMALL,
            "output": {"run_dir": "runs/one"},
        },
    )
    resolved, _ = load_resolved(
        Path("../configs/r.yaml"), parse_sets(["distributed.deepspeed=../configs/ds.json"]), host=planning_host(0, None)
    )
    plan = plan_run(resolved, None, env={}, now=datetime(2024, 1, 1), cwd=work)
    assert plan.run_dir == configs / "runs" / "one"
    dumped = yaml.safe_load(plan.files["recipe.yaml"])
    assert dumped["data"]["source"] == str(configs / "data" / "train.jsonl")
    assert dumped["rewards"][0]["name"] == f"{configs}/rewards/mine.py:score"
    assert dumped["distributed"]["deepspeed"] == str(configs / "ds.json")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "recipe.yaml").write_text(plan.files["recipe.yaml"])
    monkeypatch.chdir(elsewhere)  # a rank or `train --resume` reads it from any directory
    assert load_recipe(elsewhere / "recipe.yaml") == resolved.recorded_recipe()  # every auto as decided


def test_written_copy_names_the_same_files(project):
    configs, work = project
    source = write_recipe(
        configs / "r.yaml", {"data": {"source": "data/train.jsonl"}, "rewards": [{"name": "rewards/mine.py:score"}]}
    )
    overrides = {"trainer.max_steps": 3, "distributed.deepspeed": "../configs/ds.json"}
    beside = configs / "probed.yaml"
    write_recipe_copy(beside, source, overrides, "probed")
    copied = read_yaml(beside)
    assert copied["data"] == {"source": "data/train.jsonl"}  # still right from there: as written
    assert copied["rewards"] == [{"name": "rewards/mine.py:score"}]
    assert copied["distributed"] == {"deepspeed": "../configs/ds.json"}  # typed here, also right from configs/
    here = work / "probed.yaml"
    write_recipe_copy(here, source, overrides, "probed")
    copied = read_yaml(here)
    assert copied["data"] == {"source": str(configs / "data" / "train.jsonl")}
    assert copied["rewards"] == [{"name": f"{configs}/rewards/mine.py:score"}]
    assert copied["distributed"] == {"deepspeed": "../configs/ds.json"} and copied["trainer"] == {"max_steps": 3}


# ---------------------------------------------------------------------------------------------- the CLI


def test_cli_dry_run_from_another_directory(project):
    configs, work = project
    write_recipe(
        configs / "r.yaml",
        {
            "data": {"source": "data/train.jsonl"},
            "rewards": [{"name": "rewards/mine.py:score"}],
            "trainer": SMALL,
            "output": {"run_dir": "runs/one"},
        },
    )
    result = cli_here(
        "train",
        "../configs/r.yaml",
        "--dry-run",
        "--gpus",
        "0",
        "--set",
        "data.system_prompt=Answer: think step by step",
        "--set",
        "trainer.learning_rate=1e-5",
        "--set-str",
        "trainer.extra_args.scale_rewards=none",
        cwd=work,
    )
    assert result.returncode == 0, result.stderr
    assert f"# run dir (not created): {configs / 'runs' / 'one'}" in result.stdout
    assert not (configs / "runs").exists()


def test_cli_names_the_path_to_write(project):
    configs, work = project
    (work / "train.jsonl").write_text('{"prompt": "a"}\n')
    write_recipe(configs / "r.yaml", {"data": {"source": "train.jsonl"}, "rewards": [{"name": "digit_share"}]})
    result = cli_here("validate", "../configs/r.yaml", "--gpus", "0", "--set", "data.system_prompt=# heading", cwd=work)
    assert_user_error(result, "data.source: 'train.jsonl'", "write '../work/train.jsonl'", one_line=True)
    # the same file given with --set starts from here: fine
    result = cli_here("validate", "../configs/r.yaml", "--gpus", "0", "--set", "data.source=train.jsonl", cwd=work)
    assert result.returncode == 0, result.stderr
