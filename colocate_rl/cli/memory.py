"""`colocate-rl mem-probe`: GPU memory per rank and phase, and the vLLM share to set — computed from the recipe
(`--estimate`, colocate_rl.memory.estimate/recommend) or measured on this machine's GPUs (colocate_rl.memory.probe).
This module parses the options and renders; the decisions are in colocate_rl.memory."""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from colocate_rl.cli.common import (
    GpusOpt,
    RecipeArg,
    SetOpt,
    SetStrOpt,
    app,
    console,
    err_console,
    guarded,
    parse_sets,
)
from colocate_rl.errors import UserError


def trials_table(trials) -> Table:
    from colocate_rl.memory.estimate import MEMORY_PHASES

    table = Table(title="trials (s/step and peak GiB per phase, any rank, first step left out)")
    for col in ("#", "share", "result", "seconds", "steps", "s/step", *MEMORY_PHASES):
        table.add_column(col, justify="left" if col == "result" else "right")
    for k, t in enumerate(trials, 1):
        table.add_row(
            str(k),
            f"{t.util:g}",
            t.outcome if t.ok else f"[red]{t.outcome}[/]",
            f"{t.seconds:.0f}",
            str(t.steps),
            "" if t.s_per_step is None else f"{t.s_per_step:.2f}",
            *(f"{t.peaks[p]:.2f}" if p in t.peaks else "" for p in MEMORY_PHASES),
        )
    return table


def sweep_table(sweep) -> Table:
    table = Table(title=f"configurations at share {sweep.share:g} (limit {sweep.limit_gib:.1f} GiB peak)")
    for col in ("sleep level", "micro-batch", "result", "s/step", "forecast", "peak GiB", "verdict"):
        table.add_column(col, justify="left" if col in ("result", "verdict") else "right")
    for e in sweep.entries:
        t = e.trial
        result = "not tried" if t is None else t.outcome if t.ok else f"[red]{t.outcome}[/]"
        table.add_row(
            str(e.config.sleep_level),
            str(e.config.micro_batch),
            result,
            "" if e.s_per_step is None else f"{e.s_per_step:.2f}" + (f" ({len(e.timings)} trials)" if e.again else ""),
            e.forecast_cell,
            "" if e.peak is None else f"{e.peak:.2f}",
            e.verdict or "[bold]fastest[/]",
        )
    return table


def comparison_table(rows: list[dict[str, Any]], util: float) -> Table:
    table = Table(title=f"measured vs estimated peak per GPU (GiB) at share {util:g}")
    for col in ("phase", "estimate", "measured", "estimate error"):
        table.add_column(col, justify="left" if col == "phase" else "right")

    def fmt(value, spec):
        return "" if value is None else format(value, spec)

    for r in rows:
        table.add_row(
            r["phase"],
            fmt(r["estimate_gib"], ".2f"),
            fmt(r["measured_gib"], ".2f"),
            "" if r["error_pct"] is None else f"{r['error_pct']:+.1f} %",
        )
    return table


@app.command("mem-probe")
@guarded
def mem_probe(
    recipe: RecipeArg,
    estimate: Annotated[
        bool, typer.Option("--estimate", help="Compute from the model layout and the recipe (no GPU needed).")
    ] = False,
    set_: SetOpt = None,
    set_str: SetStrOpt = None,
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
    sweep: Annotated[
        bool,
        typer.Option(
            "--sweep/--no-sweep",
            help="Measuring: after the bisection, time what the recipe leaves auto (sleep level, micro-batch) at the "
            "share that holds one generation batch, and recommend the fastest that fits.",
        ),
    ] = True,
) -> None:
    """GPU memory per rank and phase (generation, weight sync, training, optimizer step) and the vLLM share to set."""
    from colocate_rl.plan.host import detect_host

    host = detect_host()
    if not estimate and not host.gpus:
        raise UserError(
            "mem-probe: no CUDA GPU on this machine; measuring runs the recipe on the GPUs — run "
            "`colocate-rl mem-probe RECIPE --estimate` here"
        )
    if write is not None and write.exists():
        raise UserError(f"--write: {write} already exists; choose another file name")
    overrides = parse_sets(set_, set_str)
    if estimate:
        return _estimate(recipe, overrides, host, gpus, gpu_memory, prompt_tokens, json_out, write)
    if gpus is not None:
        raise UserError("--gpus: only with --estimate; measuring uses the GPUs it finds")
    _measure(
        recipe,
        overrides,
        host,
        gpu_memory or host.gpus[0].memory_gib,
        prompt_tokens,
        json_out,
        write,
        steps,
        probe_dir,
        resolution,
        margin,
        trial_timeout,
        sweep,
    )


