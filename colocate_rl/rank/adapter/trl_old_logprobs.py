"""GRPO's old log-probabilities taken from the loss's own forward (trl==1.16.0 private API; `check` verifies what it
relies on at rank start).

With the sampler's importance-sampling correction on, TRL's `_generate_and_score_completions` runs a second, no-grad
forward of the whole generation batch for `old_per_token_logps`, only to form the ratio trainer ÷ sampler. When each
generation batch is trained once, with the weights it is scored with (`num_iterations` 1 and
`gradient_accumulation_steps` a multiple of `steps_per_generation`: TRL's own condition for skipping the forward
without a sampler), those log-probabilities are the loss forward's `per_token_logps.detach()`, which TRL's
`_compute_loss` then uses as the old ones. `OldLogprobsFromLoss` skips that forward and forms the ratio and TRL's
`sampling/*` metrics inside the loss instead, as TRL forms them: one forward of the generation batch less a step.
"""

from __future__ import annotations

import inspect
import math

# TRL's metrics formed from the old log-probabilities in `_generate_and_score_completions`, re-formed in the loss
METRICS = (
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
    "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max",
)
OLD_FORWARD = "old_per_token_logps, _, _ = self._get_per_token_logps_and_entropies("
# What the skip relies on: in prepare, the old-logprob forward is the first `_get_per_token_logps_and_entropies` call and
# its result reaches the output only as these two entries and METRICS; the loss forms its forward's result first, reads
# the ratio afterwards, and uses `per_token_logps.detach()` where no old ones came with the batch.
SOURCE = {
    "_generate_and_score_completions": (
        OLD_FORWARD,
        'output["old_per_token_logps"] = old_per_token_logps',
        'output["importance_sampling_ratio"] = vllm_importance_sampling_ratio',
        *METRICS,
    ),
    "_compute_loss": (
        "per_token_logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(",
        "per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps",
        'per_token_loss * inputs["importance_sampling_ratio"]',
    ),
}


def check(trainer_cls: type) -> list[str]:
    """What moved in TRL's GRPOTrainer for the skip, one problem a line."""
    problems = []
    params = list(inspect.signature(trainer_cls._get_per_token_logps_and_entropies).parameters)[:5]
    if params != ["self", "model", "input_ids", "attention_mask", "logits_to_keep"]:
        problems.append(f"trl GRPOTrainer._get_per_token_logps_and_entropies{tuple(params)}... changed")
    for name, needles in SOURCE.items():
        source = inspect.getsource(getattr(trainer_cls, name))
        problems += [f"trl GRPOTrainer.{name} no longer has `{n}`" for n in needles if n not in source]
        if name == "_generate_and_score_completions" and OLD_FORWARD in source:
            first = source.index("self._get_per_token_logps_and_entropies(")
            if first != source.index(OLD_FORWARD) + OLD_FORWARD.index("self."):
                problems.append("trl GRPOTrainer._generate_and_score_completions: the old-logprob forward is not first")
    return problems


