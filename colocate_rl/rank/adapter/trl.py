"""Every use of TRL's private API (pinned: trl==1.16.0), each with what it relies on. `check_trainer_class` and
`check_trainer` verify them at rank start (see `colocate_rl.rank.adapter.verify`).

colocate-rl puts its generation engine under TRL's trainers by subclassing them (`engine_trainer`): TRL's
generation step calls `_generate_single_turn`, which the subclass answers from `trainer.engine`
(`colocate_rl.rank.engine.GenerationEngine`). TRL's own code is not patched.
"""

from __future__ import annotations

import inspect
from typing import Any

from colocate_rl.rank.adapter import trl_micro_batches, trl_old_logprobs
from colocate_rl.rank.engine import Generation, GenerationEngine, Sampling, no_phase

# The hooked method's parameters, per trainer (relied on: TRL calls it with prompt token ids from its generation step
# and, in the tool-call loop, with the tool results appended; GRPO returns (completion ids, logprobs), RLOO the ids).
SINGLE_TURN = {
    "GRPOTrainer": ["self", "prompt_ids", "images", "multimodal_fields", "num_generations", "has_tool_images"],
    "RLOOTrainer": ["self", "prompt_ids", "images", "multimodal_fields"],
}
# Private methods colocate-rl calls or times, with the parameters it relies on.
CALLED = {
    "_tokenize_prompts": ["self", "prompts"],  # evaluation: TRL's chat template and tokenisation of prompts
    "_calculate_rewards": ["self", "inputs", "prompts", "completions", "completion_ids_list"],  # evaluation, timed
    "_generate_and_score_completions": None,  # timed as the "prepare" phase (any parameters)
    # transformers' training loop takes each optimizer step's batches with it: overlap's look-ahead
    "get_batch_samples": ["self", "epoch_iterator", "num_batches", "device"],
}
# GRPOTrainer's multi-turn path (tools, environments), with what colocate-rl relies on: `_generate(prompts)` runs one
# batch of episodes (first turn, then `_tool_call_loop`, whose turns call `_generate_single_turn` too) and returns
# (prompt_ids, completion_ids, tool_mask, completions, ...); `_tool_call_loop` calls episode i's tools from
# `_sync_tool_dicts[i]` / `_async_tool_dicts[i]`, which `_generate_and_score_completions` builds before `_generate`.
EPISODES = {
    "_generate": ["self", "prompts"],
    "_tool_call_loop": [
        "self",
        "prompts",
        "prompt_ids",
        "completion_ids",
        "completions",
        "logprobs",
        "images",
        "multimodal_fields",
    ],
}
EPISODE_SOURCE = {
    "_tool_call_loop": ("self._sync_tool_dicts[idx_with_tool]", "self._async_tool_dicts[idx_with_tool]"),
    "_generate": ("return prompt_ids, completion_ids, tool_mask, completions,",),
    "_tokenize_prompts": ("self._batch_environments",),  # each episode's tools by its environment's name
}
# GRPO's attributes of the multi-turn path: the tools (standalone and environments' methods), the environment factories
# by name, whether examples pick theirs (`environment` column), the episode's environments (rewards read them).
EPISODE_ATTRIBUTES = ("tools", "_standalone_tools", "environment_factories", "_multi_environment", "environments")
# Private attributes of a built trainer: `_metrics[mode]` (TRL's per-step metric lists, read for the completion
# length; evaluation clears "eval"), `_pending_metrics`/`_pending_extra_logs` (what rewards logged meanwhile; evaluation
# drops them), `use_vllm` (gates the importance-sampling correction), `vllm_mode` (the tool loop reads TRL's engine
# only when it is "colocate").
ATTRIBUTES = ("_metrics", "_pending_metrics", "_pending_extra_logs", "use_vllm", "vllm_mode", "reward_func_names")


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def base_of(trainer_cls: type) -> str | None:
    """'GRPOTrainer' or 'RLOOTrainer': the TRL trainer `trainer_cls` is or derives from."""
    names = [c.__name__ for c in trainer_cls.__mro__ if c.__module__.startswith("trl.")]
    return next((n for n in names if n in SINGLE_TURN), None)


