"""colocate-rl's colocated vLLM engine: vLLM in the rank's own process, beside the trainer, on the same GPU.

A `GenerationEngine` (colocate_rl.rank.engine). Per step, on every rank, the cycle is:

    trainer cache emptied → wake weights → push the trainer's weights (bucketed) → check them → reset the prefix
    cache → [offload trainer states] → wake KV cache → generate → sleep → [reload trainer states]

- Sleep level (`generation.sleep_level`): 0 = vLLM keeps its memory; 1 = weights copied to CPU, KV cache freed;
  2 = weights and KV cache freed (the push refills the weights anyway). Weights are never reloaded from disk after a
  wake: that would silently generate from the base model.
- Weight push: parameters are taken in buckets of at most `bucket_bytes` (sized by each parameter's full element
  count: an un-gathered ZeRO-3 parameter reports `numel() == 0`); under ZeRO-3 a bucket is gathered in one
  coalesced collective, and each bucket is loaded into vLLM in one `load_weights` call. The sync's extra memory is
  bounded by one bucket.
- Trainer offload (`offload_trainer`): DeepSpeed's `offload_states` moves the optimizer states, fp32 master
  weights and gradients to CPU while vLLM's KV cache is awake, `reload_states` brings them back after.
- Weight check (`check_weights`): after each push a few tensors of vLLM's model are compared with what the
  trainer pushed; a mismatch raises `StaleWeightsError` (the run stops).
- Sampling: vLLM returns token ids only (no text) and flat logprobs, read without a per-token dict. Under `hold`
  (the turns of multi-turn episodes) vLLM stays awake from the first generate to the block's end.

Each part of the cycle is timed as a phase (`phase`). vLLM's internals are reached through
`colocate_rl.rank.adapter.vllm` only. Importing this module does not import vLLM.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from colocate_rl.errors import StaleWeightsError
from colocate_rl.plan.engine_options import EngineOptions
from colocate_rl.rank.adapter import deepspeed as ds
from colocate_rl.rank.adapter import vllm as vl
from colocate_rl.rank.engine import Generation, GenerationEngine, Sampling
from colocate_rl.rank.weights import adapter_merge, compare_weights, expected_weights, trainer_buckets
from colocate_rl.telemetry import events


def raise_if_stale(problems: list[str]) -> None:
    """The weight check's verdict: StaleWeightsError naming each difference, or nothing."""
    if problems:
        raise StaleWeightsError(
            "vLLM is not generating from the trainer's current weights after the weight sync: "
            + "; ".join(problems)
            + ". Stopping: training on these samples would optimise a stale policy "
            "(generation.check_weights: false turns this check off)"
        )


def empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sampling_kwargs(sampling: Sampling) -> dict[str, Any]:
    """vLLM's SamplingParams for one completion per prompt: `generation_kwargs` over the sampling settings, the
    sampled token's logprob flat (lists, not a dict per token), no detokenizing (unless asked, or for `stop`)."""
    kwargs = {
        "n": 1,
        "repetition_penalty": sampling.repetition_penalty,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "min_p": 0.0 if sampling.min_p is None else sampling.min_p,
        "max_tokens": sampling.max_tokens,
        "logprobs": 0 if sampling.logprobs else None,  # the sampled token's only: the importance-sampling correction
        "flat_logprobs": True,
        **sampling.extra,
    }
    return kwargs if sampling.extra.get("stop") else {"detokenize": False, **kwargs}


def read_outputs(outputs) -> Generation:
    """Completion ids and the sampled tokens' logprobs of vLLM's request outputs (one sequence each)."""
    ids, logprobs = [], []
    for request in outputs:
        for out in request.outputs:
            ids.append(list(out.token_ids))
            if logprobs is None or out.logprobs is None:
                logprobs = None
                continue
            flat = vl.flat_logprobs(out)
            if flat is None:  # per-position dicts (generation_kwargs: {flat_logprobs: false}): the sampled token's
                flat = ([_finite(p[t].logprob) for p, t in zip(out.logprobs, out.token_ids)], None)
            logprobs.append(flat[0])
    return Generation(completion_ids=ids, logprobs=logprobs)


