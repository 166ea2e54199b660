"""Generation engines over Hugging Face's own code: transformers' `generate` on the trainer's model (the CPU path, and
any run without vLLM) and TRL's own colocated vLLM engine (`generation.engine: trl`, kept for comparisons).

Both implement `colocate_rl.rank.engine.GenerationEngine`. Neither holds memory of its own to sleep with.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import torch

from colocate_rl.rank.engine import Generation, GenerationEngine, Sampling


def cut_at_eos(rows: torch.Tensor, eos_ids: list[int]) -> list[list[int]]:
    """Each row's tokens up to and including its first EOS (all of it when it has none)."""
    out = []
    for row in rows.tolist():
        end = next((i for i, t in enumerate(row) if t in eos_ids), len(row) - 1)
        out.append(row[: end + 1])
    return out


def generation_config(base, sampling: Sampling):
    """A copy of the trainer's transformers GenerationConfig sampling as `sampling` says (temperature 0: greedy)."""
    config = copy.deepcopy(base)
    config.max_new_tokens = sampling.max_tokens
    config.repetition_penalty = sampling.repetition_penalty
    if sampling.temperature == 0:
        changes: dict[str, Any] = dict(do_sample=False, temperature=None, top_p=None, top_k=None, min_p=None)
    else:
        changes = dict(
            do_sample=True,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            min_p=sampling.min_p,
        )
    for key, value in {**changes, **sampling.extra}.items():
        setattr(config, key, value)
    return config


class TransformersEngine(GenerationEngine):
    """transformers' `generate` on the trainer's own model (ZeRO-3 parameters gathered for it, gradient
    checkpointing off meanwhile: TRL's `unwrap_model_for_generation`). Sampled logprobs are not returned."""

    def __init__(self, wrapped_model: Callable[[], Any], accelerator, base_config, pad_token_id: int, args):
        """`wrapped_model()`: the trainer's model as prepared for training (DDP or DeepSpeed engine) at call time;
        `base_config`: the trainer's GenerationConfig (EOS ids, cache settings)."""
        self.wrapped_model, self.accelerator, self.base_config = wrapped_model, accelerator, base_config
        self.pad_token_id, self.args = pad_token_id, args
        self.max_batch = args.per_device_train_batch_size * args.steps_per_generation  # a training generation batch
        eos = base_config.eos_token_id
        self.eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)

    def generate(self, prompt_ids: list[list[int]], sampling: Sampling) -> Generation:
        from trl.models import unwrap_model_for_generation

        with unwrap_model_for_generation(
            self.wrapped_model(),
            self.accelerator,
            gather_deepspeed3_params=self.args.ds3_gather_for_generation,
            gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs,
        ) as model:
            return generate_with(
                model, prompt_ids, sampling, self.base_config, self.pad_token_id, self.eos_ids, self.accelerator.device
            )


def generate_with(model, prompt_ids, sampling: Sampling, base_config, pad_token_id: int, eos_ids, device) -> Generation:
    """One completion per prompt from transformers' `generate` on `model` (prompts left-padded with
    `pad_token_id`, each completion cut after its first EOS)."""
    width = max(len(p) for p in prompt_ids)
    ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in prompt_ids])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            generation_config=generation_config(base_config, sampling),
        )
    return Generation(completion_ids=cut_at_eos(out[:, width:].cpu(), eos_ids))


def transformers_engine(trainer) -> TransformersEngine:
    """The engine for a TRL trainer generating with transformers (its `generation_config`, tokenizer's pad id)."""
    tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
    return TransformersEngine(
        lambda: trainer.model_wrapped,
        trainer.accelerator,
        trainer.generation_config,
        tokenizer.pad_token_id,
        trainer.args,
    )


class TRLEngine(GenerationEngine):
    """TRL's own `VLLMGeneration` (built by the trainer when `generation.engine: trl`) behind the interface: its
    public `generate` and `sync_weights`, its sampling attributes set for the call."""

    returns_logprobs = True
    SETTINGS = {  # Sampling field → VLLMGeneration attribute
        "temperature": "temperature",
        "top_p": "top_p",
        "top_k": "top_k",
        "min_p": "min_p",
        "repetition_penalty": "repetition_penalty",
        "max_tokens": "max_completion_length",
    }

    def __init__(self, vllm_generation):
        self.vllm = vllm_generation

    def start(self) -> None:
        llm = getattr(self.vllm, "llm", None)  # colocate mode: time TRL's own sleep and wake of vLLM
        for attr, name in (("wake_up", "wake"), ("sleep", "sleep")):
            if llm is not None:
                setattr(llm, attr, self._timed(getattr(llm, attr), name))

    def _timed(self, fn, name: str):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            with self.phase(name):
                return fn(*args, **kwargs)

        return timed

    def push_weights(self) -> None:
        with self.phase("weight_sync"):
            self.vllm.sync_weights()

    def generate(self, prompt_ids: list[list[int]], sampling: Sampling) -> Generation:
        saved = {attr: getattr(self.vllm, attr) for attr in self.SETTINGS.values()}
        saved_kwargs = self.vllm.generation_kwargs
        for field, attr in self.SETTINGS.items():
            setattr(self.vllm, attr, getattr(sampling, field))
        self.vllm.generation_kwargs = sampling.extra
        try:
            _, ids, logprobs, _ = self.vllm.generate(prompts=prompt_ids, images=None, num_generations=1)
        finally:
            for attr, value in saved.items():
                setattr(self.vllm, attr, value)
            self.vllm.generation_kwargs = saved_kwargs
        sampled = [[lp[0] for lp in seq] for seq in logprobs] if logprobs is not None else None
        return Generation(completion_ids=[list(c) for c in ids], logprobs=sampled)
