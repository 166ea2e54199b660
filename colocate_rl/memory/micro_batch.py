"""`trainer.micro_batch_size`: the completions of a rank's step split into fewer, larger micro-batches.

A rank trains on `per_device_train_batch_size × gradient_accumulation_steps` completions per optimizer step, and
TRL generates them in one batch (its steps per generation default to the accumulation steps). `with_micro_batch`
keeps that product and moves it to a micro-batch of `m` and `product / m` accumulation steps: the same step, the
same generation batch, fewer forward/backward passes.

`auto` is decided last, after the layout and the sleep level (both chosen at the recipe's own micro-batch, which
they therefore hold to): the largest divisor of the product, at least the recipe's micro-batch, whose estimated
peak at the sleep level chosen stays within the GPU's memory less LAYOUT_HEADROOM. Without a GPU, or without an
estimate, the recipe's micro-batch stays.

Where `generation.sleep_level: auto` chose 0 (trainer and vLLM fit awake) and nothing overlaps, the same choice is
made with vLLM asleep (level 2 frees vLLM's memory while training, so a larger micro-batch may fit), and the step-time
forecast (colocate_rl.memory.forecast) of the two decides: asleep when it forecasts a step at least SLEEP_FOR_SPEED
shorter. Fewer micro-batches save a forward/backward's fixed cost each; sleeping adds the wake, the sleep and the
weights woken. Without a forecast (not an H200, ...) the level stays 0.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from colocate_rl.errors import UserError
from colocate_rl.memory.autolayout import LAYOUT_HEADROOM
from colocate_rl.plan.choices import MicroBatchChoice, SleepChoice

if TYPE_CHECKING:
    from colocate_rl.plan.resolved import Resolved
    from colocate_rl.recipe.schema import Recipe

# The least share of the awake step a forecast must save to put vLLM to sleep for a larger micro-batch: below it the
# forecast's own error decides (docs/guide/memory.md#step-time-forecast), and awake is simpler (no wake, no sleep).
SLEEP_FOR_SPEED = 0.05


def with_micro_batch(recipe: Recipe, size: int) -> Recipe:
    """A copy of `recipe` whose step is split into micro-batches of `size` (a divisor of the step's completions),
    written as per_device_train_batch_size and gradient_accumulation_steps; micro_batch_size is then consumed."""
    update = {
        "per_device_train_batch_size": size,
        "gradient_accumulation_steps": recipe.trainer.step_completions // size,
        "micro_batch_size": None,
    }
    return recipe.model_copy(update={"trainer": recipe.trainer.model_copy(update=update)})


def choose_micro_batch(resolved: Resolved, gpu_gib: float | None) -> MicroBatchChoice | None:
    """`trainer.micro_batch_size: auto` for `resolved` (layout and sleep level chosen or given): see the module
    docstring. None when the step is one micro-batch: nothing to choose."""
    from colocate_rl.memory.estimate import estimate

    recipe = resolved.recipe
    written, total = recipe.trainer.per_device_train_batch_size, recipe.trainer.step_completions
    if written == total:
        return None
    sizes = [m for m in range(total, written - 1, -1) if total % m == 0]
    if gpu_gib is None:
        return MicroBatchChoice(written, total // written, "no GPU here, so no memory to size it against: as written")
    limit = gpu_gib * (1 - LAYOUT_HEADROOM)
    margin = f"{gpu_gib:.1f} GiB less {LAYOUT_HEADROOM:.0%} margin"
    for size in sizes:
        try:
            phase, peak = estimate(dataclasses.replace(resolved, recipe=with_micro_batch(recipe, size)), gpu_gib).peak()
        except UserError as err:  # unknown layout: no estimate possible
            reason = f"no estimate ({err.lines[0]}), so as written; set trainer.micro_batch_size to override"
            return MicroBatchChoice(written, total // written, reason)
        if peak <= limit:
            which = (
                f"the step's {total} completions fit in one micro-batch"
                if size == total
                else f"the largest divisor of the step's {total} completions that fits"
            )
            reason = f"{which} (peak {peak:.2f} ≤ {limit:.1f} GiB, {margin})"
            return MicroBatchChoice(size, total // size, reason, peak, limit)
    reason = f"no larger one fits (at {written} the peak is {peak:.2f} GiB ({phase}) > {limit:.1f} GiB, {margin})"
    return MicroBatchChoice(written, total // written, reason, peak, limit)


def _with_choice(resolved: Resolved, micro: MicroBatchChoice | None) -> Resolved:
    size = micro.size if micro is not None else resolved.recipe.trainer.per_device_train_batch_size
    return dataclasses.replace(resolved, recipe=with_micro_batch(resolved.recipe, size), micro_batch_choice=micro)


def choose_micro_batch_and_sleep(resolved: Resolved, gpu_gib: float | None) -> Resolved:
    """`resolved` with `trainer.micro_batch_size: auto` chosen, and `generation.sleep_level: auto`'s 0 turned to 2
    where the forecast says sleeping for a larger micro-batch is faster (see the module docstring)."""
    from colocate_rl.memory.autolayout import with_sleep_level
    from colocate_rl.memory.forecast import forecast

    awake = _with_choice(resolved, choose_micro_batch(resolved, gpu_gib))
    sleep, micro = resolved.sleep_choice, awake.micro_batch_choice
    if sleep is None or sleep.level != 0 or resolved.recipe.generation.overlap != "off" or micro is None:
        return awake
    asleep_view = dataclasses.replace(resolved, recipe=with_sleep_level(resolved.recipe, 2))
    bigger = choose_micro_batch(asleep_view, gpu_gib)
    if bigger is None or bigger.size <= micro.size:
        return awake
    asleep = _with_choice(asleep_view, bigger)
    fast, slow = forecast(asleep), forecast(awake)
    if fast.reason is not None or slow.reason is not None or fast.s_per_step > slow.s_per_step * (1 - SLEEP_FOR_SPEED):
        return awake
    reason = (
        f"faster by the forecast: {fast.s_per_step:.2f} s/step with vLLM asleep while training in micro-batches of "
        f"{bigger.size}, {slow.s_per_step:.2f} awake in micro-batches of {micro.size}, which fit beside vLLM (peak "
        f"{sleep.peak_gib:.2f} ≤ {sleep.limit_gib:.1f} GiB at sleep 0)"
    )
    chosen = SleepChoice(2, reason, sleep.peak_gib, sleep.limit_gib, awake_micro_batch=micro.size)
    return dataclasses.replace(asleep, sleep_choice=chosen)
