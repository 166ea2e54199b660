"""The CLI as users run it (a real subprocess): exit codes, one-line errors, nothing half-written. Every test plans
for a host it names (`--gpus N`, or no visible GPU), except `test_this_machine_smoke`."""

import re
import subprocess
import sys

import pytest
import yaml
from conftest import CPU, ROOT, assert_user_error, cli, resolved

from colocate_rl.plan.host import Gpu, Host, assumed_host
from colocate_rl.recipe.shipped import shipped_recipes

pytestmark = pytest.mark.slow  # every test starts the CLI as a process


def test_help_is_light():
    result = cli("--help")
    assert result.returncode == 0 and "train" in result.stdout
    # heavy imports are lazy: the CLI module loads none of them (~0.3 s for --help, measured)
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
    assert_user_error(result, "trainer.num_generations: the generation batch (6")  # 2 CPU ranks: no GPU visible
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
    result = cli("train", "recipes/quickstart.yaml", "--dry-run", "--gpus", "0", "--run-dir", str(run_dir))
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
    assert cli("validate", "quickstart", "--gpus", "0", cwd=tmp_path).returncode == 0  # shipped ones resolve by name
    for script in ("slurm.sbatch", "multinode.sh", "single-node.sh"):  # the cluster launch scripts ship too
        assert script in listing.stdout
    script = cli("recipes", "slurm.sbatch", "--out", "job.sbatch", cwd=tmp_path)
    assert script.returncode == 0, script.stderr
    assert (tmp_path / "job.sbatch").read_text() == (ROOT / "scripts" / "slurm.sbatch").read_text()
    assert (tmp_path / "job.sbatch").stat().st_mode & 0o100


@pytest.mark.parametrize(
    "host, backend",
    [
        (CPU, "transformers"),
        (Host(gpus=(Gpu("H200", 140.0),), has_vllm=False, cpu_count=8), "transformers"),  # vLLM not installed
        (Host(gpus=(), has_vllm=True, cpu_count=8), "transformers"),  # vLLM but no GPU
        (assumed_host(1), "vllm"),
    ],
)
def test_generation_backend_auto_by_host(host, backend):
    """What `env` reports for this machine, decided for fixed hosts: vLLM needs a GPU and vLLM installed."""
    assert resolved({"rewards": [{"name": "digit_share"}]}, host, "generation.backend=auto").backend == backend


def test_this_machine_smoke():
    """The one test that runs on whatever this machine is (GPUs, vLLM or not): `env` reports it and the quickstart
    validates here."""
    result = cli("env", this_machine=True)
    assert result.returncode == 0, result.stderr
    assert "trl" in result.stdout and "1.16.0" in result.stdout
    line = re.search(r"generation\.backend auto → (.*); CPU cores: (\d+); RAM: (\d+) GiB", result.stdout)
    assert line, result.stdout
    assert line[1] in ("vllm (colocated)", "transformers (no GPU)", "transformers (vLLM not installed)")
    import psutil

    assert line[3] == f"{psutil.virtual_memory().total / 2**30:.0f}"
    validated = cli("validate", "quickstart", this_machine=True)
    assert validated.returncode == 0, validated.stderr
    assert "recipe is valid" in validated.stdout
