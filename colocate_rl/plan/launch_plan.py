"""The launch plan: a pure function from a resolved recipe to argv, environment and run-dir files.

No I/O happens here, so the plan is tested by comparing exact values. `colocate_rl.launch.execute` executes it.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from colocate_rl import rundir
from colocate_rl.model_config import looks_local
from colocate_rl.plan.engine_options import EngineOptions
from colocate_rl.plan.evaluation import held_out_rows
from colocate_rl.plan.identity import NODE_RANK_ENV, RECIPE_HASH_ENV, identity_hash, recipe_identity
from colocate_rl.plan.launch_spec import LaunchSpec
from colocate_rl.plan.overlap import engine_in_process
from colocate_rl.plan.resolved import Resolved
from colocate_rl.plan.trl_args import trl_args
from colocate_rl.recipe.load import dump_recipe

WORKER_MODULE = "colocate_rl.worker"  # the entry point every launch.sh names: keep it stable
OWNER_MODULE = "colocate_rl.launch.owner"  # launch.sh starts torchrun through it: the run dir's owner lock
MPS_MODULE = "colocate_rl.launch.mps"  # torchrun under a CUDA MPS daemon of its own (generation.mps)


@dataclass(frozen=True)
class LaunchPlan:
    """What `train` does: write `files` into `run_dir`, (build `builtin_model`), then run `argv` with `env`."""

    run_dir: Path
    argv: list[str]
    env: dict[str, str]  # added to the parent environment
    files: dict[str, str] = field(default_factory=dict)  # run-dir relative name → content
    builtin_model: dict[str, Any] | None = None  # build_model() kwargs when the model is built-in
    node_dir: str | None = None  # multi-node: "nodes/<node_rank>", this node's own files (the rest is shared)
    recipe_hash: str = ""  # hash of the resolved recipe minus node rank and run dir; equal on every node
    resume_from: str | None = None  # `train --resume`: the checkpoint the ranks continue from

    def command_line(self) -> str:
        """The launch as one shell line (env assignments, then argv)."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return f"{env} {shlex.join(self.argv)}".strip()


def model_path(resolved: Resolved, run_dir: Path) -> str:
    """Where ranks load the model from: the run dir's built model, or the recipe's name/path."""
    return str(run_dir / rundir.MODEL_LINK) if resolved.builtin_layout else resolved.recipe.model.name


def engine_options(resolved: Resolved) -> EngineOptions | None:
    """Options of colocate-rl's vLLM engine for this run; None when TRL's engine or no vLLM generates."""
    gen = resolved.recipe.generation
    if resolved.backend != "vllm" or gen.engine != "colocate-rl":
        return None
    return EngineOptions.from_generation(gen)


def cache_dir(env: Mapping[str, str]) -> Path:
    """Where built-in models and compiled extensions are cached: $XDG_CACHE_HOME/colocate-rl (~/.cache by default)."""
    return Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "colocate-rl"


def extensions_dir(cache_dir: Path, python: str) -> Path:
    """Where the ranks' JIT-compiled torch extensions (DeepSpeed ops) go: one directory per Python environment
    (`torch_extensions/env-<hash of the environment's root>`), since a build links against that environment's torch
    and sources, and environments sharing one directory rebuild over each other."""
    root = str(Path(python).parent.parent)  # <venv>/bin/python → <venv>
    return cache_dir / "torch_extensions" / f"env-{hashlib.sha256(root.encode()).hexdigest()[:10]}"


