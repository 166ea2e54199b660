"""The generation-engine interface: what the trainer and the evaluation ask of whatever generates completions.

An engine turns prompt token ids and sampling settings into completion token ids and, where it can, the sampled
tokens' log-probabilities. Its lifecycle is `start` → (`push_weights` after every optimizer step, `generate` any
number of times, several under one `hold` for multi-turn episodes; `sleep`/`wake` where it hands memory to the
trainer) → `stop`. The trainer calls it through
`colocate_rl.rank.adapter.trl` (TRL's generation step) and `colocate_rl.rank.evaluation` (held-out evaluation); no
caller reaches into an engine's internals.

`submit` starts a generation and returns at once where the engine runs elsewhere (its `Pending.result()` waits for
it), so the trainer can train meanwhile (`generation.overlap`); an engine in the rank's own process generates inside
`submit`.

Implementations: `colocate_rl.rank.vllm_engine.VLLMEngine` (vLLM in the rank's process, colocate-rl's sleep/wake and
bucketed push), `colocate_rl.rank.hf_engine.TransformersEngine` (transformers' `generate`, the CPU path),
`colocate_rl.rank.hf_engine.TRLEngine` (TRL's own colocated vLLM engine, `generation.engine: trl`) and
`colocate_rl.rank.engine_process.ProcessEngine` (either of the first two in a process of its own on the rank's
device). A new backend or a multi-turn rollout is one more implementation of this class.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class Sampling:
    """How to sample one completion per prompt. `temperature` 0 is greedy. `extra` holds the recipe's
    `generation_kwargs` (the engine's own sampling options, passed through)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None  # None: no min-p filter
    repetition_penalty: float = 1.0
    extra: dict[str, Any] = field(default_factory=dict)
    logprobs: bool = True  # the sampled tokens' logprobs, where the engine can return them (RLOO reads none)

    @classmethod
    def from_args(cls, args: Any) -> Sampling:
        """The training sampling of a TRL GRPOConfig/RLOOConfig (public fields only)."""
        return cls(
            max_tokens=args.max_completion_length,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k or 0,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            extra=dict(args.generation_kwargs or {}),
        )

    def at_temperature(self, temperature: float) -> Sampling:
        return replace(self, temperature=temperature)

    def without_logprobs(self) -> Sampling:
        return replace(self, logprobs=False)


@dataclass
class Generation:
    """One completion per prompt, in the prompts' order: token ids (ending at and including EOS when sampled) and,
    when the engine samples them, each token's log-probability (None where it has none)."""

    completion_ids: list[list[int]]
    logprobs: list[list[float | None]] | None = None
    # what an engine process spent generating it (overlap hides it): `generate_s` seconds; `cpu_s` its CPU seconds,
    # all threads (a spinning wait on the GPU counts); `preempted` how often the OS took its CPU for another thread
    engine_usage: dict[str, float] | None = None

    @staticmethod
    def empty(with_logprobs: bool) -> Generation:
        """No completion (no prompt): its logprobs an empty list where the engine returns them."""
        return Generation([], [] if with_logprobs else None)

    @staticmethod
    def joined(parts: list[Generation], at_once: bool) -> Generation:
        """The generations of one batch's parts (at least one), in order, as one; no logprobs if a part has none.
        `engine_usage` is summed over the parts, but for parts generated `at_once` (by engine processes side by side)
        its `generate_s` is the slowest part's."""
        if len(parts) == 1:
            return parts[0]
        ids = [c for part in parts for c in part.completion_ids]
        logprobs = None if any(p.logprobs is None for p in parts) else [lp for part in parts for lp in part.logprobs]
        usages = [p.engine_usage for p in parts if p.engine_usage is not None]
        usage = None
        if usages:
            usage = {k: (max if at_once and k == "generate_s" else sum)(u[k] for u in usages) for k in usages[0]}
        return Generation(ids, logprobs, usage)

    def placed(self, at: list[int], n: int) -> Generation:
        """This generation's completions (one per prompt of `at`) at those positions of `n` prompts, no completion
        at the others (prompts left out of the call)."""
        if len(at) == n:
            return self
        ids: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[float | None]] | None = None if self.logprobs is None else [[] for _ in range(n)]
        for k, i in enumerate(at):
            ids[i] = self.completion_ids[k]
            if logprobs is not None:
                logprobs[i] = self.logprobs[k]
        return Generation(ids, logprobs)


class Pending:
    """A generation `submit` started: `result()` waits for it (raises what the generation raised)."""

    def __init__(self, result: Callable[[], Generation]):
        self._result, self._value = result, None

    def result(self) -> Generation:
        if self._value is None:
            self._value = self._result()
        return self._value


Phase = Callable[[str], AbstractContextManager]


def no_phase(name: str) -> AbstractContextManager:
    return nullcontext()


class GenerationEngine(ABC):
    """One rank's generation backend. Methods raise on failure; an engine that cannot start raises UserError (the
    run ends with its line) and a weight check that fails raises StaleWeightsError."""

    #: True when `generate` returns the sampled tokens' log-probabilities (TRL then corrects for the mismatch
    #: between the sampler and the trainer with importance sampling).
    returns_logprobs: bool = False
    #: The most prompts one `generate` call takes (None: any number; callers split larger batches).
    max_batch: int | None = None
    #: `phase(name)` times a part of the engine's work on the rank's timeline (set by colocate_rl.rank.telemetry).
    phase: Phase = staticmethod(no_phase)

    def start(self) -> None:
        """Bring the engine up (load the model, allocate its memory). Called once before the first step."""
        return None  # the default: an engine without memory or weights of its own

    @abstractmethod
    def generate(self, prompt_ids: list[list[int]], sampling: Sampling) -> Generation:
        """One completion per prompt. A collective: every rank calls it with its own prompts."""

    def submit(self, prompt_ids: list[list[int]], sampling: Sampling) -> Pending:
        """Start `generate(prompt_ids, sampling)`; the default generates now (an engine in the rank's process)."""
        out = self.generate(prompt_ids, sampling)
        return Pending(lambda: out)

    def push_weights(self) -> None:
        """Make the next generation sample from the trainer's current weights. Called after each optimizer step."""
        return None  # the default: an engine without memory or weights of its own

    def sleep(self) -> None:
        """Release the engine's GPU memory for the trainer (no-op where it holds none)."""
        return None  # the default: an engine without memory or weights of its own

    def wake(self) -> None:
        """Take back what `sleep` released."""
        return None  # the default: an engine without memory or weights of its own

    def hold(self) -> AbstractContextManager:
        """Keep the engine awake across the `generate` calls inside the block (the turns of a batch of multi-turn
        episodes), releasing its memory once at the end instead of after every call."""
        return nullcontext()  # the default: an engine without memory of its own to release

    def stop(self) -> None:
        """Release everything; the engine is not used again."""
        return None  # the default: an engine without memory or weights of its own
