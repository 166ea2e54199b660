"""`colocate-rl validate` and `colocate-rl train`: parse options, resolve and plan (colocate_rl.pipeline), execute
(colocate_rl.launch.execute), render the summary, progress and outcome."""

from __future__ import annotations

import os
import signal
import sys
from datetime import datetime
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from colocate_rl.cli.common import (
    GpusOpt,
    NnodesOpt,
    NodeRankOpt,
    PlanMemOpt,
    RdzvEndpointOpt,
    RdzvIdOpt,
    RecipeArg,
    SetOpt,
    SetStrOpt,
    app,
    console,
    guarded,
    parse_sets,
)
from colocate_rl.cli.progress import run_with_progress
from colocate_rl.errors import UserError


def _load(recipe: str, overrides: dict, gpus: int | None, gpu_memory: float | None, flags: dict):
    from colocate_rl.pipeline import load_resolved
    from colocate_rl.plan.host import planning_host

    resolved, sources = load_resolved(
        recipe, overrides, host=planning_host(gpus, gpu_memory), flags=flags, env=os.environ
    )
    _check_push(resolved)
    return resolved, sources


def _check_push(resolved) -> None:
    """`output.push_to_hub` on node 0 needs a token and no offline switch: said before anything is written."""
    from colocate_rl.launch.push import check_push

    problems = check_push(resolved.recipe, os.environ)
    if problems:
        raise UserError(*problems)


def push_line(output) -> str:
    """What `output.push_to_hub` will do, for the summary and `--dry-run`."""
    visibility = "private" if output.hub_private else "public"
    return f"final/ to {output.push_to_hub} on the Hub after the run (node 0; a new repo is {visibility})"


def summary_table(resolved, run_dir: Path | None = None, recipe_hash: str = "", log: Path | None = None) -> Table:
    """What the run will be, one row per part; the run directory (and its log) last."""
    from colocate_rl.plan.deepspeed import ZeroLayout
    from colocate_rl.plan.overlap import engine_in_process

    r = resolved.recipe
    t = r.trainer
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    dist = r.distributed
    ds = resolved.deepspeed
    layout = f"ZeRO-{ZeroLayout.of(ds).stage} ({dist.deepspeed or 'zero3'})" if ds else "DDP"
    if resolved.layout_choice is not None:
        layout = f"{resolved.layout_choice.chosen.label} (auto)"
    host = f"{resolved.host.gpu_count} GPU(s)" + (" assumed" if resolved.host.assumed else "")
    gen = r.generation
    rows = [
        ("recipe", f"{r.name} ({r.algorithm})"),
        (
            "model",
            f"{r.model.name} ({resolved.model_dtype})" + (f", LoRA {r.model.lora.summary()}" if r.model.lora else ""),
        ),
        ("data", r.data.source),
        (
            "rewards",
            ", ".join(f"{x.name or x.model}×{x.weight:g}" for x in r.rewards) or "the environment's get_reward",
        ),
        *([("tools", r.tools.summary())] if r.tools.active else []),
        (
            "ranks",
            f"{dist.nnodes} node(s) × {resolved.nproc_per_node} = {resolved.world_size} on {resolved.device} ({host})",
        ),
        ("trainer", f"{layout}, precision {resolved.precision}"),
        (
            "generation",
            resolved.backend
            + (
                f", gpu util {gen.vllm_gpu_memory_utilization}, TP {gen.tensor_parallel_size}, sleep {gen.sleep_level}"
                + (" (auto)" if resolved.sleep_choice is not None else "")
                if resolved.backend == "vllm"
                else ""
            )
            + (", overlap one_step" if gen.overlap == "one_step" else "")
            + (" (auto)" if gen.overlap == "one_step" and resolved.overlap_choice is not None else "")
            + (", under CUDA MPS" if gen.mps == "on" else "")
            + (", engine in its own process" if engine_in_process(r) else "")
            + (f" ×{gen.engine_processes}" if engine_in_process(r) and gen.engine_processes > 1 else ""),
        ),
        (
            "steps",
            f"{t.max_steps} × {t.step_completions * resolved.world_size} "
            f"completions ({t.num_generations} per prompt)"
            + (
                f", micro-batches of {t.per_device_train_batch_size} × {t.gradient_accumulation_steps} per rank"
                if t.gradient_accumulation_steps > 1
                else ""
            ),
        ),
    ]
    if r.eval.every_steps is not None:
        ev = r.eval
        where = ev.source or f"held out of {r.data.source}"
        sampling = "greedy" if ev.temperature == 0 else f"temperature {ev.temperature:g}"
        rows.append(("eval", f"every {ev.every_steps} steps, {ev.num_samples} prompts ({where}), {sampling}"))
    if dist.nnodes > 1:
        rows.append(
            (
                "node",
                f"{dist.node_rank} of {dist.nnodes}, rendezvous {dist.rdzv_backend} {dist.rdzv_endpoint} "
                f"(id {dist.rdzv_id})",
            )
        )
    if r.output.push_to_hub is not None:
        rows.append(("push", push_line(r.output)))
    if recipe_hash:
        rows.append(("recipe hash", f"{recipe_hash} (the same on every node)"))
    if run_dir is not None:
        rows.append(("run dir", str(run_dir)))
    if log is not None:
        rows.append(("log", str(log)))
    for key, value in rows:
        table.add_row(key, value)
    return table