def _estimate(recipe, overrides, detected, gpus, gpu_memory, prompt_tokens, json_out, write) -> None:
    from colocate_rl.memory.estimate import MEMORY_PHASES
    from colocate_rl.memory.recommend import recommend, recommendation_lines, to_json
    from colocate_rl.pipeline import estimate_host, read_recipe, resolver
    from colocate_rl.recipe.load import format_sets, write_recipe_copy

    source = read_recipe(recipe, overrides, env=os.environ)
    host, gib = estimate_host(source.parse(), gpus=gpus, gpu_memory_gib=gpu_memory, detected=detected)
    rec = recommend(resolver(source, host), gib, prompt_tokens)  # every variant over one pre-flight
    if json_out:
        print(json.dumps(to_json(rec)))
    else:
        table = Table(
            title=f"estimated memory per GPU (GiB), vLLM share {rec.base.util} of {gib:.1f} GiB, sleep level "
            f"{rec.base.resolved.recipe.generation.sleep_level}"
        )
        table.add_column("term")
        for phase in MEMORY_PHASES:
            table.add_column(phase, justify="right")
        for term, row in rec.base.terms.items():
            table.add_row(term, *(f"{row[p]:.2f}" if p in row else "" for p in MEMORY_PHASES))
        table.add_row("total", *(f"{rec.base.total(p):.2f}" for p in MEMORY_PHASES), style="bold")
        console.print(table)
        # planning for this machine (its GPUs, not --gpus N of another node): offload must fit its RAM
        ram = detected.ram_gib if detected.gpus and gpus is None else None
        from colocate_rl.cli.train import forecast_lines

        for line in recommendation_lines(rec, ram) + rec.base.resolved.choice_lines():
            console.print(line, highlight=False, soft_wrap=True)
        for line in forecast_lines(rec.base.resolved):
            console.print(line, highlight=False, markup=False, soft_wrap=True)
    if write is not None:
        if rec.final is None:
            raise UserError("--write: no change tried makes the recipe fit; nothing written")
        changed = ", ".join(format_sets(rec.changes))
        write_recipe_copy(
            write,
            source.path,
            {**overrides, **rec.changes},
            f"{recipe} with the values of `colocate-rl mem-probe --estimate` ({changed})",
        )
        (err_console if json_out else console).print(f"wrote {write}", highlight=False)


def _measure(
    recipe,
    overrides,
    host,
    gib,
    prompt_tokens,
    json_out,
    write,
    steps,
    probe_dir,
    resolution,
    margin,
    trial_timeout,
    sweep,
) -> None:
    from colocate_rl.memory.bisect import ProbeAborted
    from colocate_rl.memory.probe import (
        SEARCH_ABOVE_ESTIMATE,
        default_probe_dir,
        measure,
        plan_probe,
        turned_off_line,
    )
    from colocate_rl.pipeline import read_recipe, resolver
    from colocate_rl.plan.sources import explain_sources
    from colocate_rl.recipe.load import format_sets, write_recipe_copy

    source = read_recipe(recipe, overrides, env=os.environ)
    resolve_with = resolver(source, host)  # the recipe and every trial's variant over one pre-flight
    resolved = resolve_with({})
    try:  # a trial's variant is planned here too: its problems come before any trial runs
        plan = plan_probe(
            resolved,
            gib,
            probe_dir or default_probe_dir(datetime.now()),
            prompt_tokens=prompt_tokens,
            resolution=resolution,
            resolve_with=resolve_with,
            steps=steps,
        )
    except UserError as e:  # distributed.nnodes from Slurm or a flag says so
        raise UserError(*explain_sources(e.lines, source.sources))
    out = err_console if json_out else console
    out.print(
        f"probing generation.vllm_gpu_memory_utilization in {plan.lower:.3f}–{plan.search_upper:.3f} (the estimated "
        f"window {plan.lower:.3f}–{plan.upper:.3f} and up to {SEARCH_ABOVE_ESTIMATE:g} above it; its top first) at "
        f"a resolution of {resolution:g}, {steps} steps a trial; trials in {plan.probe_dir}",
        highlight=False,
    )
    off = turned_off_line(plan.resolved.recipe, steps)
    if off:
        out.print(off, highlight=False, markup=False, soft_wrap=True)
    choice, sleep, micro = plan.resolved.layout_choice, plan.resolved.sleep_choice, plan.resolved.micro_batch_choice
    chose = ", ".join(
        ([choice.chosen.label] if choice is not None else [])
        + ([f"sleep level {sleep.level}"] if sleep else [])
        + ([f"micro-batch {micro.size}"] if micro else [])
    )
    if plan.pinned:
        out.print(
            f"every trial trains with what auto chose at the recipe's share ({chose}): "
            + " ".join(f"--set {item}" for item in format_sets(plan.pinned)),
            highlight=False,
            soft_wrap=True,
        )

    def on_trial(k, t) -> None:
        line = f"  → {t.outcome} ({t.seconds:.0f} s, {t.steps} steps)" + (f": {t.detail}" if t.detail else "")
        out.print(line, highlight=False, markup=False, soft_wrap=True)

    try:
        measured = measure(
            plan,
            resolve_with,
            steps=steps,
            resolution=resolution,
            margin=margin,
            timeout_s=trial_timeout,
            on_start=lambda k, u: out.print(f"trial {k}: share {u:g} ...", highlight=False),
            on_trial=on_trial,
            sweep=sweep,
            on_sweep=lambda k, c, u: out.print(f"trial {k}: share {u:g}, {c.label} ...", highlight=False),
        )
    except ProbeAborted as e:
        err_console.print(trials_table(e.trials))
        err_console.print(e.trial.log_tail, highlight=False, markup=False, soft_wrap=True)
        raise UserError(
            f"mem-probe: trial {len(e.trials)} (share {e.trial.util:g}) failed for a reason the probe "
            f"does not bisect on ({e.trial.outcome}: {e.trial.detail}); its run directory is "
            f"{e.trial.run_dir}; fix that and probe again"
        )
    result, sets = measured.result, measured.recommended_sets()
    _print_measurement(measured, source.path, gib, steps, margin, json_out)
    if sets is None:
        what = (
            f"no vLLM share in the window completed the steps ({'; '.join(result.notes)})"
            if result.recommended is None
            else f"no configuration swept at share {measured.sweep.share:g} completed the steps within the limit"
        )
        raise UserError(
            f"mem-probe: {what}; see the trials in {plan.probe_dir}" + ("; nothing written" if write else "")
        )
    if write is not None:
        write_recipe_copy(
            write,
            source.path,
            {**overrides, **sets},
            f"{recipe} with the values measured by `colocate-rl mem-probe` ({', '.join(format_sets(sets))})",
        )
        out.print(f"wrote {write}", highlight=False)


