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

import contextlib
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from colocate_rl.errors import UserError
from colocate_rl.plan.choices import EngineProcessesChoice, OverlapChoice
from colocate_rl.plan.host import Host
from colocate_rl.plan.launch_checks import check_launch_paths
from colocate_rl.plan.launch_plan import LaunchPlan, cache_dir, make_plan
from colocate_rl.plan.preflight import Preflight, preflight
from colocate_rl.plan.resolve import bind_to_host, check_engine
from colocate_rl.plan.resolved import Resolved, with_values
from colocate_rl.plan.sources import explain_sources, layer_distributed
from colocate_rl.plan.tools import check_tool_layout
from colocate_rl.recipe.load import apply_overrides, parse_recipe, read_yaml
from colocate_rl.recipe.paths import resolve_override_paths, resolve_paths
from colocate_rl.recipe.schema import Recipe
from colocate_rl.recipe.shipped import find_recipe
from colocate_rl.rundir import default_run_dir


def resolve(recipe: Recipe, host: Host, pre: Preflight | None = None) -> Resolved:
    """Bind `recipe` to `host` (over its pre-flight `pre`, run here when not given) and resolve the keys that are
    auto by the memory estimate: vLLM's share (what one generation batch needs + a margin), the layout (the fastest
    that fits, estimated with vLLM asleep), `generation.sleep_level` for it (0 when trainer and vLLM fit together,
    else 2), then `trainer.micro_batch_size` (the largest that fits; none to choose when the step is one micro-batch;
    level 2 instead of 0 where the step-time forecast says a larger micro-batch asleep is faster);
    `engine_processes: auto` before the share (which holds every copy); `overlap: auto` after the sleep level
    (one_step when vLLM stays awake and nothing rules it out; one_step itself makes `sleep_level: auto` 0), `mps`
    last. With overlap, the engine process and their count all auto, the plan is made as overlap would run it (the
    engine in its own process, as many as one_step gets), then with one engine process; where neither overlaps,
    without overlap. The resolved recipe holds what was chosen, `recorded_recipe()` every value. One UserError
    lists all."""
    pre = pre if pre is not None else preflight(recipe)
    gen = recipe.generation
    if not gen.overlap == gen.engine_process == gen.engine_processes == "auto":
        return _resolve(recipe, host, pre)
    try:
        tried = _resolve(recipe, host, pre, plan_overlap=True)
    except UserError as e:  # the engine process did not fit: planned without overlap (which may fail in turn)
        why = f"with vLLM in an engine process of its own: {e.lines[0]}"
    else:
        if tried.recipe.generation.overlap == "one_step" or tried.recipe.generation.engine_process == "auto":
            return tried  # overlapped, or nothing to plan overlap for (`overlap_may_run`)
        why = tried.overlap_choice.reason
        if (n := tried.recipe.generation.engine_processes) > 1:
            with contextlib.suppress(UserError):
                one = _resolve(with_values(recipe, {"generation.engine_processes": 1}), host, pre, plan_overlap=True)
                if one.recipe.generation.overlap == "one_step":
                    fewer = f"with {n} engine processes trainer and vLLM did not fit awake together for overlap"
                    return replace(one, engine_processes_choice=EngineProcessesChoice(1, fewer))
    off = _resolve(with_values(recipe, {"generation.overlap": "off"}), host, pre)
    if off.recipe.generation.sleep_level == 0:
        why = (
            "trainer and vLLM fit awake together only with vLLM in the rank's process (an engine process of its own "
            "takes a CUDA context and a staging buffer more)"
        )
    return replace(off, overlap_choice=OverlapChoice(False, why))


def _resolve(recipe: Recipe, host: Host, pre: Preflight, plan_overlap: bool = False) -> Resolved:
    from colocate_rl.memory import autolayout as al
    from colocate_rl.memory.micro_batch import choose_micro_batch_and_sleep, with_micro_batch
    from colocate_rl.plan.overlap import choose_overlap, overlap_may_run

    as_written, auto_sleep = recipe, recipe.generation.sleep_level == "auto"
    overlap = recipe.generation.overlap
    if auto_sleep:  # one_step keeps vLLM awake: 0, decided by the recipe rather than by memory
        recipe = al.with_sleep_level(recipe, 0 if overlap == "one_step" else 2)
    if isinstance(recipe.trainer.micro_batch_size, int):
        recipe = with_micro_batch(recipe, recipe.trainer.micro_batch_size)
    if auto_share := recipe.generation.vllm_gpu_memory_utilization == "auto":  # any: the batch's need is the same
        recipe = al.with_share(recipe, al.DEFAULT_SHARE)
    resolved = bind_to_host(recipe, host, pre)
    gpu_gib = min(g.memory_gib for g in host.gpus) if host.gpus else None
    if plan_overlap and overlap_may_run(as_written, resolved.backend):  # estimated as overlap would run
        resolved = replace(resolved, recipe=with_values(resolved.recipe, {"generation.engine_process": True}))
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