def push_to_hub(run_dir: Path, repo: str, private: bool, console) -> int:
    """`output.push_to_hub` after a successful run: upload `<run_dir>/final`, say how it went in one line; returns
    0, or 1 when the push failed (130 when interrupted) — the run's result stays in final/ either way."""
    import shlex

    from rich.markup import escape

    from colocate_rl.launch.push import push_final
    from colocate_rl.rundir import RunDir

    final = RunDir(run_dir).final
    pushed = push_final(run_dir, repo, private)
    if pushed.error is None:
        console.print(f"pushed {final} to {pushed.url}", markup=False, highlight=False, soft_wrap=True)
        return 0
    retry = shlex.join(["hf", "upload", repo, str(final), *(["--private"] if private else [])])
    text = f"push to {repo} failed: {pushed.error}; the model is in {final} — retry with: {retry}"
    console.print(f"[red]error:[/] {escape(text)}", highlight=False, soft_wrap=True)
    return 130 if pushed.interrupted else 1


def choice_lines(resolved) -> list[str]:
    """What each `auto` chose and why, its peaks labelled: the layout's are estimated with vLLM asleep while the
    trainer runs (sleep level 2, before `sleep_level: auto` is decided) unless the recipe keeps it awake; the sleep
    level's is the peak with vLLM awake."""
    lines = resolved.choice_lines()
    layout, sleep = resolved.layout_choice, resolved.sleep_choice
    if resolved.backend != "vllm":
        return lines
    if layout is not None and layout.limit_gib is not None:
        level = 2 if sleep is not None else resolved.recipe.generation.sleep_level
        at = lines.index(layout.lines()[0])
        lines[at] += f"; peaks with vLLM {'asleep' if level else 'awake'} while training (sleep level {level})"
    if sleep is not None and sleep.peak_gib is not None:
        lines[lines.index(sleep.line())] += "; peak with vLLM awake while training"
    return lines


def forecast_lines(resolved) -> list[str]:
    """The step-time forecast (colocate_rl.memory.forecast) of `resolved`: a few lines, or one saying why none."""
    from colocate_rl.memory.forecast import forecast
    from colocate_rl.memory.forecast import forecast_lines as lines

    return lines(forecast(resolved))


@app.command()
@guarded
def validate(
    recipe: RecipeArg,
    set_: SetOpt = None,
    set_str: SetStrOpt = None,
    gpus: GpusOpt = None,
    nnodes: NnodesOpt = None,
    node_rank: NodeRankOpt = None,
    rdzv_endpoint: RdzvEndpointOpt = None,
    rdzv_id: RdzvIdOpt = None,
    gpu_memory: PlanMemOpt = None,
) -> None:
    """Check a recipe (schema and cross-field checks against this machine) without running it."""
    from colocate_rl.plan.sources import parse_node_flags

    flags = parse_node_flags(nnodes, node_rank, rdzv_endpoint, rdzv_id)
    resolved, _ = _load(recipe, parse_sets(set_, set_str), gpus, gpu_memory, flags)
    console.print(summary_table(resolved))
    for line in choice_lines(resolved) + forecast_lines(resolved):
        console.print(line, highlight=False, soft_wrap=True)
    console.print("[green]recipe is valid[/]")


