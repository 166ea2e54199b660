"""`colocate-rl recipes`, `env` and `report`: the shipped files, this machine, a run's telemetry."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from colocate_rl.cli.common import app, console, guarded
from colocate_rl.errors import UserError


@app.command()
@guarded
def recipes(
    name: Annotated[str | None, typer.Argument(metavar="NAME", help="Shipped recipe or script to copy out.")] = None,
    out: Annotated[
        Path | None,
        typer.Option("--out", metavar="FILE", help="File to copy it to, or a directory (default ./NAME.yaml)."),
    ] = None,
) -> None:
    """List the shipped recipes and cluster launch scripts, one line each, or copy one out to edit (`colocate-rl
    recipes quickstart`, `colocate-rl recipes slurm.sbatch`)."""
    from colocate_rl.errors import did_you_mean
    from colocate_rl.recipe.shipped import recipe_summary, shipped_recipes, shipped_scripts

    shipped, scripts = shipped_recipes(), shipped_scripts()
    if name is None:
        for title, files in (("recipe", shipped), ("launch script", scripts)):
            width = max(map(len, [title, *files]))
            console.print(f"[bold]{title:<{width}}  what it runs[/]")
            for key, path in files.items():  # one line each; cut with … only on a terminal too narrow for it
                console.print(
                    f"{key:<{width}}  {recipe_summary(path)}", no_wrap=True, overflow="ellipsis", markup=False
                )
            console.print()
        console.print("copy one out to edit: colocate-rl recipes NAME [--out FILE]")
        return
    if name not in shipped and name not in scripts:
        known = [*shipped, *scripts]
        raise UserError(
            f"{name}: no shipped recipe or launch script of that name; "
            + (did_you_mean(name, known) or f"shipped: {', '.join(known)}")
        )
    default = Path(f"{name}.yaml" if name in shipped else name)
    target = out / default if out is not None and out.is_dir() else out or default  # a directory: NAME in it
    if os.path.lexists(target):
        raise UserError(f"{target}: already exists; pass --out with another file name")
    if not target.parent.is_dir():
        raise UserError(
            f"--out {target}: the directory '{target.parent}' does not exist; create it first, or give a file in an "
            "existing directory"
        )
    try:
        shutil.copyfile(shipped.get(name) or scripts[name], target)
        if name not in shipped:
            target.chmod(0o755)
    except OSError as e:
        target.unlink(missing_ok=True)
        raise UserError(f"--out {target}: cannot write it ({e.strerror or e}); give a file in a writable directory")
    if name in shipped:
        console.print(f"wrote {target}; run it with: colocate-rl train {target}")
    else:
        console.print(f"wrote {target}; its header says how to run it")


@app.command()
@guarded
def env() -> None:
    """Versions, GPUs, and the generation backend `auto` would pick on this machine."""
    from importlib.metadata import PackageNotFoundError, version

    from colocate_rl.plan.host import detect_host

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
    console.print(f"generation.backend auto → {backend}{why}; CPU cores: {host.cpu_count}; RAM: {host.ram_gib:.0f} GiB")


@app.command()
@guarded
def report(
    run_dirs: Annotated[
        list[Path],
        typer.Argument(
            metavar="RUN_DIR",
            show_default=False,
            help="Run directory written by `colocate-rl train`; give two to compare them (e.g. sleep mode on vs off): "
            "their curves share each plot.",
        ),
    ],
    out: Annotated[
        Path | None, typer.Option("--out", metavar="DIR", help="Directory for the PNGs (default the first RUN_DIR).")
    ] = None,
) -> None:
    """Time and memory per phase, reward and run summary as tables, plus PNG plots (memory timeline, step breakdown, reward)."""
    from colocate_rl.telemetry.report import report as write_report

    write_report(run_dirs, out, console)
