"""The `colocate-rl` command line. Verbs are thin; `_guarded` is the one exception boundary.

Heavy libraries (torch, transformers, trl, vllm) are imported only inside the work a verb does, so
`colocate-rl --help` is instant.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
from datetime import datetime
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from colocate_rl.errors import UserError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Colocated online RL (GRPO, RLOO) with TRL: one YAML recipe → torchrun → vLLM beside "
                       "the trainer on every GPU.")
console = Console()
err_console = Console(stderr=True)

RecipeArg = Annotated[str, typer.Argument(help="Recipe file, or the name of a shipped recipe.")]
SetOpt = Annotated[Optional[list[str]], typer.Option("--set", help="Override a key: --set trainer.max_steps=20 (YAML value).")]
GpusOpt = Annotated[Optional[int], typer.Option("--gpus", min=0, help="Plan for N GPUs per node with vLLM instead of "
                                                "detecting them (e.g. on a login node).")]


def _guarded(fn):
    """Known errors → one line each on stderr, exit 2, no traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            for line in e.lines:
                err_console.print(f"[red]error:[/] {line}", markup=True, highlight=False, soft_wrap=True)
            raise typer.Exit(2)
        except KeyboardInterrupt:
            err_console.print("interrupted")
            raise typer.Exit(130)

    return wrapper


def _recipe_path(recipe: str) -> Path:
    from colocate_rl.shipped import shipped_recipes

    path = Path(recipe)
    if path.exists() or path.suffix in (".yaml", ".yml") or "/" in recipe:
        return path
    shipped = shipped_recipes()
    if recipe in shipped:
        return shipped[recipe]
    raise UserError(f"{recipe}: no such recipe file or shipped recipe; shipped: {', '.join(shipped)}")


def _resolve(recipe: str, overrides: list[str] | None, gpus: int | None):
    from colocate_rl.host import assumed_host, detect_host
    from colocate_rl.recipe import load_recipe
    from colocate_rl.resolve import resolve

    loaded = load_recipe(_recipe_path(recipe), overrides or [])
    host = detect_host() if gpus is None else assumed_host(gpus)
    return resolve(loaded, host)


def _summary_table(resolved, run_dir: Path | None = None) -> Table:
    r = resolved.recipe
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    dist = r.distributed
    ds = resolved.deepspeed
    layout = f"ZeRO-{ds.get('zero_optimization', {}).get('stage', 0)} ({dist.deepspeed})" if ds else "DDP"
    host = f"{resolved.host.gpu_count} GPU(s)" + (" assumed" if resolved.host.assumed else "")
    rows = [
        ("recipe", f"{r.name} ({r.algorithm})"),
        ("model", f"{r.model.name} ({resolved.model_dtype})"),
        ("data", r.data.source),
        ("rewards", ", ".join(f"{x.name}×{x.weight:g}" for x in r.rewards)),
        ("ranks", f"{dist.nnodes} node(s) × {resolved.nproc_per_node} = {resolved.world_size} on {resolved.device}"
                  f" ({host})"),
        ("trainer", f"{layout}, precision {resolved.precision}"),
        ("generation", resolved.backend + (f", gpu util {r.generation.vllm_gpu_memory_utilization}, "
                                           f"TP {r.generation.tensor_parallel_size}, sleep "
                                           f"{'on' if r.generation.sleep_mode else 'off'}"
                                           if resolved.backend == "vllm" else "")),
        ("steps", f"{r.trainer.max_steps} × {r.trainer.per_device_train_batch_size * resolved.world_size} "
                  f"completions ({r.trainer.num_generations} per prompt)"),
    ]
    if run_dir is not None:
        rows.append(("run dir", str(run_dir)))
    for key, value in rows:
        table.add_row(key, value)
    return table


@app.command()
@_guarded
def validate(recipe: RecipeArg, set_: SetOpt = None, gpus: GpusOpt = None) -> None:
    """Check a recipe (schema and cross-field checks against this machine) without running it."""
    resolved = _resolve(recipe, set_, gpus)
    console.print(_summary_table(resolved))
    console.print("[green]recipe is valid[/]")


