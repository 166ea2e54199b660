"""From a recipe argument to a resolved recipe and a launch plan: the steps every verb shares.

    find_recipe → read YAML → paths made absolute (colocate_rl.recipe.paths) → layer node keys and overrides (defaults < recipe < Slurm < overrides and node flags)
    → parse (schema) → pre-flight (the files and reward code the recipe names, read and run once: plan.preflight)
    → bind to the host (cross-field checks) → each auto decided (`resolve` says in which order) → plan

Everything after the pre-flight is a pure function of the recipe, the host and the pre-flight's result, so a command
that resolves many variants of one recipe (`resolver`) reads the recipe file and the files it names once. The run
directory records every decided value (`Resolved.recorded_recipe`); `plan_resume` reads them and decides nothing.
Overrides travel as a mapping of dotted key → value (`colocate_rl.recipe.load.parse_sets` turns `--set` strings
into one). Every step raises UserError with one line per problem; nothing here writes a file. Torch-free.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from colocate_rl.errors import UserError
from colocate_rl.plan.host import Host
from colocate_rl.plan.launch_checks import check_launch_paths, newest_whole_checkpoint
from colocate_rl.plan.launch_plan import LaunchPlan, cache_dir, make_plan
from colocate_rl.plan.preflight import Preflight, preflight
from colocate_rl.plan.resolve import bind_to_host, check_engine
from colocate_rl.plan.resolved import Resolved, auto_keys
from colocate_rl.plan.sources import explain_sources, layer_distributed
from colocate_rl.plan.tools import check_tool_layout
from colocate_rl.recipe.load import apply_overrides, parse_recipe, read_yaml
from colocate_rl.recipe.paths import resolve_override_paths, resolve_paths
from colocate_rl.recipe.schema import Recipe
from colocate_rl.recipe.shipped import find_recipe
from colocate_rl.rundir import RunDir, default_run_dir

if TYPE_CHECKING:
    from colocate_rl.plan.launch_spec import LaunchSpec


def resolve(recipe: Recipe, host: Host, pre: Preflight | None = None) -> Resolved:
    """Bind `recipe` to `host` (over its pre-flight `pre`, run here when not given) and resolve the keys that are
    auto by the memory estimate: vLLM's share (what one generation batch needs + a margin), the layout (the fastest
    that fits, estimated with vLLM asleep), `generation.sleep_level` for it (0 when trainer and vLLM fit together,
    else 2), then `trainer.micro_batch_size` (the largest that fits; none to choose when the step is one micro-batch;
    level 2 instead of 0 where the step-time forecast says a larger micro-batch asleep is faster);
    `engine_processes: auto` before the share (which holds every copy); `overlap: auto` after the sleep level
    (one_step when vLLM stays awake and nothing rules it out; one_step itself makes `sleep_level: auto` 0), `mps`
    last; the resolved recipe holds what was chosen, `recorded_recipe()` every value. One UserError lists all."""
    from colocate_rl.memory import autolayout as al
    from colocate_rl.memory.micro_batch import choose_micro_batch_and_sleep, with_micro_batch
    from colocate_rl.plan.overlap import choose_overlap

    pre = pre if pre is not None else preflight(recipe)
    auto_sleep = recipe.generation.sleep_level == "auto"
    overlap = recipe.generation.overlap
    if auto_sleep:  # one_step keeps vLLM awake: 0, decided by the recipe rather than by memory
        recipe = al.with_sleep_level(recipe, 0 if overlap == "one_step" else 2)
    if isinstance(recipe.trainer.micro_batch_size, int):
        recipe = with_micro_batch(recipe, recipe.trainer.micro_batch_size)
    if auto_share := recipe.generation.vllm_gpu_memory_utilization == "auto":  # any: the batch's need is the same
        recipe = al.with_share(recipe, al.DEFAULT_SHARE)
    resolved = bind_to_host(recipe, host, pre)
    gpu_gib = min(g.memory_gib for g in host.gpus) if host.gpus else None
    resolved = al.with_engine_processes(resolved, auto_share)  # before the share, which holds every copy
    if auto_share:  # first: the layout, sleep level and micro-batch are chosen for what the trainer has left
        share = al.choose_share(resolved, gpu_gib)
        resolved = replace(resolved, recipe=al.with_share(resolved.recipe, share.share), share_choice=share)
    dist, trainer = recipe.distributed, recipe.trainer
    auto_stage = dist.zero_stage == "auto"
    if auto_stage or trainer.gradient_checkpointing == "auto":

        def layout_problems(config) -> list[str]:
            tools = check_tool_layout(recipe, resolved.backend, resolved.nproc_per_node, config)
            return check_engine(recipe, config) + tools

        choice = al.choose_layout(
            resolved, gpu_gib, valid=lambda config: not layout_problems(config), ram_gib=host.ram_gib
        )
        engine_problems = layout_problems(choice.deepspeed) if auto_stage else []
        if engine_problems:
            raise UserError(*engine_problems)
        resolved = replace(
            resolved,
            deepspeed=choice.deepspeed,
            gradient_checkpointing=choice.gradient_checkpointing,
            layout_choice=choice,
        )
    if auto_sleep and overlap != "one_step":
        sleep = al.choose_sleep_level(resolved, gpu_gib)
        resolved = replace(resolved, recipe=al.with_sleep_level(resolved.recipe, sleep.level), sleep_choice=sleep)
    if overlap == "auto":
        choice = choose_overlap(resolved.recipe, resolved.backend, auto_sleep)
        gen = resolved.recipe.generation.model_copy(update={"overlap": "one_step" if choice.on else "off"})
        resolved = replace(
            resolved, recipe=resolved.recipe.model_copy(update={"generation": gen}), overlap_choice=choice
        )
    if recipe.trainer.micro_batch_size == "auto":  # may turn the sleep level's 0 to 2: see micro_batch
        resolved = choose_micro_batch_and_sleep(resolved, gpu_gib)
    return al.with_mps(resolved)


@dataclass(frozen=True)
class RecipeInput:
    """A recipe argument read once: the recipe file, its mapping (paths absolute, node keys and overrides layered)
    and where each node key came from."""

    path: Path
    data: dict[str, Any]
    sources: dict[str, str]
    cwd: Path | None = None

    def parse(self, changes: Mapping[str, Any] | None = None) -> Recipe:
        """The recipe with `changes` (dotted key → value, on top of everything) applied, through the schema."""
        data = apply_overrides(self.data, resolve_override_paths(changes, self.cwd)) if changes else self.data
        try:
            return parse_recipe(data, str(self.path))
        except UserError as e:
            raise UserError(*explain_sources(e.lines, self.sources))


def read_recipe(
    recipe: str | Path,
    overrides: Mapping[str, Any] | None = None,
    *,
    flags: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> RecipeInput:
    """The recipe named by `recipe` (a file or a shipped recipe's name) with `overrides` and the node `flags`, under
    the Slurm environment `env`. Relative paths start from the recipe file's directory, those of `overrides` from
    `cwd` (default: the current directory); the result holds them absolute."""
    path = find_recipe(str(recipe))
    overrides = resolve_override_paths(overrides or {}, cwd)
    data = resolve_paths(read_yaml(path), path.parent, cwd=cwd, overridden=overrides)
    data, sources = layer_distributed(data, overrides, flags or {}, env or {})
    return RecipeInput(path, data, sources, cwd)


def for_launch(pre: Preflight, host: Host) -> Preflight:
    """`pre` with its launch problems among its problems when `host` is this machine (what its ranks would miss: a
    model's tokenizer or weights, a hub model or dataset out of reach); unchanged when planning for an assumed host
    (`--gpus N`: another machine, which reads them itself)."""
    if host.assumed or not pre.launch_problems:
        return pre
    return replace(pre, problems=(*pre.problems, *pre.launch_problems))


def resolver(source: RecipeInput, host: Host, *, launch: bool = False) -> Callable[[Mapping[str, Any]], Resolved]:
    """`resolve_with(changes)`: `source`'s recipe with the dotted-key `changes` resolved for `host` (`launch`: as
    `validate` and `train` check it, `for_launch`). The pre-flight runs on the first call and is reused by every later
    one whose changes leave what it read alone (the model, data, rewards, eval), so the files and reward code are read
    and run once however many variants are planned."""
    pre: list[Preflight] = []

    def resolve_with(changes: Mapping[str, Any]) -> Resolved:
        recipe = source.parse(changes)
        if not pre or not pre[0].matches(recipe):
            pre[:] = [preflight(recipe)]
        try:
            return resolve(recipe, host, for_launch(pre[0], host) if launch else pre[0])
        except UserError as e:
            raise UserError(*explain_sources(e.lines, source.sources))

    return resolve_with


def load_resolved(
    recipe: str | Path,
    overrides: Mapping[str, Any] | None = None,
    *,
    host: Host,
    flags: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> tuple[Resolved, dict[str, str]]:
    """`read_recipe`'s recipe resolved for `host`, checked for a launch there (`for_launch`); and each node key's source."""
    source = read_recipe(recipe, overrides, flags=flags, env=env, cwd=cwd)
    return resolver(source, host, launch=True)({}), source.sources


def plan_run(
    resolved: Resolved,
    run_dir: Path | None,
    *,
    env: Mapping[str, str],
    now: datetime,
    cwd: Path,
    python: str = sys.executable,
) -> LaunchPlan:
    """The launch plan of `train`: run dir from `--run-dir`, else the recipe's `output.run_dir`, else
    runs/<name>-<time> (several nodes: runs/<name>-<rdzv id>, the same on every node); caches under
    $XDG_CACHE_HOME/colocate-rl; the step-time forecast goes into the run dir's forecast.json (`forecast_file`).
    UserError when the run dir's name is too long or the cache cannot be written (`check_launch_paths`)."""
    dist = resolved.recipe.distributed
    if run_dir is None:
        explicit = resolved.recipe.output.run_dir
        run_dir = (
            Path(explicit)
            if explicit
            else default_run_dir(resolved.recipe.name, now, dist.rdzv_id if dist.nnodes > 1 else None)
        )
    run_dir = (cwd / run_dir) if not run_dir.is_absolute() else run_dir
    check_launch_paths(run_dir, cache_dir(env), this_machine=not resolved.host.assumed)
    return make_plan(
        resolved,
        run_dir=run_dir,
        python=python,
        cwd=cwd,
        cache_dir=cache_dir(env),
        base_env=env,
        forecast=forecast_file(resolved),
    )


def forecast_file(resolved: Resolved) -> str:
    """The run directory's forecast.json: the step-time forecast of `resolved` (or why there is none)."""
    from colocate_rl.memory.forecast import forecast, forecast_json

    return forecast_json(forecast(resolved))


def estimate_host(
    recipe: Recipe, *, gpus: int | None, gpu_memory_gib: float | None, detected: Host
) -> tuple[Host, float]:
    """The host `mem-probe --estimate` plans `recipe` for and one GPU's memory: `gpus` assumed GPUs, else the
    detected ones, else (no GPU here) the recipe's ranks per node; the memory given, else the detected GPU's. Fails
    (UserError) when neither says what to plan for."""
    from colocate_rl.plan.host import planning_host

    gib = gpu_memory_gib or (detected.gpus[0].memory_gib if detected.gpus else None)
    if gib is None:
        raise UserError("--gpu-memory: no GPU detected here; give the memory of one GPU in GiB, e.g. --gpu-memory 80")
    if gpus is None and not detected.gpus:  # plan for the recipe's ranks per node
        gpus = recipe.distributed.nproc_per_node
        if gpus == "auto":
            raise UserError(
                "--gpus: no GPU detected here and distributed.nproc_per_node is auto; pass --gpus N to "
                "plan for N GPUs per node"
            )
    return planning_host(gpus, gib, detect=lambda: detected), gib


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
