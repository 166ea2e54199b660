"""Held-out evaluation during training: the recipe's `eval:` section, on every rank.

`make_eval_callback(recipe)` (None when `eval.every_steps` is null) loads the held-out prompts
(`colocate_rl.prompts.load_eval_prompts`) and returns a TrainerCallback that, before the first step of a run that is
not resumed (`eval.before_training`, logged as step 0), at every `eval.every_steps`-th step end and at the last
step's end (not at a stop request's), calls `evaluate`:

- each rank takes an equal share of the prompts (the last ranks' shares padded with the last prompt, left out of
  the scores): generation and the gathers below are collectives;
- prompts tokenised as TRL's generation step does, one completion per prompt from the trainer's generation engine
  (`colocate_rl.rank.engine`: the colocated vLLM engine, its weights pushed for the current step first; or
  transformers' `generate`, ZeRO-3 parameters gathered, a training generation batch per call) at `eval.temperature`,
  0 = greedy; decoded as TRL decodes completions (a chat prompt's completion is one assistant message);
- scored by the trainer's reward functions as in training (dataset columns as keyword arguments; gathered over the
  ranks); what rewards log through `log_extra`/`log_metric` meanwhile is dropped (colocate_rl.rank.adapter.trl);
- with `tools:`, each prompt is an episode as in training (TRL's tool loop through the engine, the recipe's tools and
  environment; an environment's own reward scores it), also logged as `eval/tool_calls_per_episode` and
  `eval/turns_per_episode`;
- logged as `eval/<reward>` (mean of each reward function, named as TRL names it in `rewards/<name>/mean`),
  `eval/reward` (mean weighted sum, the recipe's weights), `eval/completion_length` and `time/eval_s` through
  transformers' `Trainer.log`, which reaches metrics.jsonl and every `report_to` backend. (TRL's own `log` would
  merge in and clear the training metrics of the step.)

The random state of torch is restored afterwards, so that sampling at a temperature above 0 leaves training's
sampling as it was. Errors of the reward functions stop the run as they do in training.
"""

from __future__ import annotations

import math
import time

import torch

from colocate_rl.prompts import load_eval_prompts
from colocate_rl.rank.adapter import trl as trl_adapter
from colocate_rl.rank.engine import Sampling
from colocate_rl.recipe.schema import Recipe

RESERVED_NAMES = (
    "reward",
    "completion_length",
    "tool_calls_per_episode",
    "turns_per_episode",
)  # eval/<name> keys of their own


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


def completions_of(rows: list[dict], texts: list[str]) -> list:
    """Completions as TRL hands them to rewards: a chat prompt's completion is one assistant message."""
    from trl.data_utils import is_conversational

    if rows and is_conversational(rows[0]):
        return [[{"role": "assistant", "content": text}] for text in texts]
    return texts


def evaluate(trainer, dataset, temperature: float) -> dict[str, float | None]:
    """Generate and score one completion per row of `dataset` on every rank together; the metrics over all rows."""
    start = time.perf_counter()
    accelerator, n = trainer.accelerator, len(dataset)
    share = math.ceil(n / accelerator.num_processes)
    first = accelerator.process_index * share
    rows = [dataset[min(i, n - 1)] for i in range(first, first + share)]
    prompts = [row["prompt"] for row in rows]
    sampling = Sampling.from_args(trainer.args).at_temperature(temperature).without_logprobs()
    episodes = bool(getattr(trainer, "tools", None))  # multi-turn: TRL's tool loop through the engine
    model, was_training = trainer.model, trainer.model.training
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        model.eval()
        try:
            if episodes:
                completions, completion_ids = trl_adapter.run_episodes(trainer, rows, sampling)
            else:
                prompt_ids = trl_adapter.tokenize_prompts(trainer, prompts)
                completion_ids = trainer.generate_completions(prompt_ids, sampling).completion_ids
        finally:
            model.train(was_training)
    if not episodes:
        texts = trainer.processing_class.batch_decode(completion_ids, skip_special_tokens=True)
        completions = completions_of(rows, texts)
    rewards = trl_adapter.calculate_rewards(trainer, rows, prompts, completions, completion_ids)[:n].float().cpu()
    lengths = accelerator.gather(torch.tensor([len(ids) for ids in completion_ids], device=accelerator.device))
    total = (rewards * trainer.reward_weights.float().cpu()).nansum(dim=1)  # as TRL sums them in training
    metrics: dict[str, float | None] = {}
    for name, column in zip(metric_names(list(trainer.reward_func_names)), rewards.T):
        scored = column[~column.isnan()]  # None: the reward did not apply to that completion
        metrics[name] = round(scored.mean().item(), 6) if len(scored) else None
    metrics["eval/reward"] = round(total.mean().item(), 6)
    metrics["eval/completion_length"] = round(lengths[:n].float().mean().item(), 3)
    if episodes:  # the episodes' own measures, over every rank's share (padding rows left out)
        guard = trainer.tool_guard
        calls = [float(c) for c in (guard.calls if guard is not None else [0] * share)]
        per_row = accelerator.gather(torch.tensor(calls, device=accelerator.device))[:n].float()
        counts = accelerator.gather(torch.tensor([float(trainer.turns)], device=accelerator.device))
        metrics["eval/tool_calls_per_episode"] = round(per_row.mean().item(), 4)
        metrics["eval/turns_per_episode"] = round(counts.sum().item() / (share * accelerator.num_processes), 4)
        trl_adapter.drop_metrics(trainer, "eval")
    metrics["time/eval_s"] = round(time.perf_counter() - start, 4)
    return metrics


def make_eval_callback(recipe: Recipe):
    """The evaluation as a TrainerCallback (its `trainer` set once the trainer exists), or None when eval is off.
    Loads the held-out prompts: UserError naming the eval key when they cannot be loaded."""
    from transformers import TrainerCallback

    ev = recipe.eval
    if ev.every_steps is None:
        return None
    dataset = load_eval_dataset(recipe)

    class EvalCallback(TrainerCallback):
        trainer = None

        def _evaluate_and_log(self, control) -> None:
            metrics = evaluate(self.trainer, dataset, ev.temperature)
            should_log = control.should_log  # on_log clears it: the step's training record is still to come
            trl_adapter.log_outside_step(self.trainer, {k: v for k, v in metrics.items() if v is not None})
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
