"""Helpers shared by the tests: the CLI as a subprocess or in this process, fixed hosts, recipe resolution, test-local
recipes.

Tests are hermetic: they plan for a `Host` given here (or `--gpus N` / no visible GPU on the command line), never for
the machine they run on, except `test_cli.py::test_this_machine_smoke`."""

import importlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from colocate_rl.pipeline import resolve
from colocate_rl.plan.host import Gpu, Host
from colocate_rl.plan.resolved import Resolved
from colocate_rl.recipe.load import apply_overrides, parse_recipe, parse_sets, read_yaml
from colocate_rl.recipe.shipped import find_recipe
from colocate_rl.rundir import step_records

ROOT = Path(__file__).resolve().parent.parent
H200_GIB = 143_771 / 1024  # GiB, as NVML (and torch) report an H200: 143,771 MiB

CPU = Host(gpus=(), has_vllm=False, cpu_count=2)  # a CPU-only machine: 2 CPU ranks, transformers generation
GPU8 = Host(gpus=(Gpu("H200", 140.0),) * 8, has_vllm=True, cpu_count=128)  # one 8-GPU node with vLLM

NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}  # a CLI subprocess sees no GPU, whatever this machine has


def pytest_configure(config):
    """Before the tests' modules are imported: rich fixes a console's width when it is made if COLUMNS is set
    (pytest-xdist's workers set 80), and the CLI's consoles are made at import; without it here, each command's
    environment (COLUMNS=200, below) sets the width."""
    os.environ.pop("COLUMNS", None)


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without Slurm or launcher variables (a test run inside a Slurm job must not plan
    a multi-node run), 200 columns for rich's tables, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "COLOCATE_RL_", "MASTER_"))}
    return {**env, "COLUMNS": "200", **extra}


def cli(*args, cwd: Path = ROOT, env: dict | None = None, timeout: float = 120, this_machine: bool = False):
    """`python -m colocate_rl ARGS` in a subprocess, as a user runs it. No GPU is visible to it unless
    `this_machine` (it then plans for whatever this machine has); `--gpus N` plans for N GPUs either way."""
    return subprocess.run(
        [sys.executable, "-m", "colocate_rl", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=clean_env(**({} if this_machine else NO_GPU), **(env or {})),
        timeout=timeout,
    )


def cli_here(*args, cwd: Path = ROOT, env: dict | None = None):
    """`colocate-rl ARGS` in this process (typer's CliRunner), with `cli`'s result fields (returncode, stdout, stderr)
    and none of its ~1 s process start: for tests of what a command prints and writes, not of how it starts. An
    exception that escapes the command is added to stderr as its traceback, as a user would see it. No GPU is visible
    to it; Slurm and launcher variables are hidden, as in `clean_env`."""
    import traceback

    from typer.testing import CliRunner

    from colocate_rl.cli import app

    hidden = {k: None for k in os.environ if k.startswith(("SLURM_", "COLOCATE_RL_", "MASTER_"))}
    previous = Path.cwd()
    os.chdir(cwd)
    try:
        result = CliRunner().invoke(
            app, list(map(str, args)), env={**hidden, **NO_GPU, "COLUMNS": "200", **(env or {})}
        )
    finally:
        os.chdir(previous)
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "".join(traceback.format_exception(result.exception))
    return subprocess.CompletedProcess(list(args), result.exit_code, result.stdout, stderr)


def assert_user_error(result, *fragments, one_line: bool = False):
    """A bad-input exit: code 2, only `error: ` lines on stderr (exactly one if `one_line`), no traceback, each
    fragment present."""
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines and all(line.startswith("error: ") for line in lines), result.stderr
    assert not one_line or len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr


def resolved(recipe: dict | str | Path, host: Host, *sets: str) -> Resolved:
    """`recipe` (a recipe mapping, a shipped recipe's name or a file) with `--set`-style `sets`, resolved for `host`
    as the CLI resolves it (auto layout included)."""
    data = recipe if isinstance(recipe, dict) else read_yaml(find_recipe(str(recipe)))
    return resolve(parse_recipe(apply_overrides(data, parse_sets(list(sets)))), host)


def write_recipe(path: Path, data: dict) -> Path:
    """A recipe mapping as a YAML file, for the CLI."""
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def import_benchmark(name: str):
    """A script of benchmarks/ imported as a module (its helpers are tested on CPU)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


# Test-local recipes for arithmetic (memory estimate, auto's layout): the shapes of the GPU recipes the hand checks
# and the H200 measurements were made with, written out here so that editing a shipped recipe moves no hand-checked
# number (tests/test_shipped.py checks the shipped ones). The layout keys are left at their defaults (DDP, no
# checkpointing) unless the recipe forces one; tests set theirs.
DIGITS = {"algorithm": "grpo", "data": {"source": "builtin:digits"}, "rewards": [{"name": "digit_share"}]}
# recipes/gpu-0.5b-layout.yaml: 1 GPU per rank, 16 × 256-token completions, max_model_length 512, share 0.25, sleep
QWEN05 = {
    **DIGITS,
    "model": {"name": "builtin:qwen2.5-0.5b"},
    "trainer": {"per_device_train_batch_size": 16, "num_generations": 8, "max_completion_length": 256},
    "generation": {"vllm_gpu_memory_utilization": 0.25, "sleep_level": 2, "max_model_length": 512},
}
# recipes/gpu-1.5b-layout-zero3.yaml: as QWEN05 with the 1.5B layout, micro-batch 8 and DeepSpeed ZeRO-3
QWEN15_ZERO3 = {
    **QWEN05,
    "model": {"name": "builtin:qwen2.5-1.5b"},
    "trainer": {**QWEN05["trainer"], "per_device_train_batch_size": 8},
    "distributed": {"deepspeed": "zero3"},
}
# recipes/gpu-7b-layout-1gpu.yaml: 7B layout on 1 GPU, 8 × 1024-token completions, share 0.35, layout auto
QWEN7_1GPU = {
    **DIGITS,
    "model": {"name": "builtin:qwen2.5-7b"},
    "trainer": {
        "per_device_train_batch_size": 8,
        "num_generations": 8,
        "max_completion_length": 1024,
        "gradient_checkpointing": "auto",
    },
    "generation": {"vllm_gpu_memory_utilization": 0.35, "sleep_level": 2, "max_model_length": 1280},
    "distributed": {"nproc_per_node": 1, "zero_stage": "auto"},
}


HANG_GUARD_S = 600  # not a speed check: only ends a hung test


def engine_with_sampler_logprobs(trainer):
    """An engine factory for TRL trainers on the CPU: transformers' engine (vLLM cannot run here) returning sampled
    log-probabilities as vLLM does, the trainer's own shifted per token to stand for the sampler's mismatch, so that
    TRL's importance-sampling ratios are not all 1."""
    import math

    import torch

    from colocate_rl.rank.engine import Generation
    from colocate_rl.rank.hf_engine import TransformersEngine, transformers_engine

    class WithLogprobs(TransformersEngine):
        returns_logprobs = True

        def generate(self, prompt_ids, sampling):
            out = super().generate(prompt_ids, sampling)
            model = self.wrapped_model()
            logprobs = []
            with torch.no_grad():
                for prompt, completion in zip(prompt_ids, out.completion_ids):
                    ids = torch.tensor([prompt + completion])
                    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1] / sampling.temperature
                    picked = logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
                    logprobs.append([v + 0.2 * math.sin(3 * i) for i, v in enumerate(picked.tolist())])
            return Generation(out.completion_ids, logprobs)

    engine = transformers_engine(trainer)
    engine.__class__ = WithLogprobs
    return engine