def rank_env(
    resolved: Resolved, base_env: Mapping[str, str], cache_dir: Path, python: str = sys.executable
) -> dict[str, str]:
    """Per-rank environment additions; a variable the user already set is left alone."""
    threads = max(1, resolved.host.cpu_count // resolved.nproc_per_node)
    env = {
        "OMP_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
        "TORCH_EXTENSIONS_DIR": str(extensions_dir(cache_dir, python)),
    }
    if resolved.device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    gen = resolved.recipe.generation
    if resolved.device == "cuda" and engine_in_process(resolved.recipe) and gen.sleep_level == 0:
        # the trainer's cache grows in place beside the awake engine process instead of filling the GPU with new
        # blocks and retrying, which left the engine's allocator no room (docs/guide/engine.md); not with sleep mode,
        # whose pool refuses it (overlap keeps sleep level 0)
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    hub_rewards = [r.model for r in resolved.recipe.rewards if r.model is not None and not looks_local(r.model)]
    if resolved.builtin_layout and not hub_rewards:  # a hub reward model is downloaded on the ranks
        env["HF_HUB_OFFLINE"] = "1"
    return {k: v for k, v in env.items() if k not in base_env}


def torchrun_argv(resolved: Resolved, run_dir: Path, python: str) -> list[str]:
    """`python -m torch.distributed.run` (torchrun) with the node/rendezvous flags, then the worker."""
    dist = resolved.recipe.distributed
    argv = [
        python,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(dist.nnodes),
        "--nproc-per-node",
        str(resolved.nproc_per_node),
    ]
    if dist.nnodes == 1 and dist.rdzv_endpoint is None:
        argv.append("--standalone")
    elif dist.rdzv_backend == "static":
        host, _, port = dist.rdzv_endpoint.rpartition(":")
        argv += ["--node-rank", str(dist.node_rank), "--master-addr", host, "--master-port", port]
    else:
        argv += [
            "--node-rank",
            str(dist.node_rank),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            dist.rdzv_endpoint,
            "--rdzv-id",
            dist.rdzv_id,
        ]
    if dist.nnodes > 1:  # per-rank logs of this node (its train.log gets the same lines, prefixed [defaultN]:)
        argv += ["--log-dir", str(run_dir / rundir.node_dir_name(dist.node_rank) / rundir.RANK_LOGS), "--tee", "3"]
    return argv + ["-m", WORKER_MODULE, str(run_dir)]


def launch_script(argv: list[str], env: dict[str, str], cwd: Path, run_dir: Path, node_dir: str | None) -> str:
    """`launch.sh`: the same launch, runnable by hand; torchrun holds the run dir's owner lock (refused while another
    launch of this run, on this node, is alive)."""
    lines = [
        "#!/usr/bin/env bash",
        "# Written by `colocate-rl train`: re-runs this launch by hand.",
        "set -euo pipefail",
        f"cd {shlex.quote(str(cwd))}",
    ]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
    owner = [argv[0], "-m", OWNER_MODULE, str(run_dir), *([node_dir] if node_dir else []), "--"]
    lines.append("exec " + shlex.join(owner + argv))
    return "\n".join(lines) + "\n"


def make_plan(
    resolved: Resolved,
    *,
    run_dir: Path,
    python: str,
    cwd: Path,
    cache_dir: Path,
    base_env: Mapping[str, str],
    resume_from: str | None = None,
    forecast: str | None = None,
) -> LaunchPlan:
    """Everything `train` will do, decided without touching the filesystem or the environment. `forecast`: the
    step-time forecast's forecast.json (`colocate_rl.memory.forecast.forecast_json`), shared by every node."""
    recipe = resolved.recorded_recipe().model_copy(deep=True)  # every auto as decided: the ranks and a resume read it
    recipe.output.run_dir = str(run_dir)
    env = rank_env(resolved, base_env, cache_dir, python)
    argv = torchrun_argv(resolved, run_dir, python)
    identity = recipe_identity(resolved)
    recipe_hash = identity_hash(identity)
    multi_node = recipe.distributed.nnodes > 1
    node_dir = rundir.node_dir_name(recipe.distributed.node_rank) if multi_node else None
    if recipe.generation.mps == "on":  # torchrun as the client of an MPS daemon of its own
        mps_logs = run_dir / (node_dir or "") / rundir.MPS_LOGS
        or_without = ["--or-without"] * (resolved.mps_choice is not None)  # auto's daemon: without it if it fails
        argv = [python, "-m", MPS_MODULE, *or_without, str(run_dir), str(mps_logs), "--", *argv]
    if multi_node:  # set even if the caller's environment has them: they describe this launch
        env[RECIPE_HASH_ENV] = recipe_hash
        env[NODE_RANK_ENV] = str(recipe.distributed.node_rank)
    spec = LaunchSpec(
        model_path=model_path(resolved, run_dir),
        algorithm=recipe.algorithm,
        backend=resolved.backend,
        device=resolved.device,
        world_size=resolved.world_size,
        trl_args=trl_args(resolved, run_dir),
        engine=engine_options(resolved),
        recipe_hash=recipe_hash,
        resume_from=resume_from,
        builtin_model=resolved.builtin_layout is not None,
        model_dtype=resolved.model_dtype,
        held_out_rows=held_out_rows(recipe),
        engine_process=engine_in_process(recipe),
        overlap=recipe.generation.overlap == "one_step",
    )
    if multi_node:
        # Shared by all nodes (each writes the same bytes, the first one wins): no node rank in it.
        shared_recipe = (
            "# Shared by every node of this run; each node's rank comes from --node-rank or Slurm.\n"
            + dump_recipe(recipe, exclude={"distributed": {"node_rank"}})
        )
        files = {
            rundir.RECIPE: shared_recipe,
            rundir.LAUNCH_SPEC: spec.to_json(),
            f"{node_dir}/{rundir.LAUNCH_SCRIPT}": launch_script(argv, env, cwd, run_dir, node_dir),
            f"{node_dir}/{rundir.IDENTITY}": json.dumps(
                {"node_rank": recipe.distributed.node_rank, "recipe_hash": recipe_hash, "identity": identity}, indent=2
            )
            + "\n",
        }
    else:
        files = {
            rundir.RECIPE: dump_recipe(recipe),
            rundir.LAUNCH_SPEC: spec.to_json(),
            rundir.LAUNCH_SCRIPT: launch_script(argv, env, cwd, run_dir, None),
        }
    if resolved.deepspeed is not None:
        files[rundir.DEEPSPEED] = json.dumps(resolved.deepspeed, indent=2) + "\n"
    if forecast is not None:
        files[rundir.FORECAST] = forecast
    builtin = None
    if resolved.builtin_layout:
        # Built once per machine into the cache (a 7B layout takes minutes); the run dir's model/ links to it.
        key = f"{resolved.builtin_layout}-seed{recipe.trainer.seed}-{resolved.model_dtype}"
        builtin = {
            "layout": resolved.builtin_layout,
            "out_dir": str(cache_dir / "builtin-models" / key),
            "seed": recipe.trainer.seed,
            "dtype": resolved.model_dtype,
            "link": str(run_dir / rundir.MODEL_LINK),
        }
    return LaunchPlan(
        run_dir=run_dir,
        argv=argv,
        env=env,
        files=files,
        builtin_model=builtin,
        node_dir=node_dir,
        recipe_hash=recipe_hash,
        resume_from=resume_from,
    )
