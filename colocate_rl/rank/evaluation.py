"""Held-out evaluation during training: the recipe's `eval:` section, on every rank.

`make_eval_callback(recipe)` (None when `eval.every_steps` is null) loads the held-out prompts
(`colocate_rl.prompts.load_eval_prompts`) and returns a TrainerCallback that, before the first step of a run that is
not resumed (`eval.before_training`, logged as step 0), at every `eval.every_steps`-th step end and at the last
step's end (not at a stop request's), calls `evaluate`:

- each rank takes an equal share of the prompts (the last ranks' shares padded with the last prompt, left out of
  the scores): generation and the gathers below are collectives;
- one completion per prompt through the trainer's own generation path, `_generate` (the colocated vLLM engine, its
  weights synced to the current step first; or transformers' `generate`, ZeRO-3 parameters gathered) at
  `eval.temperature`, 0 = greedy; the model is in eval mode, so TRL files its length metrics under "eval" (dropped);
- scored by the trainer's reward functions through `_calculate_rewards` (dataset columns as keyword arguments, as in
  training; gathered over the ranks); what rewards log through `log_extra`/`log_metric` meanwhile is dropped;
- logged as `eval/<reward>` (mean of each reward function, named as TRL names it in `rewards/<name>/mean`),
  `eval/reward` (mean weighted sum, the recipe's weights), `eval/completion_length` and `time/eval_s` through
  transformers' `Trainer.log`, which reaches metrics.jsonl and every `report_to` backend. (TRL's own `log` would
  merge in and clear the training metrics of the step.)

The random state of torch is restored afterwards, so that sampling at a temperature above 0 leaves training's
sampling as it was. Errors of the reward functions stop the run as they do in training.
"""

from __future__ import annotations

import copy
import math
import time
from contextlib import contextmanager
from typing import Any

import torch

from colocate_rl.prompts import load_eval_prompts, source_kind
from colocate_rl.recipe.schema import Recipe

RESERVED_NAMES = ("reward", "completion_length")  # eval/<name> keys of their own


def held_out_rows(recipe: Recipe) -> int:
    """Rows at the end of a local data.source file that training leaves out, because evaluation holds them out."""
    ev = recipe.eval
    if ev.every_steps is None or ev.source is not None or source_kind(recipe.data.source) != "file":
        return 0
    return ev.num_samples


def load_eval_dataset(recipe: Recipe):
    """The held-out prompts of `recipe` in TRL's format (see `load_eval_prompts`); UserError naming the eval key."""
    data, ev = recipe.data, recipe.eval
    return load_eval_prompts(
        ev.source,
        train_source=data.source,
        split=ev.split,
        subset=ev.subset if ev.subset is not None else data.subset,
        prompt_field=data.prompt_field,
        chat=data.chat,
        system_prompt=data.system_prompt,
        num_samples=ev.num_samples,
        seed=recipe.trainer.seed,
        train_num_samples=data.num_samples,
    )


def metric_names(reward_func_names: list[str]) -> list[str]:
    """`eval/<name>` keys, one per reward function: TRL's names, numbered where two share one or a name is taken."""
    return [
        f"eval/{name}" if reward_func_names.count(name) == 1 and name not in RESERVED_NAMES else f"eval/{name}_{i}"
        for i, name in enumerate(reward_func_names)
    ]


@contextmanager
def sampling_at(trainer, temperature: float):
    """The trainer's generation at `temperature` (0: greedy) for the duration: vLLM's sampling temperature, or a
    copy of transformers' generation config."""
    engine = getattr(trainer, "vllm_generation", None) if trainer.use_vllm else None
    if engine is not None:
        saved = engine.temperature
        engine.temperature = temperature  # vLLM samples greedily at temperature 0
        try:
            yield
        finally:
            engine.temperature = saved
        return
    changes: dict[str, Any] = {"temperature": temperature}
    if temperature == 0:
        changes = dict(do_sample=False, temperature=None, top_p=None, top_k=None, min_p=None)
    saved_config, saved_kwargs = trainer.generation_config, trainer.generation_kwargs
    config = copy.deepcopy(saved_config)
    for key, value in changes.items():
        setattr(config, key, value)
    trainer.generation_config, trainer.generation_kwargs = config, {**saved_kwargs, **changes}
    try:
        yield
    finally:
        trainer.generation_config, trainer.generation_kwargs = saved_config, saved_kwargs


