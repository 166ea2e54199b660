"""Micro-batches of sequences of similar length, trained without the padding none of them needs (trl==1.16.0
private API; `check` verifies what it relies on at rank start).

TRL pads a rank's whole generation batch to its longest prompt (on the left) and its longest completion (on the
right), shuffles it and cuts it into `steps_per_generation` micro-batches, each trained at that full width.
`LengthGroupedMicroBatches` re-cuts the micro-batches TRL buffered: longest sequences first, so that each
micro-batch holds sequences of similar length, and each trimmed to the widest prompt and completion in it. Trimming
is exact: the columns cut are padding in every row of the micro-batch (masked out of attention and of the loss);
the prompt's positions start earlier, which rotary position embeddings see only as rounding. Regrouping is done
only where the step's loss does not depend on which sequences share a micro-batch (not with loss_type bnpo, an
entropy mask or bonus, a router loss, or a generation batch spread over several optimizer steps); elsewhere TRL's
micro-batches are only trimmed. Batches with entries other than text (images) are left as TRL made them.
"""

from __future__ import annotations

import inspect

PROMPT = ("prompt_ids", "prompt_mask")  # (rows, prompt width), padded on the left
# (rows, completion width), padded on the right; `advantages`/`old_logps` are (rows,) unless a subclass makes them
# per token; `importance_sampling_ratio` is (rows, 1) at sequence level
COMPLETION = (
    "completion_ids",
    "completion_mask",
    "old_per_token_logps",
    "sampling_per_token_logps",
    "ref_per_token_logps",
    "importance_sampling_ratio",
    "tool_mask",
    "advantages",
    "old_logps",
)
KNOWN = {*PROMPT, *COMPLETION, "num_items_in_batch"}
SOURCE = {
    "_prepare_inputs": (
        "self._buffered_inputs = [unsplit_pixel_values_by_grid(batch) for batch in generation_batches]",
        "inputs = self._buffered_inputs[self._step % self.args.steps_per_generation]",
    ),
    "_compute_loss": (
        "input_ids = torch.cat([prompt_ids, completion_ids], dim=1)",
        "attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)",
        "logits_to_keep = completion_ids.size(1)",
    ),
}
# Read on the built trainer: the buffer and step `_prepare_inputs` keeps, TRL's padding multiple, and what decides
# whether the loss depends on how sequences are grouped
ATTRIBUTES = {
    "GRPOTrainer": ("_buffered_inputs", "_step", "pad_to_multiple_of", "aux_loss_enabled", "loss_type",
                    "top_entropy_quantile", "_entropy_bonus_enabled"),
    "RLOOTrainer": ("_buffered_inputs", "_step", "pad_to_multiple_of", "aux_loss_enabled"),
}  # fmt: skip


def check(trainer_cls: type, base: str) -> list[str]:
    """What moved in TRL's trainer class for the re-cut micro-batches, one problem a line."""
    problems = []
    for name, needles in SOURCE.items():
        source = inspect.getsource(getattr(trainer_cls, name))
        problems += [f"trl {base}.{name} no longer has `{n}`" for n in needles if n not in source]
    return problems


def regroup(batches: list[dict], *, by_length: bool, multiple: int | None = None) -> list[dict]:
    """`batches` (TRL's micro-batches of one generation batch) re-cut longest first when `by_length`, each trimmed to
    the widest prompt and completion in it (widths rounded up to `multiple`, TRL's pad_to_multiple_of); unchanged
    when they hold anything but text."""
    import torch

    if any(set(b) - KNOWN or not all(isinstance(v, torch.Tensor) for v in b.values()) for b in batches):
        return batches
    if by_length and len(batches) > 1:
        whole = {k: v if v.ndim == 0 else torch.cat([b[k] for b in batches]) for k, v in batches[0].items()}
        order = torch.argsort(_prompt_lengths(whole) + _completion_extents(whole), descending=True, stable=True)
        size = len(order) // len(batches)
        batches = [
            {k: v if v.ndim == 0 else v[order[i * size : (i + 1) * size]] for k, v in whole.items()}
            for i in range(len(batches))
        ]
    return [_trimmed(b, multiple) for b in batches]


def _tokens(batches: list[dict]) -> int:
    """Token positions the forward passes of `batches` take (padding included)."""
    return sum(b["prompt_ids"].numel() + b["completion_ids"].numel() for b in batches)


def _prompt_lengths(batch: dict):
    return batch["prompt_mask"].sum(dim=1)


def _completion_extents(batch: dict):
    """Per row, the columns up to its last attended completion token (0 where none is)."""
    import torch

    mask = batch["completion_mask"].bool()
    columns = torch.arange(1, mask.size(1) + 1, device=mask.device)
    return (mask * columns).amax(dim=1)


def _round_up(width: int, multiple: int | None, cap: int) -> int:
    return min(cap, -(-width // multiple) * multiple) if multiple else width


def _trimmed(batch: dict, multiple: int | None) -> dict:
    prompt_width, completion_width = batch["prompt_ids"].size(1), batch["completion_ids"].size(1)
    keep_prompt = _round_up(int(_prompt_lengths(batch).max()), multiple, prompt_width)
    keep_completion = _round_up(max(int(_completion_extents(batch).max()), 1), multiple, completion_width)
    out = {}
    for key, value in batch.items():
        if key in PROMPT:
            value = value[:, prompt_width - keep_prompt :]
        elif key in COMPLETION and value.ndim == 2 and value.size(1) == completion_width:
            value = value[:, :keep_completion]
        out[key] = value
    return out


class LengthGroupedMicroBatches:
    """TRL trainer mixin: re-cuts each generation batch's micro-batches by length, trimmed (see the module)."""

    length_grouping = True  # trainer.length_grouping; False trains TRL's micro-batches as they are
    trl_base = "GRPOTrainer"  # the TRL trainer below (RLOOHooks: "RLOOTrainer")

    @property
    def groups_by_length(self) -> bool:
        """Whether the step's loss is the same however its sequences are grouped into micro-batches."""
        if self.aux_loss_enabled or self.args.gradient_accumulation_steps % self.args.steps_per_generation:
            return False
        if "loss_type" not in ATTRIBUTES[self.trl_base]:  # RLOO: a mean of per-sequence losses
            return True
        return self.loss_type != "bnpo" and self.top_entropy_quantile >= 1.0 and not self._entropy_bonus_enabled

    def _prepare_inputs(self, generation_batch):
        buffered = self._buffered_inputs
        inputs = super()._prepare_inputs(generation_batch)
        if not self.length_grouping or not self.model.training or self._buffered_inputs is buffered:
            return inputs
        trls = self._buffered_inputs
        self._buffered_inputs = regroup(trls, by_length=self.groups_by_length, multiple=self.pad_to_multiple_of)
        self._metrics["train"]["micro_batches/tokens_vs_trl"].append(_tokens(self._buffered_inputs) / _tokens(trls))
        return self._buffered_inputs[self._step % self.args.steps_per_generation]
