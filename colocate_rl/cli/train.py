"""`colocate-rl validate` and `colocate-rl train`: parse options, resolve and plan (colocate_rl.pipeline), execute
(colocate_rl.launch.execute), render the summary, progress and outcome."""

from __future__ import annotations

import os
import sys
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

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
from colocate_rl.errors import UserError

SHORT_PHASES = {
    "generate": "gen",
    "weight_sync": "sync",
    "weight_check": "check",
    "wake": "wake",
    "sleep": "sleep",
    "offload": "offload",
    "reload": "reload",
    "reward": "reward",
    "prepare": "prep",
    "train": "train",
    "optimizer": "opt",
}


def _load(recipe: str, overrides: dict, gpus: int | None, gpu_memory: float | None, flags: dict):
    from colocate_rl.pipeline import load_resolved
    from colocate_rl.plan.host import planning_host

    return load_resolved(recipe, overrides, host=planning_host(gpus, gpu_memory), flags=flags, env=os.environ)


def summary_table(resolved, run_dir: Path | None = None, recipe_hash: str = "") -> Table:
    from colocate_rl.plan.deepspeed import ZeroLayout

    r = resolved.recipe
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
        ("model", f"{r.model.name} ({resolved.model_dtype})"),
        ("data", r.data.source),
        ("rewards", ", ".join(f"{x.name or x.model}×{x.weight:g}" for x in r.rewards)),
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
                if resolved.backend == "vllm"
                else ""
            ),
        ),
        (
            "steps",
            f"{r.trainer.max_steps} × {r.trainer.per_device_train_batch_size * resolved.world_size} "
            f"completions ({r.trainer.num_generations} per prompt)",
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
    if recipe_hash:
        rows.append(("recipe hash", f"{recipe_hash} (the same on every node)"))
    if run_dir is not None:
        rows.append(("run dir", str(run_dir)))
    for key, value in rows:
        table.add_row(key, value)
    return table


def phase_summary(record: dict[str, Any]) -> str:
    """`gen 0.61s sync 0.10s train 0.30s opt 0.05s | GPU 14.5 GiB (peak 41.5)` from one metrics record."""
    phases = [
        f"{short} {record[f'time/{name}_s']:.2f}s"
        for name, short in SHORT_PHASES.items()
        if record.get(f"time/{name}_s", 0) >= 0.005
    ]
    text = " ".join(phases)
    if "mem/gpu_used_gib" in record:
        text += f" | GPU {record['mem/gpu_used_gib']:.1f} GiB (peak {record.get('mem/gpu_peak_gib', 0):.1f})"
    elif "mem/rss_gib" in record:
        text += f" | RSS {record['mem/rss_gib']:.2f} GiB"
    return text


def step_line(record: dict[str, Any]) -> str:
    """`step 3/40  reward 0.41  loss 0.01  0.24 s/step  9.5 s in all  [phases | memory]` from one metrics record."""
    parts = [f"step {record['step']}/{record.get('max_steps', '?')}"]
    for key in ("reward", "loss"):
        if isinstance(record.get(key), (int, float)):
            parts.append(f"{key} {record[key]:.4f}")
    if isinstance(record.get("time/step_s"), (int, float)):
        parts.append(f"{record['time/step_s']:.2f} s/step")
    parts.append(f"{record['wall_s']:.1f} s in all")
    breakdown = phase_summary(record)
    return "  ".join(parts) + (f"  [{breakdown}]" if breakdown else "")


def eval_line(record: dict[str, Any]) -> str:
    """`eval at step 20/40  eval/reward 0.62  digit_share 0.62  0.4 s` from one evaluation's metrics record."""
    parts = [
        f"eval at step {record['step']}/{record.get('max_steps', '?')}",
        f"eval/reward {record['eval/reward']:.4f}",
    ]
    for key, value in record.items():
        if key.startswith("eval/") and key != "eval/reward" and isinstance(value, (int, float)):
            parts.append(f"{key.removeprefix('eval/')} {value:.4g}")
    if isinstance(record.get("time/eval_s"), (int, float)):
        parts.append(f"{record['time/eval_s']:.1f} s")
    return "  ".join(parts)


def run_with_progress(plan, console, verbose: bool = False, watchdog=None) -> int:
    """Prepare and run `plan`, showing progress (a live bar on a terminal, one line per step otherwise, every rank's
    output with `verbose`) and how the run ended; returns the exit code for `train`."""
    import signal

    from colocate_rl.launch.execute import prepare, run
    from colocate_rl.rundir import RunDir

    console.print(f"run dir: [bold]{plan.run_dir}[/]  (log: {RunDir(plan.run_dir).log(plan.node_dir)})")
    if plan.builtin_model:
        console.print(f"building built-in model {plan.builtin_model['layout']} ...")
    differ = prepare(plan)
    if differ:
        console.print(
            f"[yellow]warning:[/] {', '.join(differ)} in the run dir were written by another node from a "
            "different recipe; the ranks compare recipes at start and stop if the nodes differ",
            highlight=False,
        )
    progress = None
    if console.is_terminal and not verbose:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        progress = Progress(
            TextColumn("training"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[status]}"),
            console=console,
        )
        task = progress.add_task("train", total=None, status="starting ranks ...")
        progress.start()

    def on_step(record: dict[str, Any]) -> None:
        if "reward" not in record:  # a held-out evaluation
            (progress.console if progress is not None else console).out(eval_line(record), highlight=False)
        elif progress is not None:
            status = f"reward {record['reward']:.3f}  {phase_summary(record)}"
            progress.update(task, completed=record["step"], total=record.get("max_steps"), status=status)
        else:
            console.out(step_line(record), highlight=False)

    def echo(line: str) -> None:
        console.out(line, highlight=False)

    def on_stop_request(signum: int) -> None:
        console.print(
            f"[yellow]{signal.Signals(signum).name}:[/] every rank saves a checkpoint at the next step end, then "
            "stops (send it again to stop at once, without one)",
            highlight=False,
        )

    try:
        result = run(
            plan,
            on_step=on_step,
            echo=echo if verbose else None,
            on_stop_request=on_stop_request,
            watchdog=watchdog,
        )
    finally:
        if progress is not None:
            progress.stop()
    if result.stopped_at is not None and result.stop_signal is None:
        console.print(
            f"stopped at step {result.stopped_at['step']} by another node's stop request; checkpoint: "
            f"{result.stopped_at['checkpoint']}; resume with: colocate-rl train --resume {plan.run_dir}",
            highlight=False,
            soft_wrap=True,
        )
        return result.code
    if result.stop_signal is not None and result.code != 0:
        name = signal.Signals(result.stop_signal).name
        if result.stopped_at is not None:
            console.print(
                f"stopped ({name}) at step {result.stopped_at['step']}; checkpoint: {result.stopped_at['checkpoint']}"
                f"; resume with: colocate-rl train --resume {plan.run_dir}",
                highlight=False,
                soft_wrap=True,
            )
        else:
            last = RunDir(plan.run_dir).complete_checkpoints()
            where = f"the last complete checkpoint is {last[-1]}" if last else "no checkpoint was saved"
            resume = f"; resume with: colocate-rl train --resume {plan.run_dir}" if last else ""
            console.print(f"stopped ({name}) without a new checkpoint; {where}{resume}", highlight=False)
        return result.code
    if result.crashed_after_done:
        console.print(
            f"[yellow]warning:[/] torchrun exited {result.torchrun_code} after the run finished and saved its model "
            "(a crash at interpreter exit, known with vLLM sleep mode); the run counts as successful"
        )
    if result.ended_by is not None:  # the ranks did not fail: the log tail would only show them being ended
        console.print(f"[red]error:[/] {result.ended_by}", highlight=False, soft_wrap=True)
        return result.code
    if result.code != 0:
        if not verbose:
            console.print(result.log_tail(), markup=False, highlight=False)
        console.print(f"[red]error:[/] training failed (exit code {result.code}); full log: {result.log}")
        for line in result.errors:
            console.print(f"[red]error:[/] {line}", highlight=False, soft_wrap=True)
        for line in result.hints:
            console.print(f"[yellow]hint:[/] {line}", highlight=False)
    return result.code


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
    if resolved.layout_choice is not None:
        for line in resolved.layout_choice.lines():
            console.print(line, highlight=False, soft_wrap=True)
    console.print("[green]recipe is valid[/]")


@app.command()
@guarded
def train(
    recipe: Annotated[
        str | None, typer.Argument(help="Recipe file, or the name of a shipped recipe (not with --resume).")
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
    from colocate_rl.launch.watchdog import Watchdog
    from colocate_rl.pipeline import plan_run
    from colocate_rl.plan.slurm import slurm_note
    from colocate_rl.plan.sources import NODE_KEYS, parse_node_flags
    from colocate_rl.rundir import check_run_dir_free, summarize

    flags = parse_node_flags(nnodes, node_rank, rdzv_endpoint, rdzv_id)
    if (recipe is None) == (resume is None):
        raise UserError("train: give a RECIPE to start a run, or --resume RUN_DIR to continue one (not both)")
    if resume is not None:
        if run_dir is not None:
            raise UserError("--run-dir: a resumed run stays in its own directory; drop --run-dir")
        from colocate_rl.pipeline import plan_resume
        from colocate_rl.plan.host import planning_host

        resolved, plan = plan_resume(
            resume,
            parse_sets(set_, set_str),
            host=planning_host(gpus, gpu_memory),
            flags=flags,
            env=os.environ,
            cwd=Path.cwd(),
            python=sys.executable,
        )
        sources = {key: "recipe" for key in NODE_KEYS}
    else:
        resolved, sources = _load(recipe, parse_sets(set_, set_str), gpus, gpu_memory, flags)
        plan = plan_run(resolved, run_dir, env=os.environ, now=datetime.now(), cwd=Path.cwd(), python=sys.executable)
    dist = resolved.recipe.distributed
    note = slurm_note(os.environ, dist.nnodes, sources["nnodes"])
    if dry_run:
        print(f"# run dir (not created): {plan.run_dir}")
        for key in NODE_KEYS:  # where the node settings came from (all of them on several nodes)
            if dist.nnodes > 1 or sources[key] != "default":
                print(f"# distributed.{key} = {getattr(dist, key)}  ({sources[key]})")
        if dist.nnodes > 1:
            print(f"# recipe hash: {plan.recipe_hash} (must be the same on every node)")
        if note:
            print(f"# note: {note}")
        for line in resolved.layout_choice.lines() if resolved.layout_choice is not None else []:
            print(f"# {line}")
        if plan.resume_from is not None:
            print(f"# resumes from {plan.resume_from}")
        print(plan.command_line())
        return
    if gpus is not None or gpu_memory is not None:
        raise UserError(
            f"{'--gpus' if gpus is not None else '--gpu-memory'}: only for planning (validate, train "
            "--dry-run); a real run uses the GPUs it finds"
        )
    if plan.resume_from is None:
        check_run_dir_free(plan.run_dir, plan.node_dir)
    if note:
        console.print(f"[yellow]note:[/] {note}", highlight=False)
    console.print(summary_table(resolved, plan.run_dir, plan.recipe_hash if dist.nnodes > 1 else ""))
    if plan.resume_from is not None:
        console.print(f"resuming from {plan.resume_from}", highlight=False)
    code = run_with_progress(plan, console, verbose=verbose, watchdog=Watchdog.for_run(resolved, plan.run_dir))
    summary = summarize(plan.run_dir)
    if summary["steps"]:
        table = Table(title="run summary")
        for col in ("steps", "reward first → last", "train time"):
            table.add_column(col)
        table.add_row(
            str(summary["steps"]),
            f"{summary['reward_first']:.3f} → {summary['reward_last']:.3f}",
            f"{summary['train_s']:.1f} s",
        )
        console.print(table)
    raise typer.Exit(code)