def check_trainer_class(trainer_cls: type) -> list[str]:
    """What is missing or changed in TRL's trainer class for colocate-rl's hooks, one problem a line."""
    base = base_of(trainer_cls)
    if base is None:
        return [f"{trainer_cls.__name__} derives from neither TRL's GRPOTrainer nor RLOOTrainer"]
    problems = []
    hooked = {"_generate_single_turn": SINGLE_TURN[base], **CALLED, **(EPISODES if base == "GRPOTrainer" else {})}
    for name, expected in hooked.items():
        fn = getattr(trainer_cls, name, None)
        if fn is None:
            problems.append(f"trl {base}.{name} is missing")
        elif expected is not None and _params(fn) != expected:
            problems.append(f"trl {base}.{name}{tuple(_params(fn))} changed (expected {tuple(expected)})")
    for name, needles in (EPISODE_SOURCE if base == "GRPOTrainer" else {}).items():
        fn = getattr(trainer_cls, name, None)
        source = inspect.getsource(fn) if fn is not None else ""
        problems += [f"trl {base}.{name} no longer has `{n}`" for n in needles if fn is not None and n not in source]
    problems += trl_micro_batches.check(trainer_cls, base)
    return problems + (trl_old_logprobs.check(trainer_cls) if base == "GRPOTrainer" else [])


def check_trainer(trainer) -> list[str]:
    """What is missing on a built trainer: the private attributes used, and the engine in place."""
    base = base_of(type(trainer))
    attributes = (
        ATTRIBUTES + (EPISODE_ATTRIBUTES if base == "GRPOTrainer" else ()) + trl_micro_batches.ATTRIBUTES.get(base, ())
    )
    problems = [f"trl {type(trainer).__name__}.{a} is missing" for a in attributes if not hasattr(trainer, a)]
    if not isinstance(getattr(trainer, "engine", None), GenerationEngine):
        problems.append(f"the trainer's generation engine is {type(getattr(trainer, 'engine', None)).__name__}")
    hook = getattr(type(trainer), "_generate_single_turn", None)
    if getattr(hook, "__qualname__", "").split(".")[0] not in ("GRPOHooks", "RLOOHooks"):
        problems.append("TRL's _generate_single_turn is not colocate-rl's: generation would bypass the engine")
    return problems


