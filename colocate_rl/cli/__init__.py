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
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from colocate_rl.errors import UserError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Colocated online RL (GRPO, RLOO) with TRL: one YAML recipe → torchrun → vLLM beside "
    "the trainer on every GPU.",
)
console = Console()
err_console = Console(stderr=True)

RecipeArg = Annotated[str, typer.Argument(help="Recipe file, or the name of a shipped recipe.")]
SetOpt = Annotated[
    list[str] | None, typer.Option("--set", help="Override a key: --set trainer.max_steps=20 (YAML value).")
]
GpusOpt = Annotated[
    int | None,
    typer.Option(
        "--gpus", min=0, help="Plan for N GPUs per node with vLLM instead of detecting them (e.g. on a login node)."
    ),
]
PlanMemOpt = Annotated[
    float | None,
    typer.Option(
        "--gpu-memory",
        metavar="GIB",
        min=1,
        help="Memory of one GPU in GiB for planning (zero_stage auto; default: the detected GPU's, or 80 with --gpus).",
    ),
]
NnodesOpt = Annotated[
    str | None,
    typer.Option(
        "--nnodes",
        metavar="N",
        help="Number of nodes (distributed.nnodes; under srun read from Slurm).",
        show_default=False,
    ),
]
NodeRankOpt = Annotated[
    str | None,
    typer.Option(
        "--node-rank", metavar="K", help="This node's rank, 0 … nnodes-1 (distributed.node_rank).", show_default=False
    ),
]
RdzvEndpointOpt = Annotated[
    str | None,
    typer.Option(
        "--rdzv-endpoint",
        metavar="HOST:PORT",
        help="Rendezvous host:port, normally node 0 (distributed.rdzv_endpoint).",
        show_default=False,
    ),
]
RdzvIdOpt = Annotated[
    str | None,
    typer.Option(
        "--rdzv-id",
        metavar="ID",
        help="Rendezvous id, the same on every node of one job (distributed.rdzv_id).",
        show_default=False,
    ),
]


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
    from colocate_rl.recipe.shipped import shipped_recipes

    path = Path(recipe)
    if path.exists() or path.suffix in (".yaml", ".yml") or "/" in recipe:
        return path
    shipped = shipped_recipes()
    if recipe in shipped:
        return shipped[recipe]
    raise UserError(f"{recipe}: no such recipe file or shipped recipe; shipped: {', '.join(shipped)}")


def _resolve(
    recipe: str,
    overrides: list[str] | None,
    gpus: int | None,
    node_flags: dict | None = None,
    gpu_memory: float | None = None,
):
    """Load (defaults < recipe < Slurm environment < --set and node flags), validate, bind to the host.
    Returns the resolved recipe and where each distributed node key came from."""
    from colocate_rl.plan.host import assumed_host, detect_host
    from colocate_rl.plan.resolve import resolve
    from colocate_rl.plan.sources import explain_sources, layer_distributed
    from colocate_rl.recipe.schema import parse_recipe, read_yaml

    path = _recipe_path(recipe)
    data, sources = layer_distributed(read_yaml(path), overrides or [], node_flags or {}, os.environ)
    host = detect_host() if gpus is None else assumed_host(gpus, gpu_memory or 80.0)
    if gpu_memory and gpus is None and host.gpus:  # plan with another memory size than the detected GPUs'
        from dataclasses import replace

        host = replace(host, gpus=tuple(replace(g, memory_gib=gpu_memory) for g in host.gpus))
    try:
        return resolve(parse_recipe(data, str(path)), host), sources
    except UserError as e:
        raise UserError(*explain_sources(e.lines, sources))