def _finite(value: float) -> float | None:
    return None if value != value else value  # NaN → None


class VLLMEngine(GenerationEngine):
    """vLLM in this rank's process with colocate-rl's engine options, sleep levels, bucketed weight push, trainer
    offload and weight check."""

    returns_logprobs = True

    def __init__(
        self,
        model,
        accelerator,
        options: EngineOptions,
        llm_args: dict[str, Any],
        gather: Callable,
        *,
        run_dir: Path | None = None,
        seed: int = 0,
    ):
        """`model`: the trainer's (unwrapped) model; `llm_args`: vLLM's LLM arguments the trainer's config sets
        (tensor_parallel_size, gpu_memory_utilization, max_model_len, max_num_seqs, model_impl, trust_remote_code,
        structured_outputs_regex); `gather(params)`: a context that makes ZeRO-3 parameters whole."""
        self.model, self.accelerator, self.options, self.gather = model, accelerator, options, gather
        self.llm_args, self.run_dir, self.seed = dict(llm_args), run_dir, seed
        self.tensor_parallel_size = int(self.llm_args.get("tensor_parallel_size", 1))
        self.sleep_level = int(options.sleep_level)
        self.llm = None
        self.tp_group = None
        self._asleep: set[str] = set()  # vLLM memory tags currently released
        self._weights_valid = True  # vLLM's weights equal the trainer's last push (or the checkpoint, at start)
        self._offloaded = False
        self._held = 0  # open `hold` blocks: generate keeps vLLM awake until the outermost one ends
        self.max_model_len = 2**62  # prompt + completion tokens vLLM takes: its built config's, once started
        self.last_check: list[str] = []  # parameters compared after the last push

    # ------------------------------------------------------------------ start and stop

    def llm_kwargs(self) -> dict[str, Any]:
        """Arguments of `vllm.LLM` for this rank (the trainer's config plus the recipe's engine options)."""
        o, a = self.options, self.llm_args
        kwargs = dict(
            model=self.model.name_or_path,
            tensor_parallel_size=self.tensor_parallel_size,
            gpu_memory_utilization=a.get("gpu_memory_utilization", 0.9),
            max_model_len=a.get("max_model_len"),
            max_num_seqs=o.max_num_seqs or a.get("max_num_seqs"),
            enable_sleep_mode=self.sleep_level > 0,
            model_impl=a.get("model_impl", "auto"),
            distributed_executor_backend="external_launcher",
            seed=(self.seed + self.accelerator.process_index // self.tensor_parallel_size)
            % 2**32,  # same in a TP group
            max_num_batched_tokens=o.max_num_batched_tokens,
            logprobs_mode="processed_logprobs",  # the importance-sampling correction needs processed logprobs
            trust_remote_code=a.get("trust_remote_code", False),
            enforce_eager=o.enforce_eager,
            enable_prefix_caching=o.enable_prefix_caching,
        )
        if o.kv_cache_memory_bytes:
            kwargs["kv_cache_memory_bytes"] = int(o.kv_cache_memory_bytes)
        return kwargs

    def _new_llm(self):
        from vllm import LLM

        return LLM(**self.llm_kwargs())

    def start(self) -> None:
        accelerator = self.accelerator
        if accelerator.num_processes % self.tensor_parallel_size:
            raise ValueError(
                f"tensor_parallel_size ({self.tensor_parallel_size}) must divide the world size "
                f"({accelerator.num_processes})"
            )
        if self.tensor_parallel_size > 1:
            tp = self.tensor_parallel_size
            self.tp_group, _ = torch.distributed.new_subgroups_by_enumeration(
                [list(range(i * tp, (i + 1) * tp)) for i in range(accelerator.num_processes // tp)]
            )
        os.environ["RANK"] = str(accelerator.process_index)  # vLLM's external launcher reads these
        os.environ["LOCAL_RANK"] = str(accelerator.local_process_index)
        os.environ["WORLD_SIZE"] = str(accelerator.num_processes)
        os.environ.setdefault("MASTER_ADDR", "localhost")  # torchrun sets both; a single process needs them too
        os.environ.setdefault("MASTER_PORT", "29500")
        empty_cache()  # vLLM's start-up empties torch's cache: release it first, or it counts as vLLM giving back
        free = (lambda: torch.cuda.mem_get_info()[0]) if torch.cuda.is_available() else (lambda: 0)
        free_before = free()
        self.llm = self._new_llm()
        awake = (free_before - free()) / 2**30
        asleep = None
        line = f"[colocate-rl engine] rank {accelerator.process_index}: vLLM awake {awake:.3f} GiB"
        if self.sleep_level:
            self.sleep()
            asleep = (free_before - free()) / 2**30
            line += f", asleep (level {self.sleep_level}) {asleep:.3f} GiB"
        config = vl.built_config(self.llm)
        self.max_model_len = int(config["max_model_len"])
        events.log_line(line)  # for a person reading the log; programs read the event
        events.log_line(f"[colocate-rl engine] rank {accelerator.process_index}: vLLM config {json.dumps(config)}")
        if self.run_dir is not None:
            events.emit(
                self.run_dir,
                events.ENGINE_MEMORY,
                awake_gib=round(awake, 3),
                asleep_gib=None if asleep is None else round(asleep, 3),
                sleep_level=self.sleep_level,
                config=config,
            )
        accelerator.wait_for_everyone()  # a rank still loading vLLM must not meet another's first collective

    def stop(self) -> None:
        return None  # vLLM is left to the process's exit: tearing it down after sleep mode can crash (vLLM #16993)

    # ------------------------------------------------------------------ sleep and wake

    def _wake(self, tags: list[str]) -> None:
        with self.phase("wake"):
            self.llm.wake_up(tags=tags)
        self._asleep.difference_update(tags)

    def wake(self) -> None:
        if self._asleep:
            empty_cache()
            self._wake(sorted(self._asleep))

    def sleep(self) -> None:
        if not self.sleep_level:
            return
        with self.phase("sleep"):
            self.llm.sleep(level=self.sleep_level)
        self._asleep = {"weights", "kv_cache"}
        if self.sleep_level == 2:
            self._weights_valid = False  # discarded: only a push may refill them

    # ------------------------------------------------------------------ weights

    def _push(self) -> None:
        """Load the trainer's current weights into vLLM, bucket by bucket."""
        engine_model = vl.engine_model(self.llm)
        for bucket in trainer_buckets(self.model, self.options.bucket_bytes, self.gather, self.merge):
            engine_model.load_weights(bucket)

    def push_weights(self) -> None:
        """Wake vLLM's weights, push the trainer's, check them and reset the prefix cache."""
        with self.phase("weight_sync"):
            if "weights" in self._asleep:
                empty_cache()  # hand the trainer's cached blocks to the driver before vLLM maps its weights again
                self._wake(["weights"])
            self._push()
            if self.options.check_weights:
                with self.phase("weight_check"):
                    self.check_weights()
            self._weights_valid = True
            self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights

    @functools.cached_property
    def merge(self):
        """With LoRA: the adapted model as vLLM sees it (`weights.adapter_merge`, built once); else None."""
        return adapter_merge(self.model)

    def check_weights(self) -> None:
        """Compare a few of vLLM's tensors with the trainer's current ones (`weights.expected_weights`); raise
        StaleWeightsError on any difference."""
        expected = expected_weights(self.model, self.gather, self.tensor_parallel_size, self.merge)
        self.last_check = list(expected)
        raise_if_stale(compare_weights(expected, dict(vl.engine_model(self.llm).named_parameters())))

    # ------------------------------------------------------------------ trainer offload

    def _offload_trainer(self) -> None:
        if not self.options.offload_trainer:
            return
        engine = ds.deepspeed_engine(self.accelerator)
        if engine is None or engine.optimizer is None:
            return  # before the first step DeepSpeed has not been prepared yet: nothing to offload
        with self.phase("offload"):
            ds.offload_states(engine)
            empty_cache()
        self._offloaded = True

    def _reload_trainer(self) -> None:
        if self._offloaded:
            with self.phase("reload"):
                ds.deepspeed_engine(self.accelerator).reload_states()
            self._offloaded = False

    # ------------------------------------------------------------------ generation

    def generate(self, prompt_ids: list[list[int]], sampling: Sampling) -> Generation:
        """One completion per prompt inside the cycle; under tensor parallelism the group's prompts go to vLLM
        together and each rank keeps its own share."""
        if not self._weights_valid:
            self.push_weights()  # level 2 dropped them since the last push (e.g. a second generation per step)
        elif "weights" in self._asleep:
            empty_cache()
            self._wake(["weights"])  # level 1: restored from CPU, equal to the last push
        self._offload_trainer()
        try:
            if "kv_cache" in self._asleep:
                self._wake(["kv_cache"])
            return self._generate(prompt_ids, sampling)
        finally:
            if not self._held:
                self._release()

    @contextlib.contextmanager
    def hold(self):
        self._held += 1
        try:
            yield
        finally:
            self._held -= 1
            if not self._held:
                self._release()

    def _release(self) -> None:
        if not self._asleep:  # woken by a generate (none may have run inside a hold)
            self.sleep()
        self._reload_trainer()

    def _generate(self, prompt_ids: list[list[int]], sampling: Sampling) -> Generation:
        from vllm import SamplingParams

        kwargs = sampling_kwargs(sampling)
        regex = self.llm_args.get("structured_outputs_regex")
        if regex is not None or isinstance(kwargs.get("structured_outputs"), dict):
            from vllm.sampling_params import StructuredOutputsParams

            kwargs["structured_outputs"] = (
                StructuredOutputsParams(regex=regex)
                if regex
                else StructuredOutputsParams(**kwargs["structured_outputs"])
            )
        prompts = prompt_ids
        if self.tp_group is not None:
            gathered: list = [None] * self.tensor_parallel_size
            torch.distributed.all_gather_object(gathered, prompt_ids, group=self.tp_group)
            prompts = [p for part in gathered for p in part]
        # A later turn's prompt (prompt, completion and tool results so far) may leave less room than max_tokens in
        # the context: each gets what is left (TRL cuts the episode at max_completion_length); none left, nothing.
        room = [self.max_model_len - len(ids) for ids in prompts]
        fits = [i for i, r in enumerate(room) if r > 0]
        params: Any = SamplingParams(**kwargs)
        if any(r < kwargs["max_tokens"] for r in room):
            params = [SamplingParams(**{**kwargs, "max_tokens": min(kwargs["max_tokens"], room[i])}) for i in fits]
        requests = [{"prompt_token_ids": prompts[i]} for i in fits]
        out = read_outputs(self.llm.generate(requests, sampling_params=params, use_tqdm=False)).placed(fits, len(room))
        if self.tp_group is not None:
            share = slice(
                torch.distributed.get_rank(group=self.tp_group) * len(prompt_ids),
                (torch.distributed.get_rank(group=self.tp_group) + 1) * len(prompt_ids),
            )
            out = Generation(out.completion_ids[share], out.logprobs[share] if out.logprobs is not None else None)
        return out


def from_trainer(trainer, options: EngineOptions, run_dir: Path | None, seed: int) -> VLLMEngine:
    """The engine for a TRL trainer, sized from its config's public vLLM fields."""
    from colocate_rl.rank.adapter.trl import gather_params

    args = trainer.args
    llm_args = {
        "tensor_parallel_size": args.vllm_tensor_parallel_size,
        "gpu_memory_utilization": args.vllm_gpu_memory_utilization,
        "max_model_len": args.vllm_max_model_length,
        # TRL's own sizing: a rank's generation batch (times the TP group) at once
        "max_num_seqs": args.per_device_train_batch_size * args.vllm_tensor_parallel_size * args.steps_per_generation,
        "model_impl": args.vllm_model_impl,
        "trust_remote_code": args.trust_remote_code,
        "structured_outputs_regex": args.vllm_structured_outputs_regex,
    }
    return VLLMEngine(
        trainer.model,
        trainer.accelerator,
        options,
        llm_args,
        gather_params(trainer.accelerator),
        run_dir=run_dir,
        seed=seed,
    )
