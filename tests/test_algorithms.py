"""Algorithms by name (colocate_rl.algorithms): the registry, each preset through validation and planning into TRL's
config, the errors of a typo or a contradiction, and every algorithm trained for two steps."""

import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import CPU, NO_GPU, ROOT, assert_user_error, clean_env, cli, cli_here, resolved, write_recipe

from colocate_rl import algorithms
from colocate_rl.plan.launch_plan import cache_dir, make_plan
from colocate_rl.plan.trl_args import MANAGED_TRL_FIELDS, _check_trl_value, trl_field_names, trl_value_kinds
from colocate_rl.recipe.schema import TrainerSection

NAMES = list(algorithms.registry())
# Two steps of the built-in tiny model on one CPU rank: 1 prompt × 8 completions of at most 16 tokens a step.
TINY = {
    "name": "alg",
    "model": {"name": "builtin:tiny"},
    "data": {"source": "builtin:digits"},
    "rewards": [{"name": "digit_share"}],
    "trainer": {
        "learning_rate": 0.01,
        "per_device_train_batch_size": 8,
        "num_generations": 8,
        "max_completion_length": 16,
        "max_steps": 2,
        "seed": 0,
    },
    "distributed": {"nproc_per_node": 1},
    "output": {"save_model": False},
}


def tiny(name: str, **trainer) -> dict:
    return {**TINY, "algorithm": name, "trainer": {**TINY["trainer"], **trainer}}


def planned_trl_args(recipe: dict, run_dir: Path) -> dict:
    """The TRL arguments `train` would write into launch.json for `recipe` on a 2-core CPU machine."""
    plan = make_plan(
        resolved(recipe, CPU), run_dir=run_dir, python="python", cwd=ROOT, cache_dir=run_dir / "cache", base_env={}
    )
    return json.loads(plan.files["launch.json"])["trl_args"]


def test_every_module_declares_one_algorithm_whose_preset_trl_takes():
    modules = sorted(p.stem for p in (ROOT / "colocate_rl" / "algorithms").glob("[!_]*.py"))
    assert sorted(NAMES) == modules and {"grpo", "rloo", "dapo", "dr_grpo", "bnpo", "gspo", "cispo"} <= set(NAMES)
    owned = set(TrainerSection.model_fields)
    for a in algorithms.registry().values():
        assert a.url.startswith(("https://arxiv.org/abs/", "https://huggingface.co/docs/trl/")) and a.paper, a.name
        assert set(a.defining) <= set(a.preset), a.name
        for key, value in a.preset.items():
            assert key in trl_field_names(a.trainer), f"{a.name}: {key} is not a field of TRL's {a.config_name}"
            assert key not in MANAGED_TRL_FIELDS and key not in owned, f"{a.name}: {key} is colocate-rl's"
            assert _check_trl_value(key, value, trl_value_kinds(a.trainer)[key], a.config_name) is None


@pytest.mark.parametrize("name", NAMES)
def test_every_algorithm_validates_and_its_preset_reaches_the_planned_trl_args(name, tmp_path):
    args = planned_trl_args(tiny(name), tmp_path / "run")
    assert args.items() >= algorithms.get(name).preset.items()
    assert args["use_cpu"] is True and args["max_steps"] == 2  # colocate-rl's own arguments stay


def test_extra_args_tune_a_preset_value_and_override_it():
    args = planned_trl_args({**tiny("dapo", extra_args={"epsilon_high": 0.3, "loss_type": "dapo"})}, Path("/r"))
    assert args["epsilon_high"] == 0.3 and args["loss_type"] == "dapo" and args["mask_truncated_completions"] is True
    # scale_rewards false is TRL's "none": no contradiction with dr_grpo
    assert planned_trl_args(tiny("dr_grpo", extra_args={"scale_rewards": False}), Path("/r"))["scale_rewards"] is False


@pytest.mark.parametrize("name", NAMES)
def test_trl_config_accepts_every_algorithms_planned_arguments(name, tmp_path):
    """TRL's own config validation (GRPOConfig/RLOOConfig.__post_init__) on the final arguments of each algorithm."""
    from colocate_rl.rank.worker import config_args

    Config, Trainer = algorithms.trainer_classes(name)
    assert Config.__name__ == algorithms.get(name).config_name and Trainer.__name__.endswith("Trainer")
    args = planned_trl_args(tiny(name), tmp_path / "run")
    assert args["use_cpu"] is True and args["bf16"] is False
    config = Config(**config_args(Config, args))
    for key, value in algorithms.get(name).preset.items():
        assert getattr(config, key) == value