@app.command()
@guarded
def train(
    recipe: Annotated[
        str | None,
        typer.Argument(metavar="RECIPE", help="Recipe file, or the name of a shipped recipe (not with --resume)."),
    ] = None,
    set_: SetOpt = None,
    set_str: SetStrOpt = None,
    resume: Annotated[
        Path | None,
        typer.Option(
            "--resume",
            metavar="RUN_DIR",
            help="Continue an interrupted run from its newest complete checkpoint, with its own recipe.",
        ),
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the launch command; write nothing.")] = False,
    run_dir: Annotated[
        Path | None,
        typer.Option(
            "--run-dir",
            metavar="DIR",
            help="Run directory (default runs/<name>-<time>; on several nodes runs/<name>-<rdzv id>).",
        ),
    ] = None,
    gpus: GpusOpt = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Stream every rank's output.")] = False,
    nnodes: NnodesOpt = None,
    node_rank: NodeRankOpt = None,
    rdzv_endpoint: RdzvEndpointOpt = None,
    rdzv_id: RdzvIdOpt = None,
    gpu_memory: PlanMemOpt = None,
) -> None:
    """Train: validate the recipe, write the run directory, run torchrun with the worker on every rank."""
    from colocate_rl.launch import owner
    from colocate_rl.launch.watchdog import Watchdog
    from colocate_rl.pipeline import plan_run
    from colocate_rl.plan.slurm import slurm_note
    from colocate_rl.plan.sources import NODE_KEYS, parse_node_flags
    from colocate_rl.rundir import NODES_DIR, RunDir, summarize

    flags = parse_node_flags(nnodes, node_rank, rdzv_endpoint, rdzv_id)
    if (recipe is None) == (resume is None):
        raise UserError("train: give a RECIPE to start a run, or --resume RUN_DIR to continue one (not both)")
    lock = None  # the run dir's owner lock: released when train returns (this process may go on: tests)
    try:
        if resume is not None:
            if run_dir is not None:
                raise UserError("--run-dir: a resumed run stays in its own directory; drop --run-dir")
            if not dry_run and not (resume / NODES_DIR).is_dir():  # one node: refused at once while the run is live
                lock = owner.take(resume, create=False, command=_command())
            from colocate_rl.plan.host import planning_host
            from colocate_rl.resume import plan_resume

            resolved, plan = plan_resume(
                resume,
                parse_sets(set_, set_str),
                host=planning_host(gpus, gpu_memory),
                flags=flags,
                env=os.environ,
                cwd=Path.cwd(),
                python=sys.executable,
            )
            _check_push(resolved)
            sources = {key: "recipe" for key in NODE_KEYS}
        else:
            resolved, sources = _load(recipe, parse_sets(set_, set_str), gpus, gpu_memory, flags)
            plan = plan_run(
                resolved, run_dir, env=os.environ, now=datetime.now(), cwd=Path.cwd(), python=sys.executable
            )
        dist = resolved.recipe.distributed
        note = slurm_note(os.environ, dist.nnodes, sources["nnodes"])
        if dry_run:
            _print_dry_run(resolved, plan, sources, note)
            return
        if gpus is not None or gpu_memory is not None:
            raise UserError(
                f"{'--gpus' if gpus is not None else '--gpu-memory'}: only for planning (validate, train "
                "--dry-run); a real run uses the GPUs it finds"
            )
        if lock is None:  # held until this process ends: a second launch of this run (on this node) is refused
            lock = owner.take(plan.run_dir, plan.node_dir, create=plan.resume_from is None, command=_command())
        if plan.resume_from is None:
            lock.claim()
        if note:
            console.print(f"[yellow]note:[/] {note}", highlight=False)
        log = RunDir(plan.run_dir).log(plan.node_dir)
        console.print(summary_table(resolved, plan.run_dir, plan.recipe_hash if dist.nnodes > 1 else "", log))
        if plan.resume_from is not None:
            console.print(f"resuming from {plan.resume_from}", highlight=False)
        code = _launch(plan, lock, verbose, Watchdog.for_run(resolved, plan.run_dir))
        summary = summarize(plan.run_dir)
        if summary["steps"]:
            console.print(_run_summary(summary))
        output = resolved.recipe.output
        if code == 0 and output.push_to_hub is not None and dist.node_rank == 0:
            code = push_to_hub(plan.run_dir, output.push_to_hub, output.hub_private, console)
        if code == 0 and summary["steps"]:  # a stopped or failed run ends on its resume command or its error instead
            console.print(f"next: colocate-rl report {plan.run_dir}", highlight=False, soft_wrap=True)
        raise typer.Exit(code)
    finally:
        if lock is not None:
            lock.release()


def _print_dry_run(resolved, plan, sources: dict[str, str], note: str | None) -> None:
    """What `train --dry-run` prints: the run dir, where the node settings came from, every automatic choice and the
    forecast as comments, then the torchrun command line."""
    from colocate_rl.plan.sources import NODE_KEYS

    dist = resolved.recipe.distributed
    print(f"# run dir (not created): {plan.run_dir}")
    for key in NODE_KEYS:  # where the node settings came from (all of them on several nodes)
        if dist.nnodes > 1 or sources[key] != "default":
            print(f"# distributed.{key} = {getattr(dist, key)}  ({sources[key]})")
    if dist.nnodes > 1:
        print(f"# recipe hash: {plan.recipe_hash} (must be the same on every node)")
    if note:
        print(f"# note: {note}")
    for line in choice_lines(resolved) + forecast_lines(resolved):
        print(f"# {line}")
    if plan.resume_from is not None:
        print(f"# resumes from {plan.resume_from}")
    if resolved.recipe.output.push_to_hub is not None:
        print(f"# pushes {push_line(resolved.recipe.output)}")
    print(plan.command_line())


def _run_summary(summary: dict) -> Table:
    """The table `train` prints after a run that logged steps."""
    table = Table(title="run summary")
    for col in ("steps", "reward first → last", "train time"):
        table.add_column(col)
    table.add_row(
        str(summary["steps"]),
        f"{summary['reward_first']:.3f} → {summary['reward_last']:.3f}",
        f"{summary['train_s']:.1f} s",
    )
    return table


def _command() -> str:
    """This command line as the user typed it, for the owner lock (`python -m colocate_rl` shows as colocate-rl)."""
    import shlex

    return shlex.join(["colocate-rl", *sys.argv[1:]])


def _launch(plan, lock, verbose: bool, watchdog) -> int:
    """Build, launch and watch the run. A stop signal before torchrun starts (while the built-in model is built)
    ends `train` with one line and 130/143; a new run that ends before torchrun started (stopped, or its build
    failed) leaves no run directory behind, a resumed one is left as it was."""
    from colocate_rl.launch.supervise import Stopped, stop_signals_raise
    from colocate_rl.rundir import RunDir

    try:
        with stop_signals_raise():
            return run_with_progress(plan, console, verbose=verbose, watchdog=watchdog)
    except BaseException as e:
        started = RunDir(plan.run_dir).log(plan.node_dir).exists()  # torchrun ran: keep what it wrote
        if lock is not None and lock.fresh and not started:
            lock.discard()
        if not isinstance(e, Stopped):
            raise
        if started:
            line = f"stopped ({e})"
        elif plan.resume_from is not None:
            line = f"stopped ({e}) before training started; resume with: colocate-rl train --resume {plan.run_dir}"
        else:
            line = f"stopped ({e}) before training started; nothing was kept"
        console.print(line, highlight=False, soft_wrap=True)
        return 130 if e.signum == signal.SIGINT else 143