@app.command()
@_guarded
def train(
    recipe: RecipeArg,
    set_: SetOpt = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the launch command; write nothing.")] = False,
    run_dir: Annotated[Optional[Path], typer.Option("--run-dir", help="Run directory (default runs/<name>-<time>).")] = None,
    gpus: GpusOpt = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Stream every rank's output.")] = False,
) -> None:
    """Train: validate the recipe, write the run directory, run torchrun with the worker on every rank."""
    from colocate_rl.launch import check_run_dir_free, default_run_dir, execute, summarize
    from colocate_rl.plan import make_plan

    resolved = _resolve(recipe, set_, gpus)
    chosen = run_dir or (Path(resolved.recipe.output.run_dir) if resolved.recipe.output.run_dir else
                         default_run_dir(resolved.recipe.name, datetime.now()))
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "colocate-rl"
    plan = make_plan(resolved, run_dir=chosen.absolute(), python=sys.executable, cwd=Path.cwd(),
                     cache_dir=cache, base_env=os.environ)
    if dry_run:
        print(f"# run dir (not created): {plan.run_dir}")
        print(plan.command_line())
        return
    if gpus is not None:
        raise UserError("--gpus: only for planning (validate, train --dry-run); a real run uses the GPUs it finds")
    check_run_dir_free(plan.run_dir)
    console.print(_summary_table(resolved, plan.run_dir))
    code = execute(plan, console, verbose=verbose)
    summary = summarize(plan.run_dir)
    if summary["steps"]:
        table = Table(title="run summary")
        for col in ("steps", "reward first → last", "train time"):
            table.add_column(col)
        table.add_row(str(summary["steps"]), f"{summary['reward_first']:.3f} → {summary['reward_last']:.3f}",
                      f"{summary['train_s']:.1f} s")
        console.print(table)
    raise typer.Exit(code)


@app.command()
@_guarded
def recipes(
    name: Annotated[Optional[str], typer.Argument(help="Shipped recipe to copy out.")] = None,
    out: Annotated[Optional[Path], typer.Option("--out", help="Where to copy it (default ./NAME.yaml).")] = None,
) -> None:
    """List the shipped recipes, or copy one out to edit: `colocate-rl recipes quickstart`."""
    from colocate_rl.shipped import recipe_summary, shipped_recipes

    shipped = shipped_recipes()
    if name is None:
        table = Table("name", "what it runs")
        for key, path in shipped.items():
            table.add_row(key, recipe_summary(path))
        console.print(table)
        console.print("copy one out to edit: colocate-rl recipes NAME [--out FILE]")
        return
    if name not in shipped:
        raise UserError(f"{name}: no shipped recipe of that name; shipped: {', '.join(shipped)}")
    target = out or Path(f"{name}.yaml")
    if target.exists():
        raise UserError(f"{target}: already exists; pass --out with another file name")
    shutil.copyfile(shipped[name], target)
    console.print(f"wrote {target}; run it with: colocate-rl train {target}")


@app.command()
@_guarded
def env() -> None:
    """Versions, GPUs, and the generation backend `auto` would pick on this machine."""
    from importlib.metadata import PackageNotFoundError, version

    from colocate_rl.host import detect_host

    table = Table("package", "version")
    for package in ("colocate-rl", "torch", "transformers", "trl", "accelerate", "deepspeed", "vllm", "datasets"):
        try:
            table.add_row(package, version(package))
        except PackageNotFoundError:
            table.add_row(package, "[dim]not installed[/]")
    console.print(table)
    host = detect_host()
    for i, gpu in enumerate(host.gpus):
        console.print(f"GPU {i}: {gpu.name}, {gpu.memory_gib:.0f} GiB")
    if not host.gpus:
        console.print("GPUs: none (training runs on CPU with 2 ranks by default)")
    backend = "vllm (colocated)" if host.gpus and host.has_vllm else "transformers"
    why = "" if backend.startswith("vllm") else (" (no GPU)" if not host.gpus else " (vLLM not installed)")
    console.print(f"generation.backend auto → {backend}{why}; CPU cores: {host.cpu_count}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