@pytest.mark.parametrize(
    ("sets", "expected"),
    [
        (["algorithm=dapoo"], "algorithm: unknown algorithm; did you mean 'dapo'?"),
        (["algorithm=ppo"], "algorithm: unknown algorithm; choose one of grpo, rloo, "),
        (
            ["algorithm=dapo", "trainer.extra_args={loss_type: bnpo}"],
            "trainer.extra_args.loss_type: algorithm dapo runs with loss_type 'dapo', not 'bnpo'; remove the key, "
            "or choose algorithm: bnpo",
        ),
        (
            ["algorithm=gspo", "trainer.extra_args={importance_sampling_level: token}"],
            "trainer.extra_args.importance_sampling_level: algorithm gspo runs with importance_sampling_level "
            "'sequence', not 'token'; remove the key, or choose algorithm: grpo and set it there",
        ),
        (
            ["algorithm=gspo", "trainer.extra_args={loss_type: luspo}"],
            "trainer.extra_args.loss_type: algorithm gspo runs with loss_type 'grpo', not 'luspo'; remove the key, "
            "or choose algorithm: luspo",
        ),
        (["algorithm=dapo", "trainer.beta=0.04"], "trainer.beta: algorithm dapo trains without the KL term"),
        (["algorithm=rloo", "trainer.extra_args={loss_type: dapo}"], "trainer.extra_args.loss_type: not a field of"),
    ],
)
def test_a_typo_or_a_contradiction_is_one_error_line_naming_the_key(sets, expected):
    args = [arg for s in sets for arg in ("--set", s)]
    assert_user_error(cli_here("validate", "quickstart", *args), expected, one_line=True)


def test_the_recipe_guide_lists_every_algorithm():
    from colocate_rl.recipe.reference import algorithms_table

    guide = (ROOT / "docs" / "guide" / "recipes.md").read_text()
    assert algorithms_table() in guide, "docs/guide/recipes.md is stale: run python tools/recipe_reference.py"


@pytest.mark.slow  # the CLI of a copied package, in a subprocess
def test_one_new_file_adds_an_algorithm(tmp_path):
    """A copy of the package with one more module in colocate_rl/algorithms/: the recipe takes the name."""
    shutil.copytree(ROOT / "colocate_rl", tmp_path / "colocate_rl", ignore=shutil.ignore_patterns("__pycache__"))
    source = (ROOT / "colocate_rl" / "algorithms" / "bnpo.py").read_text()
    (tmp_path / "colocate_rl" / "algorithms" / "mine.py").write_text(source.replace('name="bnpo"', 'name="mine"'))
    recipe = write_recipe(tmp_path / "r.yaml", tiny("mine"))
    result = cli("validate", recipe, cwd=tmp_path, env={"PYTHONPATH": str(tmp_path)})
    assert result.returncode == 0 and "alg (mine)" in result.stdout, result.stdout + result.stderr


def finished_steps(run_dir: Path) -> list[dict]:
    """The step records of a finished run, each with a finite loss, reward and grad norm."""
    assert (run_dir / "DONE").is_file(), run_dir
    steps = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "reward" in r]
    assert [r["step"] for r in steps] == [1, 2], run_dir
    for r in steps:
        assert all(math.isfinite(r[k]) for k in ("loss", "reward", "grad_norm", "entropy")), r
    return steps


@pytest.mark.slow
def test_every_algorithm_trains_by_name(tmp_path):
    """Two steps of every algorithm: rloo through `colocate-rl train` (real torchrun, 2 ranks with DDP, a TRL option
    of its own through trainer.extra_args), the others from run directories the launcher writes
    (launch.execute.prepare), each trained by the per-rank program in one Python process (TRL imported once: ~5 s a
    process on this 2-core machine)."""
    from colocate_rl.launch.execute import prepare

    started = time.monotonic()
    rloo = {**tiny("rloo", extra_args={"normalize_advantages": True}), "distributed": {"nproc_per_node": 2}}
    result = cli("train", write_recipe(tmp_path / "rloo.yaml", rloo), "--run-dir", tmp_path / "rloo")
    assert result.returncode == 0, result.stdout[-2000:] + (tmp_path / "rloo" / "train.log").read_text()[-4000:]
    cli_seconds = time.monotonic() - started
    trl_args = json.loads((tmp_path / "rloo" / "launch.json").read_text())["trl_args"]
    assert trl_args["normalize_advantages"] is True and "deepspeed" not in trl_args  # DDP

    env = clean_env(**NO_GPU)
    others = [name for name in NAMES if name != "rloo"]
    for name in others:
        plan = make_plan(
            resolved(tiny(name), CPU),
            run_dir=tmp_path / name,
            python=sys.executable,
            cwd=ROOT,
            cache_dir=cache_dir(os.environ),  # the built-in model `train` built above
            base_env=env,
        )
        prepare(plan)
    code = "import sys\nfrom colocate_rl.rank.worker import main\nsys.exit(sum(main([d]) for d in sys.argv[1:]))"
    done = subprocess.run(
        [sys.executable, "-c", code, *(str(tmp_path / n) for n in others)],
        cwd=ROOT,
        env={**env, **plan.env},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    for name in NAMES:
        launch = json.loads((tmp_path / name / "launch.json").read_text())
        assert launch["algorithm"] == name and launch["trl_args"].items() >= algorithms.get(name).preset.items()
        finished_steps(tmp_path / name)
    # the preset is what the trainer ran with: every completion of the tiny model is cut at 16 tokens, which dapo
    # leaves out of the loss (no gradient at all) while grpo, same seed, learns from step 2's spread of rewards
    dapo, grpo = finished_steps(tmp_path / "dapo"), finished_steps(tmp_path / "grpo")
    assert all(r["completions/clipped_ratio"] == 1.0 for r in dapo + grpo)
    assert [r["grad_norm"] for r in dapo] == [0.0, 0.0] and grpo[1]["grad_norm"] > 0
    print(f"train (torchrun) {cli_seconds:.1f} s; {len(others)} more in one process {time.monotonic() - started:.1f} s")