class _EngineHooks:
    """What colocate-rl adds to a TRL trainer: the engine, timed phases and the telemetry merged into each log."""

    engine: GenerationEngine
    phase = staticmethod(no_phase)  # colocate_rl.rank.telemetry sets the rank's phase timer
    log_extras = None  # callable(trainer, logs) -> logs, set by the worker (telemetry of the step)
    tool_guard = None  # colocate_rl.rank.tools.ToolGuard, set by the worker for recipes with tools
    sampling_override: Sampling | None = None  # the evaluation's sampling while it runs episodes
    turns = 0  # prompts generated since the batch of episodes began (first turns and tool turns)
    overlap = False  # generation.overlap one_step: the next step's generation batch generates while this one trains
    _ahead: list | None = None  # overlap: batches taken from the epoch's iterator ahead of their step
    _ahead_of = None  # the iterator they came from
    _pending = None  # overlap: (prompt ids, sampling, Pending) of the next step's generation batch

    def __init__(self, *args: Any, engine_factory, trl_builds_vllm: bool = False, **kwargs: Any):
        config = kwargs["args"]
        use_vllm = bool(config.use_vllm)
        if use_vllm and not trl_builds_vllm:
            config.use_vllm = False  # relied on: TRL starts its own vLLM in __init__ only when use_vllm
        try:
            super().__init__(*args, **kwargs)
        finally:
            config.use_vllm = use_vllm
        self.engine = engine_factory(self)
        if use_vllm and not trl_builds_vllm:
            self.use_vllm = (
                self.engine.returns_logprobs
            )  # TRL: importance-sampling correction from the sampler's logprobs
            self.vllm_mode = "colocate-rl"  # TRL's tool loop then sizes from the model config, not TRL's engine
        self._pushed_step = -1
        self.engine.start()

    def _push_if_stale(self) -> None:
        if self.state.global_step != self._pushed_step:
            self.engine.push_weights()
            self._pushed_step = self.state.global_step

    def get_batch_samples(self, epoch_iterator, num_batches, *args, **kwargs):
        """Overlap: this step's batches, with the next step's taken from the iterator too (`_ahead`), so that its
        prompts can generate while this step trains (relied on: transformers' training loop takes each optimizer
        step's batches with this method, TRL's generation batch being the step's first)."""
        if not self.overlap:
            return super().get_batch_samples(epoch_iterator, num_batches, *args, **kwargs)
        if self._ahead_of is not epoch_iterator:  # a new epoch (or the first step): nothing taken ahead from it
            self._ahead, self._ahead_of = [], epoch_iterator
        while len(self._ahead) < 2 * num_batches:
            try:
                self._ahead.append(next(epoch_iterator))
            except StopIteration:
                break
        batches, self._ahead = self._ahead[:num_batches], self._ahead[num_batches:]
        return super().get_batch_samples(iter(batches), num_batches, *args, **kwargs)

    def generate_completions(self, prompt_ids: list[list[int]], sampling: Sampling) -> Generation:
        """One completion per prompt from the engine, the trainer's weights pushed first when a step changed them.
        With overlap, a training batch is taken from the generation started one step earlier when it is for these
        prompts (else generated now), then the next step's batch is started from the current weights (not at the
        last step)."""
        if self.overlap and self.model.training:
            return self._overlapped(prompt_ids, sampling)
        with self.phase("generate"):
            self._push_if_stale()
            step = self.engine.max_batch or max(len(prompt_ids), 1)
            parts = [self.engine.generate(prompt_ids[i : i + step], sampling) for i in range(0, len(prompt_ids), step)]
            out = Generation.joined(parts, at_once=False) if parts else Generation.empty(self.engine.returns_logprobs)
            self._log_engine_usage(out)
            return out

    def _overlapped(self, prompt_ids: list[list[int]], sampling: Sampling) -> Generation:
        pending, self._pending = self._pending, None
        with self.phase("generate"):
            if pending is not None and pending[0] == prompt_ids and pending[1] == sampling:
                out, ahead = pending[2].result(), 1.0
            else:  # the first step, a resumed run, a batch other than the one taken ahead: generate now
                if pending is not None:
                    pending[2].result()  # the engine answers in order: collect and drop it
                self._push_if_stale()
                out, ahead = self.engine.generate(prompt_ids, sampling), 0.0
            self._push_if_stale()
            if self._ahead and self.state.global_step + 1 < self.state.max_steps:  # not after the last step
                next_ids = tokenize_prompts(self, [row["prompt"] for row in self._ahead[0]])
                self._pending = (next_ids, sampling, self.engine.submit(next_ids, sampling))
        self._metrics["train"]["overlap/ahead"].append(ahead)
        self._log_engine_usage(out)
        return out

    def _log_engine_usage(self, out: Generation) -> None:
        """`engine_process/generate_s`: how long an engine process took for a training batch (beside the trainer
        when it was generated ahead); `engine_process/cpu_s` and `engine_process/preempted` (Generation.engine_usage)
        whether its CPU was its own meanwhile."""
        if out.engine_usage is not None and self.model.training:
            for key, value in out.engine_usage.items():
                self._metrics["train"][f"engine_process/{key}"].append(value)

    def _engine_generate(self, prompt_ids, images, multimodal_fields, logprobs: bool = True) -> Generation:
        if images is not None and any(i is not None for i in images) or multimodal_fields:
            raise ValueError("colocate-rl's generation engines take text prompts only (no images)")
        sampling = self.sampling_override or Sampling.from_args(self.args)
        self.turns += len(prompt_ids)
        return self.generate_completions(prompt_ids, sampling if logprobs else sampling.without_logprobs())

    def training_step(self, *args, **kwargs):
        with self.phase("train"):
            return super().training_step(*args, **kwargs)

    def _generate_and_score_completions(self, *args, **kwargs):
        with self.phase("prepare"):
            return super()._generate_and_score_completions(*args, **kwargs)

    def _calculate_rewards(self, *args, **kwargs):
        with self.phase("reward"):
            return super()._calculate_rewards(*args, **kwargs)

    def log(self, logs, *args, **kwargs):
        if self.log_extras is not None and "train_runtime" not in logs:
            logs = self.log_extras(self, logs)
        return super().log(logs, *args, **kwargs)


class GRPOHooks(trl_micro_batches.LengthGroupedMicroBatches, trl_old_logprobs.OldLogprobsFromLoss, _EngineHooks):
    def _generate(self, prompts):
        """One batch of episodes with the engine held awake over all its turns; each episode's tools guarded."""
        self.turns = 0
        if self.tools and self.tool_guard is not None:
            self.tool_guard.start_batch(len(prompts))
            for i, tools in enumerate(zip(self._sync_tool_dicts, self._async_tool_dicts)):
                for table in tools:
                    table.update({name: self.tool_guard.wrap(fn, i) for name, fn in table.items()})
        with self.engine.hold():
            out = super()._generate(prompts)
        if self.tools:
            import torch

            mode = "train" if self.model.training else "eval"
            counts = torch.tensor([self.turns, len(prompts)], dtype=torch.float64, device=self.accelerator.device)
            turns, episodes = self.accelerator.gather(counts).view(-1, 2).sum(dim=0).tolist()
            self._metrics[mode]["tools/turns_per_episode"].append(turns / max(episodes, 1))
        return out

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        out = self._engine_generate(prompt_ids, images, multimodal_fields)  # one completion per prompt id list
        return out.completion_ids, out.logprobs


