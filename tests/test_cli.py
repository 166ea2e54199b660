"""The CLI as users run it (a real subprocess): exit codes, one-line errors, nothing half-written."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import assert_user_error

from colocate_rl.recipe.shipped import shipped_recipes

ROOT = Path(__file__).resolve().parent.parent


def cli(*args, cwd=None, env=None):
    return subprocess.run(
        [sys.executable, "-m", "colocate_rl", *args],
        capture_output=True,
        text=True,
        cwd=cwd or ROOT,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
        timeout=120,
    )


def test_help_is_fast():
    start = time.perf_counter()
    result = cli("--help")
    assert result.returncode == 0 and "train" in result.stdout
    assert time.perf_counter() - start < 3  # measured ~0.3 s; heavy imports are lazy
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, colocate_rl.cli; "
            "print(sorted(m for m in ('torch','trl','transformers','vllm','deepspeed') "
            "if m in sys.modules))",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert probe.stdout.strip() == "[]"


def test_invalid_recipe_exits_2_and_creates_nothing(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(
        yaml.safe_dump({"rewards": [{"name": "digit_share"}], "trainer": {"num_generations": 1, "learnin_rate": 1}})
    )
    run_dir = tmp_path / "run"
    result = cli("train", str(recipe), "--run-dir", str(run_dir))
    assert_user_error(
        result, "trainer.num_generations:", "trainer.learnin_rate: unknown key; did you mean 'learning_rate'?"
    )
    assert not run_dir.exists()


def test_cross_field_error_via_set_exits_2(tmp_path):
    result = cli(
        "train",
        "recipes/quickstart.yaml",
        "--set",
        "trainer.per_device_train_batch_size=3",
        "--run-dir",
        str(tmp_path / "run"),
    )
    assert_user_error(result, "trainer.num_generations: the generation batch (6")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["validate", "nope.yaml"], "nope.yaml: recipe file not found"),
        (["validate", "nosuchrecipe"], "nosuchrecipe: no such recipe file or shipped recipe"),
        (["validate", "recipes/quickstart.yaml", "--set", "trainer.max_steps"], "--set 'trainer.max_steps': expected"),
        (["recipes", "nope"], "nope: no shipped recipe or launch script of that name"),
        (["train", "recipes/quickstart.yaml", "--gpus", "2"], "--gpus: only for planning"),
    ],
)
def test_bad_input_exits_2(args, fragment, tmp_path):
    result = cli(*args, "--run-dir", str(tmp_path / "r")) if args[0] == "train" else cli(*args)
    assert_user_error(result, fragment)


def test_yaml_syntax_error_names_the_line(tmp_path):
    recipe = tmp_path / "broken.yaml"
    recipe.write_text("rewards:\n  - name: digit_share\ntrainer: {max_steps: 3\n")
    assert_user_error(cli("validate", str(recipe)), f"{recipe}:4:1: invalid YAML")


def test_dry_run_prints_torchrun_and_writes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    result = cli("train", "recipes/quickstart.yaml", "--dry-run", "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stderr
    command = result.stdout.strip().splitlines()[-1]
    assert "-m torch.distributed.run --nnodes 1 --nproc-per-node 2 --standalone -m colocate_rl.worker" in command
    assert command.endswith(str(run_dir)) and "DS_ACCELERATOR=cpu" in command
    assert not run_dir.exists()


def test_existing_run_dir_is_refused(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "recipe.yaml").write_text("x")
    assert_user_error(
        cli("train", "recipes/quickstart.yaml", "--run-dir", str(tmp_path / "run")), "already exists and is not empty"
    )


def test_recipes_lists_and_copies(tmp_path):
    listing = cli("recipes")
    assert listing.returncode == 0
    for name in shipped_recipes():
        assert name in listing.stdout
    copied = cli("recipes", "quickstart", cwd=tmp_path)
    assert copied.returncode == 0, copied.stderr
    assert (tmp_path / "quickstart.yaml").read_text() == (ROOT / "recipes" / "quickstart.yaml").read_text()
    assert_user_error(cli("recipes", "quickstart", cwd=tmp_path), "already exists")
    assert cli("validate", "quickstart", cwd=tmp_path).returncode == 0  # shipped recipes resolve by name
    for script in ("slurm.sbatch", "multinode.sh", "single-node.sh"):  # the cluster launch scripts ship too
        assert script in listing.stdout
    script = cli("recipes", "slurm.sbatch", "--out", "job.sbatch", cwd=tmp_path)
    assert script.returncode == 0, script.stderr
    assert (tmp_path / "job.sbatch").read_text() == (ROOT / "examples" / "slurm.sbatch").read_text()
    assert (tmp_path / "job.sbatch").stat().st_mode & 0o100


def test_env_reports_versions_and_backend():
    result = cli("env")
    assert result.returncode == 0, result.stderr
    assert "trl" in result.stdout and "1.16.0" in result.stdout
    assert "generation.backend auto → transformers" in result.stdout
    import psutil

    assert f"RAM: {psutil.virtual_memory().total / 2**30:.0f} GiB" in result.stdout
