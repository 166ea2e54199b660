"""Tool calls on a rank: the recipe's tools and environment handed to TRL's trainer, and every call guarded.

TRL's tool loop (`GRPOTrainer._tool_call_loop`) calls each episode's tools by name and turns an exception into an
error result the model reads (`{'error': '...'}`), counted in `tools/failure_frequency`. `ToolGuard` wraps each
episode's tools before the loop runs (`colocate_rl.rank.adapter.trl`): a call runs for at most `tools.timeout_s`
(SIGALRM in the main thread, where TRL calls synchronous tools; `asyncio.wait_for` for async ones), an episode makes
at most `tools.max_calls` calls, and a timeout, a call over the limit or a tool's `sys.exit()` becomes such an error
result instead of ending the run. Ctrl-C still stops the rank. Synchronous calls are timed as the `tools` phase.

A timeout cannot interrupt a tool stuck inside C code that never returns to Python; such a tool holds the rank until
the step watchdog ends the job.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import signal
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import AbstractContextManager
from typing import Any

from colocate_rl.rank.engine import no_phase
from colocate_rl.recipe.tools import ToolsSection
from colocate_rl.rewards import alarm
from colocate_rl.tools import resolve_environment, resolve_tool


class ToolError(Exception):
    """What the model gets back instead of a result (TRL renders it as `{'error': message}`)."""


class _Expired(BaseException):
    """The time limit ran out inside a tool (a BaseException, so that the tool's own `except Exception` lets it by)."""


def _call_with_timeout(fn: Callable, kwargs: dict[str, Any], seconds: float):
    """`fn(**kwargs)`, stopped after `seconds` with ToolError. In the main thread by SIGALRM (raised again every
    0.5 s should the tool swallow it); elsewhere in a worker thread (which then runs on, abandoned)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            return pool.submit(fn, **kwargs).result(timeout=seconds)
        except FutureTimeout:
            raise ToolError(f"the tool did not return within {seconds:g} s") from None
        finally:
            pool.shutdown(wait=False)  # a call that timed out is left to finish on its own
    try:
        with alarm(seconds, _Expired, repeat_s=0.5):
            return fn(**kwargs)
    except _Expired:
        raise ToolError(f"the tool did not return within {seconds:g} s") from None
    except SystemExit as e:
        raise ToolError(f"the tool called sys.exit({e.code!r})") from None


class ToolGuard:
    """The limits of `tools:` on every call of a batch of episodes, and what the batch did (`calls`, `limited`)."""

    def __init__(self, section: ToolsSection, phase: Callable[[str], AbstractContextManager] = no_phase):
        self.max_calls, self.timeout_s, self.phase = section.max_calls, section.timeout_s, phase
        self.calls: list[int] = []  # per episode of the current batch
        self.limited = 0  # calls refused by the per-episode limit in this batch

    def start_batch(self, episodes: int) -> None:
        self.calls, self.limited = [0] * episodes, 0

    def _count(self, episode: int) -> None:
        if self.calls[episode] >= self.max_calls:
            self.limited += 1
            raise ToolError(f"tool call limit reached: at most {self.max_calls} calls per episode (tools.max_calls)")
        self.calls[episode] += 1

    def wrap(self, tool: Callable, episode: int) -> Callable:
        """`tool` as episode `episode` calls it, under the limits."""
        if inspect.iscoroutinefunction(tool):

            @functools.wraps(tool)
            async def guarded_async(**kwargs):
                self._count(episode)
                try:
                    return await asyncio.wait_for(tool(**kwargs), self.timeout_s)
                except asyncio.TimeoutError:
                    raise ToolError(f"the tool did not return within {self.timeout_s:g} s") from None

            return guarded_async

        @functools.wraps(tool)
        def guarded(**kwargs):
            self._count(episode)
            with self.phase("tools"):
                return _call_with_timeout(tool, kwargs, self.timeout_s)

        return guarded


def trainer_tools(section: ToolsSection) -> dict[str, Any]:
    """TRL trainer arguments for the recipe's `tools:` (`tools`, `environment_factory`); {} without tools. UserError
    naming the key when the code no longer imports (the pre-flight imported it before launch)."""
    if not section.active:
        return {}
    args: dict[str, Any] = {
        "tools": [resolve_tool(name, key=f"tools.functions[{i}]") for i, name in enumerate(section.functions)]
    }
    if section.environment is not None:
        args["environment_factory"] = resolve_environment(section.environment, key="tools.environment")
    return args