class RLOOHooks(trl_micro_batches.LengthGroupedMicroBatches, _EngineHooks):
    trl_base = "RLOOTrainer"

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields):
        return self._engine_generate(
            prompt_ids, images, multimodal_fields, logprobs=False
        ).completion_ids  # RLOO reads none


def engine_trainer(trainer_cls: type) -> type:
    """`trainer_cls` (TRL's GRPOTrainer or RLOOTrainer, or a subclass) generating through `trainer.engine`."""
    hooks = GRPOHooks if base_of(trainer_cls) == "GRPOTrainer" else RLOOHooks
    return type(f"Colocate{trainer_cls.__name__}", (hooks, trainer_cls), {})


# ---------------------------------------------------------------------------------------------- for evaluation


def tokenize_prompts(trainer, prompts: list) -> list[list[int]]:
    """Prompt token ids as TRL's generation step makes them (chat template, tools, truncation)."""
    prompt_ids, _images, _fields = trainer._tokenize_prompts(prompts)
    return prompt_ids


def calculate_rewards(trainer, rows: list[dict], prompts: list, completions: list, completion_ids: list):
    """Every reward of every completion (rows × reward functions, NaN where a reward returned None), gathered over the
    ranks, as TRL scores them in training; what rewards log meanwhile is dropped."""
    rewards = trainer._calculate_rewards(rows, prompts, completions, completion_ids)
    trainer._pending_metrics.clear()
    trainer._pending_extra_logs.clear()
    return rewards


def run_episodes(trainer, rows: list[dict], sampling: Sampling) -> tuple[list, list[list[int]]]:
    """One episode per row (multi-turn, with the recipe's tools and environment) as TRL's training step runs them,
    at `sampling`: (completions as message lists, completion token ids). The episodes' environments stay on the
    trainer, where `calculate_rewards` reads them (an environment's own reward). Mirrors the setup that TRL's
    `_generate_and_score_completions` does before `_generate`: environments built and reset with the row, their
    observation appended to the prompt, each episode's tool table."""
    from colocate_rl.tools import environment_tools

    prompts = [row["prompt"] for row in rows]
    trainer.environments = None
    if trainer.environment_factories is not None:
        names = [row.get("environment") if trainer._multi_environment else None for row in rows]
        trainer._batch_environments = names
        trainer.environments = [trainer.environment_factories[name]() for name in names]
        for i, (environment, row) in enumerate(zip(trainer.environments, rows)):
            kwargs = {k: v for k, v in row.items() if k != "environment"} if trainer._multi_environment else row
            observation = environment.reset(**kwargs)
            if isinstance(observation, str):
                prompts[i] = prompts[i][:-1] + [{**prompts[i][-1], "content": prompts[i][-1]["content"] + observation}]
    trainer._sync_tool_dicts, trainer._async_tool_dicts = [], []
    for i in range(len(rows)):
        tools = trainer._standalone_tools + (environment_tools(trainer.environments[i]) if trainer.environments else [])
        trainer._sync_tool_dicts.append({t.__name__: t for t in tools if not inspect.iscoroutinefunction(t)})
        trainer._async_tool_dicts.append({t.__name__: t for t in tools if inspect.iscoroutinefunction(t)})
    trainer.sampling_override = sampling
    try:
        _prompt_ids, completion_ids, _mask, completions, *_ = trainer._generate(prompts)
    finally:
        trainer.sampling_override = None
    return completions, completion_ids


def drop_metrics(trainer, mode: str) -> None:
    """Forget the metrics TRL collected in `mode` ("eval": the evaluation's generation lengths)."""
    trainer._metrics[mode].clear()


def step_metric(trainer, name: str) -> list:
    """The values TRL collected for metric `name` in this training step (e.g. "completions/mean_length")."""
    return trainer._metrics.get("train", {}).get(name) or []


def log_outside_step(trainer, metrics: dict[str, float]) -> None:
    """Log `metrics` to every backend without TRL's `log`, which would merge in and clear the step's training metrics
    (relied on: TRL's trainers override transformers' `Trainer.log` for that; the base one just logs)."""
    from transformers import Trainer

    Trainer.log(trainer, metrics)


def gather_params(accelerator):
    """A context-manager factory `gather(params)` that makes ZeRO-3-sharded parameters whole on every rank (a no-op
    otherwise): TRL's `DistributedBackend(accelerator).gather_params` (trl.distributed)."""
    from trl.distributed import DistributedBackend

    backend = DistributedBackend(accelerator)
    if backend.is_fsdp:
        raise ValueError("colocate-rl's engines do not support FSDP (use distributed.deepspeed)")
    return backend.gather_params
