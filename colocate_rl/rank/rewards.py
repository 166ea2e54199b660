"""The rank's reward functions as TRL calls them: each output checked (`checked_reward`), and a function whose recipe
says `processes: N > 1` scored on a pool of N spawned processes, each taking a slice of the batch (`RewardPool`).

A pool's process imports the reward by its recipe name (a built-in, `module:function` or `file.py:function`, from
the rank's working directory and sys.path) and gets the call's picklable arguments: prompts, completions,
completion_ids and the dataset columns, each sliced, and trainer_state's plain fields (`state_fields`); not
log_metric, log_extra or environments (`LOCAL_ONLY`). What can fail: a function's own error is raised in the rank as
it was raised (a UserError keeps its line); a pool process that dies (killed, out of memory) raises
RewardProcessError naming the reward.
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace
from typing import Any

from colocate_rl.errors import RewardProcessError, UserError
from colocate_rl.telemetry import events

LOCAL_ONLY = ("log_metric", "log_extra", "environments")  # TRL's per-call arguments that cannot cross a process


def check_rewards(values, completions, key: str):
    """`values` when it is one finite number (or None: no reward for that completion) per completion; else UserError
    (a NaN reward trains with zero loss and gradient, silently)."""
    if not isinstance(values, (list, tuple)) or len(values) != len(completions):
        got = f"{len(values)} values" if isinstance(values, (list, tuple)) else type(values).__name__
        raise UserError(f"{key}: returned {got} for {len(completions)} completions; return one number each")
    for value in values:
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
        ):
            raise UserError(
                f"{key}: returned {value!r} for a completion; a reward must be a finite number (or None to leave the "
                "completion out of this reward)"
            )
    return values


def checked_reward(fn, key: str):
    """`fn` (sync or async, as TRL calls it) with its output checked by `check_rewards`."""
    from colocate_rl.rewards import is_async

    if is_async(fn):

        @functools.wraps(fn)
        async def async_reward(*args, completions, **kwargs):
            return check_rewards(await fn(*args, completions=completions, **kwargs), completions, key)

        return async_reward

    @functools.wraps(fn)
    def reward(*args, completions, **kwargs):
        return check_rewards(fn(*args, completions=completions, **kwargs), completions, key)

    return reward


# ---------------------------------------------------------------------------------------------- in a pool process


@functools.cache
def _resolved(name: str, key: str):
    from colocate_rl.rewards import resolve_reward

    return resolve_reward(name, key=key)


def _load(names: tuple[tuple[str, str], ...]) -> None:
    """A pool process's start: import every reward it may score, and call a built-in once on a sample (`WARM_CALLS`),
    so that what its first call imports and builds (math_verify: sympy, its parsers) is ready before the first batch."""
    from colocate_rl.rewards import WARM_CALLS

    for name, key in names:
        fn = _resolved(name, key)
        if name.strip() in WARM_CALLS:
            fn(**WARM_CALLS[name.strip()])


def _score(name: str, key: str, kwargs: dict[str, Any]) -> list:
    """One slice's rewards, checked as the slice's (its length is the function's answer for this call)."""
    return check_rewards(_resolved(name, key)(**kwargs), kwargs["completions"], f"{key} {name}")


# ---------------------------------------------------------------------------------------------- in the rank


def slices(n: int, parts: int) -> list[tuple[int, int]]:
    """`range(n)` cut into at most `parts` contiguous (start, stop) slices of near-equal size, none empty."""
    if n == 0:
        return []
    parts = max(1, min(parts, n))
    bounds = [n * k // parts for k in range(parts + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def state_fields(state) -> SimpleNamespace:
    """TRL's `trainer_state` as a pool's process gets it: its plain fields (global_step, epoch, max_steps, ...), not
    its log history. Pickled whole, transformers' TrainerState made every process import transformers and torch at
    its first call (3 s on CPU, 12 s on the H200 in step 1) and would grow with every logged step."""
    import dataclasses

    fields = (
        {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}
        if dataclasses.is_dataclass(state)
        else vars(state)
    )
    return SimpleNamespace(**{k: v for k, v in fields.items() if isinstance(v, (bool, int, float, str, type(None)))})


class RewardPool:
    """Spawned processes that score reward functions, started at once so that their imports overlap the rank's."""

    def __init__(self, processes: int, names: list[tuple[str, str]]):
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        self.processes = processes
        self.executor = ProcessPoolExecutor(
            processes, mp_context=multiprocessing.get_context("spawn"), initializer=_load, initargs=(tuple(names),)
        )
        for _ in range(processes):  # spawned on demand: one submit each while none is idle starts them all
            self.executor.submit(int)

    def wrap(self, name: str, key: str, processes: int):
        """TRL's reward function for recipe reward `name`, scored on `processes` of the pool's processes."""
        from concurrent.futures.process import BrokenProcessPool

        def reward(*args, completions, **kwargs):
            if args:
                raise TypeError(f"{key}: TRL passed positional arguments; colocate-rl passes only keywords")
            n = len(completions)
            shared = {k: v for k, v in kwargs.items() if k not in LOCAL_ONLY}
            if shared.get("trainer_state") is not None:
                shared["trainer_state"] = state_fields(shared["trainer_state"])
            try:  # a process that died earlier breaks the pool: submit raises then
                futures = []
                for start, stop in slices(n, processes):
                    part = {k: v[start:stop] if isinstance(v, list) and len(v) == n else v for k, v in shared.items()}
                    part["completions"] = completions[start:stop]
                    futures.append(self.executor.submit(_score, name, key, part))
                values = [value for future in futures for value in future.result()]
            except BrokenProcessPool:
                raise RewardProcessError(
                    f"{key} {name}: a reward process died (killed, or out of memory); its error, if any, is above in "
                    "this log"
                ) from None
            return check_rewards(values, completions, f"{key} {name}")

        reward.__name__ = name.rpartition(":")[2].strip() or name  # what TRL logs, as for the function itself
        return reward

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


def reward_functions(recipe) -> tuple[list, RewardPool | None]:
    """TRL's `reward_funcs` for `recipe` (its `processes` resolved by the plan: integers), and the pool that scores
    those on more than one process (None when none does): a reward model as its path, a function checked."""
    import os

    from colocate_rl.rewards import resolve_reward

    # every function imported here first: one that fails ends the rank before any pool process starts
    resolved = {
        i: resolve_reward(r.name, key=f"rewards[{i}].name") for i, r in enumerate(recipe.rewards) if r.model is None
    }
    parallel = [(r.name, f"rewards[{i}].name") for i, r in enumerate(recipe.rewards) if _processes(r) > 1]
    pool = RewardPool(max(_processes(r) for r in recipe.rewards), parallel) if parallel else None
    funcs = []
    for i, r in enumerate(recipe.rewards):
        key = f"rewards[{i}].name"
        if r.model is not None:  # TRL loads it (sequence classifier, num_labels 1, the policy's dtype)
            funcs.append(os.path.normpath(os.path.expanduser(r.model)))
        elif _processes(r) > 1:
            funcs.append(pool.wrap(r.name, key, _processes(r)))
            events.log_line(f"[colocate-rl rewards] {key} {r.name}: scored on {_processes(r)} processes")
        else:
            funcs.append(checked_reward(resolved[i], f"{key} {r.name}"))
    return funcs, pool


def _processes(reward) -> int:
    return reward.processes if isinstance(reward.processes, int) else 1
