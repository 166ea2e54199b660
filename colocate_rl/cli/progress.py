"""What a running `train` shows: a live bar on a terminal or one line per step, evaluation lines, and how the run
ended (stopped with its checkpoint and the resume command, failed with the log tail and the ranks' errors)."""

from __future__ import annotations

from typing import Any

SHORT_PHASES = {
    "generate": "gen",
    "weight_sync": "sync",
    "weight_check": "check",
    "wake": "wake",
    "sleep": "sleep",
    "offload": "offload",
    "reload": "reload",
    "reward": "score",  # scoring the completions: not "reward", the mean reward's name on the same line
    "tools": "tools",  # tool calls of multi-turn episodes
    "prepare": "prep",
    "train": "train",
    "optimizer": "opt",
}


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
    if isinstance(record.get("tools/call_frequency"), (int, float)):
        parts.append(f"tools {record['tools/call_frequency']:.2f}/episode")
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


def live_status(record: dict[str, Any], phases: dict[str, None]) -> str:
    """The live line after its step count: `reward 0.963  0.24 s/step  RSS 0.55 GiB  gen 0.11s score 0.00s ...`.
    `phases` (updated here) holds every phase seen so far, in a fixed order, each shown with its time this step
    (0.00s when it did not run), so no field moves or vanishes from one step to the next."""
    parts = [f"reward {record['reward']:.3f}"]
    if isinstance(record.get("time/step_s"), (int, float)):
        parts.append(f"{record['time/step_s']:.2f} s/step")
    if "mem/gpu_used_gib" in record:
        parts.append(f"GPU {record['mem/gpu_used_gib']:.1f} GiB peak {record.get('mem/gpu_peak_gib', 0):.1f}")
    elif "mem/rss_gib" in record:
        parts.append(f"RSS {record['mem/rss_gib']:.2f} GiB")
    phases.update((name, None) for name in SHORT_PHASES if record.get(f"time/{name}_s", 0) >= 0.005)
    shown = [name for name in SHORT_PHASES if name in phases]
    return "  ".join(parts) + "  " + " ".join(f"{SHORT_PHASES[n]} {record.get(f'time/{n}_s', 0):.2f}s" for n in shown)


def live_progress(console):
    """The live line of a run on a terminal: `step 20/40 ━━━━━━ 0:00:12 reward 0.963 ...`, as wide as the terminal
    (the status is cut with … where it does not fit), the step count and time left always shown: a rich `Progress`
    whose task has the fields `steps` (`step_count`) and `status` (`live_status`)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
    from rich.table import Column

    return Progress(
        TextColumn("{task.fields[steps]}", table_column=Column(no_wrap=True, min_width=len("step 99/99"))),
        BarColumn(bar_width=10),
        TimeRemainingColumn(),
        TextColumn("{task.fields[status]}", table_column=Column(ratio=1, no_wrap=True, overflow="ellipsis")),
        console=console,
        expand=True,
    )


def step_count(step: int, total: int | None) -> str:
    """`step  7/40`: padded to the width of the last step's, so the bar does not move as the count grows."""
    if total is None:
        return f"step {step}"
    return f"step {step:>{len(str(total))}}/{total}"


def run_with_progress(plan, console, verbose: bool = False, watchdog=None) -> int:
    """Prepare and run `plan`, showing progress (a live line on a terminal, one line per step otherwise, every rank's
    output with `verbose`) and how the run ended; returns the exit code for `train`."""
    import signal

    from colocate_rl.launch.execute import prepare, run
    from colocate_rl.rundir import RunDir

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
    phases: dict[str, None] = {}
    if console.is_terminal and not verbose:
        progress = live_progress(console)
        task = progress.add_task("train", total=None, steps="step –", status="starting ranks ...")
        progress.start()

    def on_step(record: dict[str, Any]) -> None:
        if "reward" not in record:  # a held-out evaluation
            (progress.console if progress is not None else console).out(eval_line(record), highlight=False)
        elif progress is not None:
            total = record.get("max_steps")
            progress.update(
                task,
                completed=record["step"],
                total=total,
                steps=step_count(record["step"], total),
                status=live_status(record, phases),
            )
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

    def on_notice(line: str) -> None:
        (progress.console if progress is not None else console).print(
            line, markup=False, highlight=False, soft_wrap=True
        )

    try:
        result = run(
            plan,
            on_step=on_step,
            echo=echo if verbose else None,
            on_stop_request=on_stop_request,
            watchdog=watchdog,
            on_notice=on_notice,
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
            when = "before the first step" if result.before_first_step else "without a new checkpoint"
            line = f"stopped ({name}) {when}; {_resume_line(plan.run_dir, 'no checkpoint was saved')}"
            console.print(line, highlight=False, soft_wrap=True)
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
        own = result.errors or ([result.rank_error] if result.rank_error else [])
        if not verbose and not own:  # a rank's own error line says it; torchrun's traceback would bury it
            console.print(result.log_tail(), markup=False, highlight=False)
        console.print(f"[red]error:[/] training failed (exit code {result.code}); full log: {result.log}")
        for line in own:
            console.print(f"[red]error:[/] {line}", highlight=False, soft_wrap=True)
        for line in result.hints:
            console.print(f"[yellow]hint:[/] {line}", highlight=False)
        if RunDir(plan.run_dir).complete_checkpoints():
            console.print(_resume_line(plan.run_dir, ""), highlight=False, soft_wrap=True)
    return result.code


def _resume_line(run_dir, none: str) -> str:
    """`the last complete checkpoint is ...; resume with: ...`, or `none` when there is no complete checkpoint."""
    from rich.markup import escape

    from colocate_rl.rundir import RunDir

    last = RunDir(run_dir).complete_checkpoints()
    if not last:
        return none
    return escape(f"the last complete checkpoint is {last[-1]}; resume with: colocate-rl train --resume {run_dir}")