def _generate(trainer, prompts: list) -> tuple[list, list]:
    """(completion ids, completions) of one completion per prompt, through TRL's `_generate` (GRPO returns eight
    values, RLOO three)."""
    out = trainer._generate(prompts)
    return out[1], out[3] if len(out) == 8 else out[2]


def evaluate(trainer, dataset, temperature: float) -> dict[str, float | None]:
    """Generate and score one completion per row of `dataset` on every rank together; the metrics over all rows."""
    start = time.perf_counter()
    accelerator, n = trainer.accelerator, len(dataset)
    share = math.ceil(n / accelerator.num_processes)
    first = accelerator.process_index * share
    rows = [dataset[min(i, n - 1)] for i in range(first, first + share)]
    prompts = [row["prompt"] for row in rows]
    # transformers' generate takes at most a training generation batch per call; vLLM takes all at once (each call
    # wakes it, and at sleep level 2 pushes the weights again)
    chunk = share if trainer.use_vllm else trainer.args.per_device_train_batch_size * trainer.args.steps_per_generation
    model, was_training = trainer.model, trainer.model.training
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    completion_ids, completions = [], []
    with torch.random.fork_rng(devices=devices), sampling_at(trainer, temperature):
        model.eval()
        try:
            for i in range(0, share, chunk):
                ids, texts = _generate(trainer, prompts[i : i + chunk])
                completion_ids += ids
                completions += texts
        finally:
            model.train(was_training)
            trainer._metrics["eval"].clear()
    rewards = trainer._calculate_rewards(rows, prompts, completions, completion_ids)[:n].float().cpu()
    trainer._pending_metrics.clear()
    trainer._pending_extra_logs.clear()
    lengths = accelerator.gather(torch.tensor([len(ids) for ids in completion_ids], device=accelerator.device))
    total = (rewards * trainer.reward_weights.float().cpu()).nansum(dim=1)  # as TRL sums them in training
    metrics: dict[str, float | None] = {}
    for name, column in zip(metric_names(list(trainer.reward_func_names)), rewards.T):
        scored = column[~column.isnan()]  # None: the reward did not apply to that completion
        metrics[name] = round(scored.mean().item(), 6) if len(scored) else None
    metrics["eval/reward"] = round(total.mean().item(), 6)
    metrics["eval/completion_length"] = round(lengths[:n].float().mean().item(), 3)
    metrics["time/eval_s"] = round(time.perf_counter() - start, 4)
    return metrics


def make_eval_callback(recipe: Recipe):
    """The evaluation as a TrainerCallback (its `trainer` set once the trainer exists), or None when eval is off.
    Loads the held-out prompts: UserError naming the eval key when they cannot be loaded."""
    from transformers import Trainer, TrainerCallback

    ev = recipe.eval
    if ev.every_steps is None:
        return None
    dataset = load_eval_dataset(recipe)

    class EvalCallback(TrainerCallback):
        trainer = None

        def _evaluate_and_log(self, control) -> None:
            metrics = evaluate(self.trainer, dataset, ev.temperature)
            should_log = control.should_log  # on_log clears it: the step's training record is still to come
            Trainer.log(self.trainer, {k: v for k, v in metrics.items() if v is not None})
            control.should_log = self.trainer.control.should_log = should_log

        def on_train_begin(self, args, state, control, **kwargs):
            if ev.before_training and state.global_step == 0:  # a resumed run starts past step 0
                self._evaluate_and_log(control)

        def on_step_end(self, args, state, control, **kwargs):
            step, last = state.global_step, state.global_step >= state.max_steps
            if (control.should_training_stop and not last) or (step % ev.every_steps and not last):
                return  # a stop request ends the run quickly; no evaluation due
            self._evaluate_and_log(control)

    return EvalCallback()
