"""Every shipped recipe validates and plans (on a CPU-only machine and on an 8-GPU node); every shipped DeepSpeed
config loads and builds for each precision; the wheel carries the shipped folders where an installed package looks
for them."""

import json
import re
import shutil
from pathlib import Path

import pytest
from conftest import CPU, GPU8, ROOT
from typer.testing import CliRunner

from colocate_rl.cli import app
from colocate_rl.pipeline import resolve
from colocate_rl.plan.deepspeed import build_deepspeed_config
from colocate_rl.plan.launch_plan import make_plan
from colocate_rl.recipe import shipped
from colocate_rl.recipe.load import load_recipe
from colocate_rl.recipe.shipped import recipe_summary, shipped_deepspeed_configs, shipped_recipes, shipped_scripts

RECIPES = shipped_recipes()


def test_expected_recipes_are_shipped():
    assert {
        "quickstart",
        "qwen2.5-1.5b-grpo-gsm8k",
        "qwen2.5-1.5b-rloo-gsm8k",
        "qwen2.5-7b-grpo",
        "qwen2.5-72b-grpo-colocate",
    } <= set(RECIPES)
    assert any(load_recipe(p).algorithm == "rloo" for p in RECIPES.values())


@pytest.mark.parametrize("name", sorted(RECIPES))
@pytest.mark.parametrize("host", [CPU, GPU8], ids=["cpu", "8-gpus"])
def test_shipped_recipe_validates_and_plans(name, host, tmp_path):
    recipe = load_recipe(RECIPES[name])
    assert recipe.name == name, "a recipe's name matches its file name"
    assert recipe_summary(RECIPES[name]), "a recipe starts with a one-line comment saying what it runs"
    resolved = resolve(recipe, host)
    plan = make_plan(resolved, run_dir=tmp_path / "run", python="python", cwd=tmp_path, cache_dir=tmp_path, base_env={})
    assert plan.argv[:3] == ["python", "-m", "torch.distributed.run"]
    args = json.loads(plan.files["launch.json"])["trl_args"]
    if host is GPU8:
        assert args["use_vllm"] and args["vllm_mode"] == "colocate" and args["bf16"]
    else:
        assert args["use_cpu"] and not args["use_vllm"] and resolved.backend == "transformers"
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", sorted(shipped_deepspeed_configs()))
@pytest.mark.parametrize("precision", ["bf16", "fp16", "no"])
def test_shipped_deepspeed_configs_build(name, precision):
    config = build_deepspeed_config(name, precision=precision)
    assert config["zero_optimization"]["stage"] == 3
    assert config["bf16"]["enabled"] is (precision == "bf16") and config["fp16"]["enabled"] is (precision == "fp16")
    assert config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    raw = json.loads(Path(shipped_deepspeed_configs()[name]).read_text())
    assert ("offload_optimizer" in raw["zero_optimization"]) == ("offload" in name)
    assert ("offload_param" in raw["zero_optimization"]) == (name == "zero3_offload_all")


def test_deepspeed_overrides_and_user_file(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, "bf16": {"enabled": "auto"}}))
    config = build_deepspeed_config(
        str(path), precision="bf16", offload_optimizer=True, overrides={"zero_optimization": {"overlap_comm": False}}
    )
    assert config["zero_optimization"] == {
        "stage": 2,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "overlap_comm": False,
    }
    path.write_text("{bad json")
    from colocate_rl.errors import UserError

    with pytest.raises(UserError, match=r"mine.json:1:2: invalid JSON"):
        build_deepspeed_config(str(path), precision="no")


def test_the_wheel_carries_each_shipped_folder_where_the_package_looks():
    """pyproject's force-include copies recipes/, deepspeed_configs/ and scripts/ into the wheel as
    colocate_rl/_shipped/<folder>, the first place `shipped_dir` looks."""
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[tool.hatch.build.targets.wheel.force-include]\n", 1)[1].split("\n[", 1)[0]
    folders = ("recipes", "deepspeed_configs", "scripts")
    assert dict(re.findall(r'^"([^"]+)" = "([^"]+)"$', section, re.M)) == {
        f: f"colocate_rl/_shipped/{f}" for f in folders
    }
    assert all(shipped.shipped_dir(f) == ROOT / f for f in folders)  # in a checkout: the repository's own
    assert set(shipped_scripts()) == {"slurm.sbatch", "multinode.sh", "single-node.sh"}
    assert all(recipe_summary(path) for path in shipped_scripts().values()), "each script says what it does"


def test_an_installed_package_copies_its_script_out(tmp_path, monkeypatch):
    """Installed from the wheel, colocate_rl/ sits in site-packages with no checkout beside it: `colocate-rl recipes
    slurm.sbatch --out FILE` copies the script from colocate_rl/_shipped/scripts/ and makes it executable."""
    package = tmp_path / "site-packages" / "colocate_rl"
    (package / "_shipped" / "scripts").mkdir(parents=True)
    wheel_copy = package / "_shipped" / "scripts" / "slurm.sbatch"
    shutil.copyfile(ROOT / "scripts" / "slurm.sbatch", wheel_copy)
    wheel_copy.write_text(wheel_copy.read_text() + "# the installed copy\n")
    monkeypatch.setattr(shipped, "_PACKAGE", package)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["recipes", "slurm.sbatch", "--out", "job.sbatch"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "job.sbatch").read_text() == wheel_copy.read_text()
    assert (tmp_path / "job.sbatch").stat().st_mode & 0o100
    listing = CliRunner().invoke(app, ["recipes"], env={"COLUMNS": "200"})
    assert "slurm.sbatch" in listing.stdout and "multinode.sh" not in listing.stdout  # only what is installed


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    block = readme.split("<!-- test-command -->", 1)[1].split("```bash\n", 1)[1].split("\n```", 1)[0].strip()
    assert block == "python -m pytest -q -n 2"
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert block in ci, ".ci/run must call the README's exact test command"
    tests = readme.split("\n## Tests\n", 1)[1].split("\n## ", 1)[0]
    assert '`python -m pytest -q -n 2 -m "not slow"`' in tests, "the Tests section names the fast tier"