class OldLogprobsFromLoss:
    """GRPO trainer mixin: skips prepare's old-logprob forward where it equals the loss's (see the module)."""

    old_logprobs_from_loss = True  # where valid; False keeps TRL's own forward (tests compare the two)
    _skip_old_forward = False
    _loss_inputs = None  # the micro-batch whose loss forward is running
    _sampling_parts: tuple = ()  # (|Δ logprob|, ratios) of the generation batch's micro-batches so far

    @property
    def defers_old_logprobs(self) -> bool:
        generate_every = self.args.steps_per_generation * self.num_iterations
        return bool(
            self.old_logprobs_from_loss
            and self.use_vllm
            and self.vllm_importance_sampling_correction
            and self.args.gradient_accumulation_steps % generate_every == 0
        )

    def _generate_and_score_completions(self, *args, **kwargs):
        if not self.defers_old_logprobs:
            return super()._generate_and_score_completions(*args, **kwargs)
        metrics = self._metrics["train" if self.model.training else "eval"]
        logged = {name: len(metrics[name]) for name in METRICS}
        self._skip_old_forward = True
        try:
            output = super()._generate_and_score_completions(*args, **kwargs)
        finally:
            self._skip_old_forward = False
        for name, n in logged.items():  # formed from the placeholder: the loss logs the real ones
            del metrics[name][n:]
        del output["old_per_token_logps"], output["importance_sampling_ratio"]
        return output

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        if self._skip_old_forward:  # prepare's old-logprob forward: a placeholder, dropped from its output
            import torch

            self._skip_old_forward = False
            return torch.zeros(input_ids.size(0), logits_to_keep, device=input_ids.device), None, None
        out = super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
        )
        if self._loss_inputs is not None:
            inputs, self._loss_inputs = self._loss_inputs, None
            self._importance_sampling(inputs, out[0].detach())
        return out

    def _compute_loss(self, model, inputs):
        self._loss_inputs = inputs if self.defers_old_logprobs else None
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._loss_inputs = None

    def _importance_sampling(self, inputs: dict, logps) -> None:
        """`inputs["importance_sampling_ratio"]` from the loss forward's log-probabilities, as TRL forms it in prepare;
        the generation batch's `sampling/*` metrics logged once its last micro-batch is in."""
        import torch

        mode = self.vllm_importance_sampling_mode
        mask = (
            inputs["completion_mask"] if "tool_mask" not in inputs else inputs["completion_mask"] * inputs["tool_mask"]
        )
        sampling = inputs["sampling_per_token_logps"]
        diff = torch.nan_to_num((logps - sampling) * mask, nan=0.0)
        sequence_level = mode in ("sequence_mask", "sequence_truncate")
        ratio = torch.exp(diff.sum(dim=-1, keepdim=True) if sequence_level else diff)
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if mode in ("sequence_truncate", "token_truncate"):
            ratio = torch.clamp(ratio, min=low, max=high)
        elif mode in ("sequence_mask", "token_mask"):
            low = -math.inf if low is None else low
            high = math.inf if high is None else high
            ratio = ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
        else:
            raise ValueError(f"Unknown vLLM importance sampling level: {mode}")
        inputs["importance_sampling_ratio"] = ratio

        mask = mask.bool()
        delta = torch.abs(logps - sampling)
        part = (delta[mask & ~torch.isnan(delta)], ratio.flatten() if sequence_level else ratio[mask])
        self._sampling_parts = (*self._sampling_parts, part)
        if len(self._sampling_parts) == (self.args.steps_per_generation if self.model.training else 1):
            parts, self._sampling_parts = self._sampling_parts, ()
            self._log_sampling(torch.cat([d for d, _ in parts]), torch.cat([r for _, r in parts]))

    def _log_sampling(self, delta, ratio) -> None:
        """TRL's five `sampling/*` metrics of one generation batch (`delta`: |trainer - sampler| log-probabilities of
        its tokens; `ratio`: its importance-sampling ratios), gathered over the ranks as TRL gathers them."""
        import torch
        from trl.trainer.utils import nanmax, nanmin

        zero = torch.zeros((), device=delta.device)
        gather = self.accelerator.gather
        metrics = self._metrics["train" if self.model.training else "eval"]
        metrics[METRICS[0]].append(gather(delta.mean() if delta.numel() else zero).mean().item())
        metrics[METRICS[1]].append(gather(delta.max() if delta.numel() else zero).max().item())
        metrics[METRICS[2]].append(nanmin(gather(ratio.min() if ratio.numel() else zero)).item())
        metrics[METRICS[3]].append(gather(ratio.mean() if ratio.numel() else zero).nanmean().item())
        metrics[METRICS[4]].append(nanmax(gather(ratio.max() if ratio.numel() else zero)).item())