def varied(completions, **kwargs) -> list[float]:
    """A reward that differs between completions of the tiny model (its digit share is always 0)."""
    return [sum(map(ord, str(c))) % 97 / 97 for c in completions]


def cpu_trainer(trainer_cls: type, config_cls: type, model_dir: Path, out: Path, dataset, **config):
    """`trainer_cls` (an engine_trainer subclass) on the CPU for 2 steps at learning rate 1e-3, seed 3: `model_dir`'s
    model, the reward `varied`, the engine with sampler log-probabilities; `config` sets the rest of `config_cls`."""
    from colocate_rl.builtin_model import load_tokenizer

    args = config_cls(output_dir=str(out), use_cpu=True, bf16=False, report_to="none", temperature=1.0, max_steps=2,
                      logging_steps=1, learning_rate=1e-3, save_strategy="no", disable_tqdm=True, seed=3, **config)  # fmt: skip
    return trainer_cls(model=str(model_dir), reward_funcs=[varied], args=args, train_dataset=dataset,
                       processing_class=load_tokenizer(model_dir), engine_factory=engine_with_sampler_logprobs)  # fmt: skip


def start(run_dir: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`colocate-rl train ARGS --run-dir RUN_DIR` in the background (CPU, 2 ranks; `env` added to its environment)."""
    return subprocess.Popen(
        [sys.executable, "-m", "colocate_rl", "train", *args, "--run-dir", str(run_dir)],
        cwd=ROOT,
        env=clean_env(**NO_GPU, **(env or {})),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for_steps(proc: subprocess.Popen, run_dir: Path, steps: int) -> None:
    guard = time.monotonic() + HANG_GUARD_S
    while len(step_records(run_dir)) < steps:
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < guard, "the run logged no steps"
        time.sleep(0.2)


# NVIDIA's nvidia-cuda-mps-control needs an NVIDIA driver: tests of `generation.mps` run this test double of it
FAKE_MPS = '''#!{python}
"""Test double of nvidia-cuda-mps-control: `-f` records its environment in $CUDA_MPS_LOG_DIRECTORY/fake.json, makes
the control pipe and waits for `quit`; without arguments it reads a command from stdin (`quit` is passed on).
FAKE_MPS_FAIL: `-f` prints it and exits 1."""
import json, os, sys, time
from pathlib import Path

pipe = Path(os.environ["CUDA_MPS_PIPE_DIRECTORY"])
if sys.argv[1:] == ["-f"]:
    if os.environ.get("FAKE_MPS_FAIL"):
        print(os.environ["FAKE_MPS_FAIL"])
        sys.exit(1)
    log = Path(os.environ["CUDA_MPS_LOG_DIRECTORY"])
    (log / "fake.json").write_text(json.dumps({{"pipe": str(pipe), "pid": os.getpid()}}))
    (pipe / "control").touch()
    while not (pipe / "quit").exists():
        time.sleep(0.05)
    (log / "quit").write_text("quit")
elif sys.stdin.read().strip() == "quit":
    (pipe / "quit").touch()
'''


@pytest.fixture
def fake_mps(tmp_path) -> dict[str, str]:
    """The environment with the test double of nvidia-cuda-mps-control (`FAKE_MPS`) first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "nvidia-cuda-mps-control"
    exe.write_text(FAKE_MPS.format(python=sys.executable))
    exe.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
