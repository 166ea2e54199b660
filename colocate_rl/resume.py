"""`train --resume RUN_DIR`: the run's own recipe as its run directory recorded it, planned to continue from its newest
whole checkpoint; nothing is decided again (`plan_resume`), and what a resume may change (`RESUMABLE`). Torch-free."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from colocate_rl.errors import UserError
from colocate_rl.pipeline import for_launch, resolve
from colocate_rl.plan.host import Host
from colocate_rl.plan.launch_checks import check_launch_paths, newest_whole_checkpoint
from colocate_rl.plan.launch_plan import LaunchPlan, cache_dir, make_plan
from colocate_rl.plan.preflight import preflight
from colocate_rl.plan.resolved import Resolved, auto_keys
from colocate_rl.plan.sources import layer_distributed
from colocate_rl.recipe.load import apply_overrides, parse_recipe, read_yaml
from colocate_rl.recipe.paths import resolve_override_paths
from colocate_rl.recipe.schema import Recipe
from colocate_rl.rundir import RunDir

if TYPE_CHECKING:
    from colocate_rl.plan.launch_spec import LaunchSpec


# What a resumed run may change: nothing its checkpoint was trained with (model, data, rewards, optimizer, batch,
# ranks, trainer layout: the run directory records every value `auto` decided, and a resume decides nothing again);
# more steps, logging, checkpoints, the watchdog, report backends, the push to the Hub, the node's place in the job.
RESUMABLE = (
    "trainer.max_steps",
    "trainer.logging_steps",
    "checkpoint.",
    "watchdog.",
    "output.report_to",
    "output.save_model",
    "output.push_to_hub",
    "output.hub_private",
    "generation.check_weights",
    "generation.mps",  # how the GPU runs the kernels, not what they compute
    "distributed.node_rank",
    "distributed.rdzv_endpoint",
    "distributed.rdzv_id",
    "distributed.rdzv_backend",
)


def _earlier_version_values(recipe: Recipe, spec: LaunchSpec, deepspeed: dict[str, Any] | None) -> dict[str, Any]:
    """A run directory written before every decided value went into its recipe.yaml: the keys it leaves `auto`, as
    its launch.json and deepspeed.json hold them (dotted key → value; {} for a run directory of this version)."""
    from colocate_rl.plan.deepspeed import AUTO_BASE_CONFIG, ZeroLayout

    args, zero = spec.trl_args, ZeroLayout.of(deepspeed)
    known = {
        "distributed.nproc_per_node": spec.world_size // recipe.distributed.nnodes,
        "distributed.mixed_precision": "bf16" if args.get("bf16") else "fp16" if args.get("fp16") else "no",
        "model.dtype": spec.model_dtype,
        "generation.backend": spec.backend,
        "trainer.gradient_checkpointing": bool(args.get("gradient_checkpointing")),
        "distributed.zero_stage": zero.stage,
        "generation.engine_process": spec.engine_process,  # False before it existed
        "generation.engine_processes": spec.engine.processes if spec.engine is not None else 1,  # 1 before it existed
        "generation.mps": "off",  # before it existed
    }
    out = {key: value for key, value in known.items() if key in auto_keys(recipe)}
    if "distributed.zero_stage" in out:
        dist = recipe.distributed
        out["distributed.deepspeed"] = dist.deepspeed or AUTO_BASE_CONFIG
        out.update({f"distributed.{k}": getattr(zero, k) for k in ("offload_optimizer", "offload_params")})
    return out


def _resume_checkpoint(paths: RunDir, run_dir: Path) -> Path:
    """The checkpoint a resume continues from: the newest complete one whose files are whole. A newer one with a file
    cut off is passed over with a note on stderr; UserError naming the file when none is left."""
    complete = paths.complete_checkpoints()
    if not complete:
        raise UserError(
            f"--resume {run_dir}: no complete checkpoint in {paths.checkpoints} (one cut off mid-save does not "
            "count); start the run again with `colocate-rl train`"
        )
    latest, passed = newest_whole_checkpoint(complete)
    if latest is None:
        raise UserError(
            f"--resume {run_dir}: no checkpoint is whole ({'; '.join(passed)}); restore the file from a copy, or start "
            "the run again with `colocate-rl train`"
        )
    for problem in passed:  # the launcher prints what it resumes from; this says why not from the newest
        print(f"note: {problem}: resuming from {latest.name}, the newest whole checkpoint", file=sys.stderr)
    return latest


def _check_unedited(paths: RunDir, as_written: Resolved, recorded_hash: str) -> None:
    """UserError naming recipe.yaml when its recipe (`as_written`, resolved) is not the one launch.json's recipe hash
    was made for: the file was edited after the run was written."""
    from colocate_rl.plan.identity import identity_hash, recipe_identity

    found = identity_hash(recipe_identity(as_written))
    if found != recorded_hash:
        raise UserError(
            f"{paths.recipe}: edited since the run wrote it (its recipe hash is {found}, launch.json's {recorded_hash}); "
            "a resume trains on with what the checkpoint was trained with: undo the edit (steps, logging and "
            "checkpoints may change with --set, e.g. --set trainer.max_steps=N), or start a new run from the edited "
            "recipe"
        )


def plan_resume(
    run_dir: Path,
    overrides: Mapping[str, Any] | None = None,
    *,
    host: Host,
    flags: Mapping[str, Any] | None = None,
    env: Mapping[str, str],
    cwd: Path,
    python: str = sys.executable,
) -> tuple[Resolved, LaunchPlan]:
    """`train --resume RUN_DIR`: the run's own recipe as its run directory recorded it (every `auto` decided when
    it started, and its deepspeed.json as written) plus the `RESUMABLE` overrides, planned to continue from its newest
    complete checkpoint whose files are whole (launch.json's resume_from, which every rank takes) with the same ranks;
    nothing is decided again. Fails (UserError) when there is nothing to resume, the run finished, an override would
    change what the checkpoint carries, recipe.yaml was edited since (launch.json's recipe hash), deepspeed.json is
    broken, or the ranks differ."""
    from colocate_rl.plan.launch_checks import run_deepspeed
    from colocate_rl.plan.launch_spec import LaunchSpec

    paths = RunDir((cwd / run_dir) if not Path(run_dir).is_absolute() else Path(run_dir))
    if not paths.recipe.is_file() or not paths.launch_spec.is_file():
        raise UserError(
            f"--resume {run_dir}: not a run directory (no recipe.yaml and launch.json); pass the run directory "
            "`colocate-rl train` printed"
        )
    if paths.done.exists():
        raise UserError(f"--resume {run_dir}: the run already finished ({paths.done}); start a new run instead")
    frozen = [key for key in overrides or {} if not key.startswith(RESUMABLE)]
    if frozen:
        raise UserError(
            *(
                f"--set {key}: a resumed run keeps what its checkpoint was trained with; start a new run to change it "
                f"(a resume may change only {', '.join(k.rstrip('.') for k in RESUMABLE)})"
                for key in frozen
            )
        )
    latest, earlier = _resume_checkpoint(paths, run_dir), LaunchSpec.read(paths.launch_spec)
    deepspeed = run_deepspeed(paths, earlier)
    recorded = read_yaml(paths.recipe)
    earlier_values = _earlier_version_values(parse_recipe(recorded, str(paths.recipe)), earlier, deepspeed)
    overrides = resolve_override_paths(overrides or {}, cwd)  # the run's recipe.yaml holds absolute paths
    data, _ = layer_distributed(apply_overrides(recorded, earlier_values), overrides, flags or {}, env)
    recipe = parse_recipe(data, str(paths.recipe))
    left = auto_keys(recipe)
    if left:  # sleep level and micro-batch: recorded by every version that had them auto
        raise UserError(
            f"--resume {run_dir}: its recipe.yaml leaves {', '.join(left)} auto (written by an earlier colocate-rl), "
            "so the value it trained with is not known; start a new run"
        )
    resolved = resolve(recipe, host, for_launch(preflight(recipe), host))
    if not earlier_values:  # a run directory of this version: its recipe.yaml must be the one launch.json was made for
        as_written = resolve(parse_recipe(recorded, str(paths.recipe)), host, resolved.preflight)
        _check_unedited(paths, replace(as_written, device=earlier.device, deepspeed=deepspeed), earlier.recipe_hash)
    if resolved.world_size != earlier.world_size:
        raise UserError(
            f"--resume {run_dir}: its checkpoints were written by {earlier.world_size} ranks and this launch has "
            f"{resolved.world_size}; resume with as many ranks (GPUs, nodes) as the run started with"
        )
    resolved = replace(resolved, deepspeed=deepspeed)  # as the run trained with it, whatever its base file says now
    step = int(latest.name.rpartition("-")[2])
    if resolved.recipe.trainer.max_steps <= step:
        raise UserError(
            f"trainer.max_steps: {resolved.recipe.trainer.max_steps} is not beyond the checkpoint's step {step}; "
            f"raise it (--set trainer.max_steps=N) to train on"
        )
    check_launch_paths(paths.path, cache_dir(env), this_machine=not host.assumed)
    plan = make_plan(
        resolved,
        run_dir=paths.path,
        python=python,
        cwd=cwd,
        cache_dir=cache_dir(env),
        base_env=env,
        resume_from=str(latest),
    )  # forecast.json stays as the run's start wrote it
    return resolved, plan