def recommendation_line(measured, sets: dict[str, Any], steps: int, margin: float) -> str:
    """The probe's one recommendation and where it comes from."""
    from colocate_rl.recipe.load import format_sets

    result, sweep = measured.result, measured.sweep
    given = " ".join(f"--set {item}" for item in format_sets(sets))
    largest = f"the largest share that completed {steps} steps is {result.largest:g}"
    if sweep is None:
        return f"recommended: {given} ({largest}, less the margin {margin:g}; not swept: --no-sweep)"
    best, n = sweep.best, sum(e.trial is not None for e in sweep.entries)
    why = "which holds one generation batch's KV cache by the estimate, plus its margin"
    if sweep.share == result.recommended and sweep.share < measured.plan.estimate.chosen:
        why = f"the largest passing share less the margin {margin:g} (below the estimate's {measured.plan.estimate.chosen:g})"
    elif sweep.share > measured.plan.estimate.chosen:
        why = "the smallest share that completed (the estimate's had too little KV cache)"
    timed = f"the fastest of {n} configurations timed" if n > 1 else "measured"
    return f"recommended: {given} — {best.s_per_step:.2f} s/step, {timed} at share {sweep.share:g}, {why} ({largest}; a larger share buys nothing)"


def _print_measurement(measured, recipe_path: Path, gib: float, steps: int, margin: float, json_out: bool) -> None:
    """The probe's result: one JSON object, or the trials, measured vs estimated peaks and the recommendation."""
    plan = measured.plan
    result, best = measured.result, measured.result.best_trial()
    if json_out:
        print(
            json.dumps(
                {
                    "recipe": str(recipe_path),
                    "gpu_memory_gib": gib,
                    "steps": steps,
                    "probe_dir": str(plan.probe_dir),
                    **measured.to_json(),
                }
            )
        )
    else:
        from colocate_rl.memory.peaks import comparison

        console.print(trials_table(result.trials))
        if best is not None:
            console.print(comparison_table(comparison(plan.estimate_at(best.util), best.peaks), best.util))
        if measured.sweep is not None:
            console.print(sweep_table(measured.sweep))
        sets = measured.recommended_sets()
        if sets is not None:
            console.print(recommendation_line(measured, sets, steps, margin), highlight=False, soft_wrap=True)
        for note in result.notes:
            console.print(f"note: {note}", highlight=False, soft_wrap=True)
        for what, check in (("layout", measured.layout_check), ("sleep level", measured.sleep_check)):
            if check is not None:
                console.print(
                    f"{what} (auto): {check['line']} — peak of share {best.util:g}'s trial moved to the recipe's "
                    f"share {check['at_share']:g}",
                    highlight=False,
                    markup=False,
                    soft_wrap=True,
                )