def _summary_table(resolved, run_dir: Path | None = None, recipe_hash: str = "") -> Table:
    r = resolved.recipe
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    dist = r.distributed
    ds = resolved.deepspeed
    layout = f"ZeRO-{ds.get('zero_optimization', {}).get('stage', 0)} ({dist.deepspeed or 'zero3'})" if ds else "DDP"
    if resolved.layout_choice is not None:
        layout = f"{resolved.layout_choice.chosen.label} (auto)"
    host = f"{resolved.host.gpu_count} GPU(s)" + (" assumed" if resolved.host.assumed else "")
    rows = [
        ("recipe", f"{r.name} ({r.algorithm})"),
        ("model", f"{r.model.name} ({resolved.model_dtype})"),
        ("data", r.data.source),
        ("rewards", ", ".join(f"{x.name}×{x.weight:g}" for x in r.rewards)),
        (
            "ranks",
            f"{dist.nnodes} node(s) × {resolved.nproc_per_node} = {resolved.world_size} on {resolved.device} ({host})",
        ),
        ("trainer", f"{layout}, precision {resolved.precision}"),
        (
            "generation",
            resolved.backend
            + (
                f", gpu util {r.generation.vllm_gpu_memory_utilization}, "
                f"TP {r.generation.tensor_parallel_size}, sleep "
                f"{r.generation.sleep_level}"
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


@app.command()
@_guarded
def validate(
    recipe: RecipeArg,
    set_: SetOpt = None,
    gpus: GpusOpt = None,
    nnodes: NnodesOpt = None,
    node_rank: NodeRankOpt = None,
    rdzv_endpoint: RdzvEndpointOpt = None,
    rdzv_id: RdzvIdOpt = None,
    gpu_memory: PlanMemOpt = None,
) -> None:
    """Check a recipe (schema and cross-field checks against this machine) without running it."""
    from colocate_rl.plan.sources import parse_node_flags

    resolved, _ = _resolve(recipe, set_, gpus, parse_node_flags(nnodes, node_rank, rdzv_endpoint, rdzv_id), gpu_memory)
    console.print(_summary_table(resolved))
    if resolved.layout_choice is not None:
        for line in resolved.layout_choice.lines():
            console.print(line, highlight=False, soft_wrap=True)
    console.print("[green]recipe is valid[/]")


@app.command()
@_guarded
def train(
    recipe: RecipeArg,
    set_: SetOpt = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the launch command; write nothing.")] = False,
    run_dir: Annotated[
        Path | None,
        typer.Option(
            "--run-dir", help="Run directory (default runs/<name>-<time>; on several nodes runs/<name>-<rdzv id>)."
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
    from colocate_rl.launch.execute import check_run_dir_free, default_run_dir, execute, summarize
    from colocate_rl.plan.launch_plan import make_plan
    from colocate_rl.plan.sources import NODE_KEYS, parse_node_flags, slurm_note

    node_flags = parse_node_flags(nnodes, node_rank, rdzv_endpoint, rdzv_id)
    resolved, sources = _resolve(recipe, set_, gpus, node_flags, gpu_memory)
    dist = resolved.recipe.distributed
    chosen = run_dir or (
        Path(resolved.recipe.output.run_dir)
        if resolved.recipe.output.run_dir
        else default_run_dir(resolved.recipe.name, datetime.now(), dist.rdzv_id if dist.nnodes > 1 else None)
    )
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "colocate-rl"
    plan = make_plan(
        resolved, run_dir=chosen.absolute(), python=sys.executable, cwd=Path.cwd(), cache_dir=cache, base_env=os.environ
    )
    note = slurm_note(os.environ) if dist.nnodes == 1 and sources["nnodes"] in ("default", "recipe") else None
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
        print(plan.command_line())
        return
    if gpus is not None or gpu_memory is not None:
        raise UserError(
            f"{'--gpus' if gpus is not None else '--gpu-memory'}: only for planning (validate, train "
            "--dry-run); a real run uses the GPUs it finds"
        )
    check_run_dir_free(plan.run_dir, plan.node_dir)
    if note:
        console.print(f"[yellow]note:[/] {note}", highlight=False)
    console.print(_summary_table(resolved, plan.run_dir, plan.recipe_hash if dist.nnodes > 1 else ""))
    code = execute(plan, console, verbose=verbose)
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


@app.command()
@_guarded
def recipes(
    name: Annotated[str | None, typer.Argument(help="Shipped recipe to copy out.")] = None,
    out: Annotated[Path | None, typer.Option("--out", help="Where to copy it (default ./NAME.yaml).")] = None,
) -> None:
    """List the shipped recipes, or copy one out to edit: `colocate-rl recipes quickstart`."""
    from colocate_rl.recipe.shipped import recipe_summary, shipped_recipes

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
@_guarded
def report(
    run_dirs: Annotated[
        list[Path],
        typer.Argument(
            metavar="RUN_DIR",
            show_default=False,
            help="Run directory written by `colocate-rl train`; give two to compare them (e.g. sleep mode on vs off).",
        ),
    ],
    out: Annotated[
        Path | None, typer.Option("--out", help="Directory for the PNGs (default the first RUN_DIR).")
    ] = None,
) -> None:
    """Time and memory per phase, reward and run summary as tables, plus PNG plots (memory timeline, step breakdown, reward)."""
    from colocate_rl.telemetry.report import report as write_report

    write_report(run_dirs, out, console)


def _host_line(e, ram_gib: float | None) -> list[str]:
    """Host memory per node for offloaded state (none: no line); compared with this machine's RAM when known."""
    if not e.host:
        return []
    line = (
        f"host memory per node: {e.host_gib:.1f} GiB for "
        + ", ".join(f"{k} {v:.1f}" for k, v in e.host.items())
        + " (the processes' own memory comes on top)"
    )
    from colocate_rl.memory.autolayout import host_fits

    if not host_fits(e.host_gib, ram_gib):  # the host limit auto's choice uses
        line += f"; this machine has {ram_gib:.0f} GiB of RAM: not enough — use more GPUs or nodes, or less offload"
    return [line]


def _mem_probe_lines(rec, ram_gib: float | None = None) -> list[str]:
    """What `mem-probe --estimate` prints under its table: layout, batch, window, verdict, recommendation."""
    import json

    from colocate_rl.memory.estimate import CHANGES, MARGIN, PHASES, VLLM_ALLOWANCE_GIB, zero_of

    b, lay, kv, G = rec.base, rec.base.layout, rec.base.kv, rec.base.gpu_gib
    r, stage = b.resolved.recipe, zero_of(b.resolved)[1]
    lines = [
        f"model {r.model.name}: {lay.params:,} params (hidden {lay.hidden}, {lay.layers} layers, {lay.heads} "
        f"heads / {lay.kv_heads} KV heads, vocab {lay.vocab:,}); {r.distributed.nnodes} node(s) × "
        f"{b.resolved.nproc_per_node} GPU(s) of {G:.1f} GiB; {'DDP' if stage is None else f'ZeRO-{stage}'}; "
        f"vLLM TP {r.generation.tensor_parallel_size}",
        f"generation batch: {kv['sequences']} sequences per vLLM engine × {kv['tokens']} tokens (prompt ≤ "
        f"{kv['prompt_tokens']} + completion {kv['completion_tokens']}), KV {kv['bytes_per_token']:,} B/token → "
        f"{kv['gib']:.2f} GiB; the recipe's share ({b.util}) holds {b.max_seqs(b.util):,} such sequences",
        f"window for generation.vllm_gpu_memory_utilization: {b.lower:.3f} (vLLM weights + KV + "
        f"{VLLM_ALLOWANCE_GIB:g} GiB allowance = {b.need_gib:.2f} GiB) to {b.upper:.3f} (what the trainer's "
        f"{b.fixed[b.upper_phase]:.2f} GiB leave during {b.upper_phase})",
    ]
    where = "below the window" if b.util < b.lower else "above the window" if b.util > b.upper else "in the window"
    phase, peak = b.peak()
    lines.append(f"recipe as written (share {b.util}, {where}): peak {peak:.2f} GiB of {G:.1f} in {phase}")
    if not b.asleep_fits:
        p = max((p for p in PHASES if p not in b.awake), key=b.fixed.__getitem__)
        lines.append(
            f"does not fit: {p} needs {b.fixed[p]:.2f} GiB while vLLM sleeps; {G * (1 - MARGIN):.1f} GiB "
            f"usable ({MARGIN:.0%} kept free)"
        )
    elif not b.fits:
        lines.append(
            f"does not fit: vLLM needs a share of {b.lower:.3f} + {MARGIN:.0%}, the trainer leaves "
            f"{b.upper:.3f} − {MARGIN:.0%}"
        )
    f = rec.final
    if f is None:
        return lines + [f"no change tried makes it fit ({', '.join(CHANGES)}); use more GPUs or a smaller model"]
    if rec.applied:
        sets = " ".join(f"--set {k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in rec.changes.items())
        lines.append(f"{'change' if b.fits else 'cheapest change that fits'}: {' + '.join(rec.applied)} ({sets})")
    _, _, off_opt, off_par = zero_of(f.resolved)
    phase, peak = f.peak(f.chosen)
    lines.append(
        f"recommended: generation.vllm_gpu_memory_utilization {f.chosen:.2f} (lower bound + {MARGIN:.0%} "
        f"of the GPU); sleep level {f.resolved.recipe.generation.sleep_level}; optimizer "
        f"offload {'on' if off_opt else 'off'}; param offload {'on' if off_par else 'off'} → peak "
        f"{peak:.2f} GiB of {G:.1f} in {phase}; KV room for {f.max_seqs(f.chosen):,} sequences (a batch is "
        f"{f.kv['sequences']})"
    )
    return lines + _host_line(f, ram_gib) + [f"note: {n}" for n in b.notes + rec.notes]


def _write_recipe(target: Path, path: Path, sets: list[str], header: str) -> None:
    """A copy of the recipe at `path` with `sets` applied, written whole or not at all (temp file + rename)."""
    import yaml

    from colocate_rl.recipe.schema import apply_overrides, read_yaml

    if not target.parent.is_dir():
        raise UserError(f"--write: {target.parent} is not a directory; create it or choose another file name")
    text = f"# {header}\n" + yaml.safe_dump(apply_overrides(read_yaml(path), sets), sort_keys=False)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def _mem_probe_measure(
    recipe: str,
    set_: list[str],
    gib: float,
    prompt_tokens: int | None,
    json_out: bool,
    write: Path | None,
    steps: int,
    probe_dir: Path | None,
    resolution: float,
    margin: float,
    trial_timeout: float,
) -> None:
    """`mem-probe RECIPE` on a GPU machine: bisect vLLM's share with real trials (colocate_rl.memory.probe)."""
    import json

    from colocate_rl.memory import probe as P
    from colocate_rl.memory.autolayout import confirm_choice
    from colocate_rl.memory.estimate import PHASES
    from colocate_rl.memory.estimate import estimate as estimate_memory

    path = _recipe_path(recipe)
    resolved = _resolve(recipe, set_, None)[0]
    if resolved.backend != "vllm":
        raise UserError(
            "mem-probe: the recipe generates with transformers here (generation.backend); measuring "
            "bisects vLLM's share: install vLLM (pip install -e '.[gpu]') or set generation.backend: vllm"
        )
    est = estimate_memory(resolved, gib, prompt_tokens)
    if est.kv_budget_gib is not None:
        raise UserError(
            "generation.kv_cache_memory: set, so vLLM's share is fixed by it; the probe bisects "
            "generation.vllm_gpu_memory_utilization: add --set generation.kv_cache_memory=null to probe it"
        )
    lower, upper = max(est.lower, resolution), min(est.upper, 1.0)
    search_upper = min(1.0, upper + P.SEARCH_ABOVE_ESTIMATE)  # the estimate can be low: its top is tried first
    if lower > upper:
        raise UserError(
            f"mem-probe: the estimate leaves no vLLM share that fits (window {est.lower:.3f} to "
            f"{est.upper:.3f}); `colocate-rl mem-probe RECIPE --estimate` names the cheapest change: "
            "pass it with --set and probe again"
        )
    # auto's layout depends on the vLLM share (a large share leaves no room for the faster layouts): every trial
    # trains with the layout auto chose at the recipe's own share
    choice = resolved.layout_choice
    pinned = choice.pinned_sets(resolved.recipe.distributed.deepspeed) if choice is not None else []
    probe_dir = probe_dir or Path("runs") / f"mem-probe-{datetime.now():%Y%m%d-%H%M%S}"
    if probe_dir.exists() and any(probe_dir.iterdir()):
        raise UserError(f"--probe-dir: {probe_dir} is not empty; choose another directory or remove it")
    out = err_console if json_out else console
    out.print(
        f"probing generation.vllm_gpu_memory_utilization in {lower:.3f}–{search_upper:.3f} (the estimated "
        f"window {lower:.3f}–{upper:.3f} and up to {P.SEARCH_ABOVE_ESTIMATE:g} above it; its top first) at a "
        f"resolution of {resolution:g}, {steps} steps a trial; trials in {probe_dir}",
        highlight=False,
    )
    if pinned:
        out.print(
            f"every trial trains with auto's layout at the recipe's share ({choice.chosen.label}): {' '.join(pinned)}",
            highlight=False,
            soft_wrap=True,
        )

    def result_line(t):
        return f"  → {t.outcome} ({t.seconds:.0f} s, {t.steps} steps)" + (f": {t.detail}" if t.detail else "")

    try:
        result = P.run_probe(
            path,
            [*(set_ or []), *pinned],
            lower,
            search_upper,
            upper,
            probe_dir,
            steps,
            resolution,
            margin,
            trial_timeout,
            on_start=lambda k, u: out.print(f"trial {k}: share {u:g} ...", highlight=False),
            on_trial=lambda k, t: out.print(result_line(t), highlight=False, markup=False, soft_wrap=True),
        )
    except P.ProbeAborted as e:
        err_console.print(P.trials_table(e.trials))
        err_console.print(e.trial.log_tail, highlight=False, markup=False, soft_wrap=True)
        raise UserError(
            f"mem-probe: trial {len(e.trials)} (share {e.trial.util:g}) failed for a reason the probe "
            f"does not bisect on ({e.trial.outcome}: {e.trial.detail}); its run directory is "
            f"{e.trial.run_dir}; fix that and probe again"
        )

    def estimate_at(u):
        return {p: est.total(p, u) for p in PHASES}

    best = result.best_trial()
    layout = None  # auto's layout choice checked against the best trial, moved to the recipe's own share
    if choice is not None and best is not None:
        share = resolved.recipe.generation.vllm_gpu_memory_utilization
        peak = P.peak_at_share(best.peaks, best.util, share, estimate_at)
        if peak is not None:
            ok, line = confirm_choice(choice, peak)
            layout = {"confirmed": ok, "measured_peak_gib": peak, "at_share": share, "line": line, "pinned": pinned}
    if json_out:
        print(
            json.dumps(
                {
                    "recipe": str(path),
                    "gpu_memory_gib": gib,
                    "steps": steps,
                    "probe_dir": str(probe_dir),
                    "estimate": {"lower": round(est.lower, 4), "upper": round(est.upper, 4), "chosen": est.chosen},
                    "searched": [round(lower, 4), round(search_upper, 4)],
                    "pinned_sets": pinned,
                    **P.to_json(result, estimate_at),
                    "layout_check": layout,
                }
            )
        )
    else:
        console.print(P.trials_table(result.trials))
        if best is not None:
            console.print(P.comparison_table(P.comparison(estimate_at(best.util), best.peaks), best.util))
        if result.recommended is not None:
            console.print(
                f"largest share that completed {steps} steps: {result.largest:g}; recommended: "
                f"generation.vllm_gpu_memory_utilization {result.recommended:g} (largest − margin "
                f"{margin:g}; the estimate recommended {est.chosen:g})",
                highlight=False,
                soft_wrap=True,
            )
        for note in result.notes:
            console.print(f"note: {note}", highlight=False, soft_wrap=True)
        if layout is not None:
            console.print(
                f"layout (auto): {layout['line']} — peak of share {best.util:g}'s trial moved to the "
                f"recipe's share {layout['at_share']:g}",
                highlight=False,
                markup=False,
                soft_wrap=True,
            )
    if result.recommended is None:
        raise UserError(
            "mem-probe: no vLLM share in the window completed the steps ("
            + "; ".join(result.notes)
            + f"); see the trials in {probe_dir}"
            + ("; nothing written" if write else "")
        )
    if write is not None:
        _write_recipe(
            write,
            path,
            [*(set_ or []), *pinned, f"generation.vllm_gpu_memory_utilization={result.recommended:g}"],
            f"{recipe} with generation.vllm_gpu_memory_utilization {result.recommended:g} measured by "
            f"`colocate-rl mem-probe` (largest passing {result.largest:g} − margin {margin:g})"
            + (f" and the layout the trials ran ({choice.chosen.label})" if pinned else ""),
        )
        out.print(f"wrote {write}", highlight=False)


@app.command("mem-probe")
@_guarded
def mem_probe(
    recipe: RecipeArg,
    estimate: Annotated[
        bool, typer.Option("--estimate", help="Compute from the model layout and the recipe (no GPU needed).")
    ] = False,
    set_: SetOpt = None,
    gpus: GpusOpt = None,
    gpu_memory: Annotated[
        float | None,
        typer.Option(
            "--gpu-memory", metavar="GIB", min=1, help="Memory of one GPU in GiB (default: the detected GPU's)."
        ),
    ] = None,
    prompt_tokens: Annotated[
        int | None,
        typer.Option(
            "--prompt-tokens",
            min=1,
            help="Prompt length in tokens (default: max_model_length − max_completion_length, else 512).",
        ),
    ] = None,
    json_out: Annotated[
        bool, typer.Option("--json", help="Print one JSON object (terms, phases, window, recommendation).")
    ] = False,
    write: Annotated[
        Path | None,
        typer.Option("--write", metavar="OUT.yaml", help="Write a copy of the recipe with the recommended values."),
    ] = None,
    steps: Annotated[int, typer.Option("--steps", min=1, help="Measuring: training steps per trial.")] = 3,
    probe_dir: Annotated[
        Path | None,
        typer.Option(
            "--probe-dir", help="Measuring: where the trials' run directories go (default runs/mem-probe-<time>)."
        ),
    ] = None,
    resolution: Annotated[
        float, typer.Option("--resolution", min=0.001, max=0.5, help="Measuring: bisection step of the vLLM share.")
    ] = 0.01,
    margin: Annotated[
        float,
        typer.Option(
            "--margin", min=0, max=0.5, help="Measuring: safety margin below the largest share that completed."
        ),
    ] = 0.02,
    trial_timeout: Annotated[
        float,
        typer.Option(
            "--trial-timeout",
            min=1,
            metavar="SECONDS",
            help="Measuring: end a trial after this long (it then stops the probe).",
        ),
    ] = 1200,
) -> None:
    """GPU memory per rank and phase (generation, weight sync, training, optimizer step) and the vLLM share to set."""
    import json

    from colocate_rl.memory.estimate import PHASES, recommend, to_json
    from colocate_rl.plan.host import detect_host
    from colocate_rl.recipe.schema import load_recipe

    host = detect_host()
    if not estimate and not host.gpus:
        raise UserError(
            "mem-probe: no CUDA GPU on this machine; measuring runs the recipe on the GPUs — run "
            "`colocate-rl mem-probe RECIPE --estimate` here"
        )
    if write is not None and write.exists():
        raise UserError(f"--write: {write} already exists; choose another file name")
    if not estimate:
        if gpus is not None:
            raise UserError("--gpus: only with --estimate; measuring uses the GPUs it finds")
        return _mem_probe_measure(
            recipe,
            set_ or [],
            gpu_memory or host.gpus[0].memory_gib,
            prompt_tokens,
            json_out,
            write,
            steps,
            probe_dir,
            resolution,
            margin,
            trial_timeout,
        )
    gib = gpu_memory or (host.gpus[0].memory_gib if host.gpus else None)
    if gib is None:
        raise UserError("--gpu-memory: no GPU detected here; give the memory of one GPU in GiB, e.g. --gpu-memory 80")
    path = _recipe_path(recipe)
    if gpus is None and not host.gpus:  # plan for the recipe's ranks per node
        gpus = load_recipe(path, set_).distributed.nproc_per_node
        if gpus == "auto":
            raise UserError(
                "--gpus: no GPU detected here and distributed.nproc_per_node is auto; pass --gpus N to "
                "plan for N GPUs per node"
            )

    def as_sets(changes):
        return [*(set_ or []), *(f"{k}={json.dumps(v)}" for k, v in changes.items())]

    rec = recommend(lambda changes: _resolve(recipe, as_sets(changes), gpus, gpu_memory=gib)[0], gib, prompt_tokens)
    choice = rec.base.resolved.layout_choice  # zero_stage / gradient_checkpointing auto: what was chosen and why
    if json_out:
        print(json.dumps({**to_json(rec), "layout_choice": choice.to_json() if choice is not None else None}))
    else:
        table = Table(
            title=f"estimated memory per GPU (GiB), vLLM share {rec.base.util} of {gib:.1f} GiB, sleep level "
            f"{rec.base.resolved.recipe.generation.sleep_level}"
        )
        table.add_column("term")
        for phase in PHASES:
            table.add_column(phase, justify="right")
        for term, row in rec.base.terms.items():
            table.add_row(term, *(f"{row[p]:.2f}" if p in row else "" for p in PHASES))
        table.add_row("total", *(f"{rec.base.total(p):.2f}" for p in PHASES), style="bold")
        console.print(table)
        ram = host.ram_gib if host.gpus else None  # the GPUs are here: planning for this machine
        for line in _mem_probe_lines(rec, ram) + (choice.lines() if choice is not None else []):
            console.print(line, highlight=False, soft_wrap=True)
    if write is not None:
        if rec.final is None:
            raise UserError("--write: no change tried makes the recipe fit; nothing written")
        changed = ", ".join(f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in rec.changes.items())
        _write_recipe(
            write,
            path,
            as_sets(rec.changes),
            f"{recipe} with the values of `colocate-rl mem-probe --estimate` ({changed})",
        )
        (err_console if json_out else console).print(f"wrote {write}", highlight=False)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
