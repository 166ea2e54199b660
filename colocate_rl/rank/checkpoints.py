"""When the ranks save a checkpoint, and a stop request that ends the run with one.

A TrainerCallback asks TRL for a save at a step end when `checkpoint.every_steps` divides the step, when
`checkpoint.every_minutes` passed since the last save, or when the launcher wrote the run dir's STOP request (then
training also stops). The ranks agree on it first (one all-reduce of two flags per step), so that every rank saves
at the same step — a collective save of some ranks only would hang. Once every rank saved, rank 0 marks the
checkpoint complete (`colocate_rl.rundir.CHECKPOINT_COMPLETE`); `train --resume` only continues from complete ones.
Nothing here raises into training.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from colocate_rl.rundir import CHECKPOINT_COMPLETE, RunDir
from colocate_rl.telemetry import events


def agree(flags: list[bool]) -> list[bool]:
    """Each flag true on any rank is true on every rank (identity without a process group)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flags
    device = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
    tensor = torch.tensor([float(f) for f in flags], device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [bool(v) for v in tensor.tolist()]


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def make_checkpoint_callback(
    run_dir: Path, every_steps: int | None, every_minutes: float | None, clock: Callable[[], float] = time.monotonic
):
    """The policy as a TrainerCallback; its `stopped_at` is the step a stop request ended training at (or None)."""
    from transformers import TrainerCallback

    paths = RunDir(run_dir)

    class CheckpointPolicy(TrainerCallback):
        def __init__(self):
            self.last_save = clock()
            self.stopped_at: int | None = None

        def on_train_begin(self, args, state, control, **kwargs):
            self.last_save = clock()

        def on_step_end(self, args, state, control, **kwargs):
            step = state.global_step
            due = bool(every_steps and step % every_steps == 0) or bool(
                every_minutes and clock() - self.last_save >= every_minutes * 60
            )
            due, stop = agree([due and step < state.max_steps, paths.stop_request.exists()])
            if stop:
                control.should_save = control.should_training_stop = True
                self.stopped_at = step
            elif due:
                control.should_save = True
            return control

        def on_save(self, args, state, control, **kwargs):
            barrier()  # every rank has written its part (ZeRO shards, RNG state)
            self.last_save = clock()
            if state.is_world_process_zero:
                checkpoint = paths.checkpoints / f"checkpoint-{state.global_step}"
                marker = {"step": state.global_step, "world_size": args.world_size, "time": round(time.time(), 3)}
                (checkpoint / CHECKPOINT_COMPLETE).write_text(json.dumps(marker) + "\n")
                events.emit(run_dir, events.CHECKPOINT, step=state.global_step, path=str(checkpoint))
            return control

    return CheckpointPolicy()
