"""colocate-rl's colocated vLLM engine: TRL 1.16's `VLLMGeneration` with the engine's lifecycle owned here.

`install(options)` makes TRL's GRPO and RLOO trainers build `ColocatedEngine` instead of TRL's class (trl is
pinned exactly: this relies on its internals). Per step, on every rank, the cycle is:

    trainer cache emptied → wake weights → push the trainer's weights (bucketed) → check them → reset the prefix
    cache → [offload trainer states] → wake KV cache → generate → sleep → [reload trainer states]

- Sleep level (`generation.sleep_level`): 0 = vLLM keeps its memory; 1 = weights copied to CPU, KV cache freed;
  2 = weights and KV cache freed (default: cheapest to sleep and wake; the push refills the weights anyway).
  Weights are never reloaded from disk after a wake: that would silently generate from the base model.
- Weight push: parameters are taken in buckets of at most `bucket_bytes` (sized by each parameter's full element
  count: an un-gathered ZeRO-3 parameter reports `numel() == 0`); under ZeRO-3 a bucket is gathered in one
  coalesced collective, and each bucket is loaded into vLLM in one `load_weights` call. The sync's extra memory is
  bounded by one bucket.
- Trainer offload (`offload_trainer`): DeepSpeed's `offload_states` moves the optimizer states, fp32 master
  weights and gradients to CPU while vLLM's KV cache is awake, `reload_states` brings them back after.
- Weight check (`check_weights`): after each push a few tensors of vLLM's model are compared with what the
  trainer pushed; a mismatch raises `StaleWeightsError` (the run stops).
- Sampling: vLLM returns token ids only (no text) and flat logprobs, which `extract_logprobs` hands to TRL without
  a per-token dict; `install` puts it in place of TRL's.

Every step of the cycle is a method (`_wake`, `_sleep`, `sync_weights`, `_offload_trainer`, `_reload_trainer`)
that `colocate_rl.rank.telemetry` times as a phase. Importing this module needs TRL but not vLLM.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from trl.generation.vllm_generation import VLLMGeneration, empty_cache
from trl.generation.vllm_generation import extract_logprobs as trl_extract_logprobs

from colocate_rl.errors import StaleWeightsError
from colocate_rl.plan.engine_options import EngineOptions
from colocate_rl.telemetry import events

# The trainer states moved out of the GPU during generation. Not the bf16 parameters: ZeRO-3 needs them for the
# push and the trainer for the log-probabilities right after generation, and vLLM has its own copy.
OFFLOADED_STATES = ("optim_states", "hp_params", "lp_grads", "contiguous_grad_buffer")


def full_numel(param: torch.Tensor) -> int:
    """Elements of the whole parameter, also when ZeRO-3 holds only a shard (`ds_numel`)."""
    return int(getattr(param, "ds_numel", param.numel()))


def weight_buckets(
    named_params: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of parameters of at most `bucket_bytes` each (a larger parameter gets its own group)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, param in named_params:
        nbytes = full_numel(param) * param.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, param))
        size += nbytes
    if bucket:
        yield bucket


def check_names(names: list[str], tensor_parallel_size: int) -> list[str]:
    """Parameters compared after each push: the final norm and the first and last layers' input norms (replicated
    under tensor parallelism), plus the last layer's MLP down projection when vLLM does not shard it."""
    layers = sorted(
        {int(n.split(".")[2]) for n in names if n.startswith("model.layers.") and n.split(".")[2].isdigit()}
    )
    wanted = ["model.norm.weight"]
    if layers:
        wanted += [
            f"model.layers.{layers[0]}.input_layernorm.weight",
            f"model.layers.{layers[-1]}.input_layernorm.weight",
        ]
        if tensor_parallel_size == 1:
            wanted.append(f"model.layers.{layers[-1]}.mlp.down_proj.weight")
    present = set(names)
    return [n for n in wanted if n in present]


def compare_weights(pushed: dict[str, torch.Tensor], engine_params: dict[str, torch.Tensor]) -> list[str]:
    """Problems found comparing pushed tensors with the engine's (missing or different), as text."""
    problems = []
    for name, expected in pushed.items():
        actual = engine_params.get(name)
        if actual is None:
            problems.append(f"{name} not found in vLLM's model")
            continue
        expected = expected.to(device=actual.device, dtype=actual.dtype)
        if actual.shape != expected.shape:
            problems.append(f"{name} has shape {tuple(actual.shape)} in vLLM, {tuple(expected.shape)} in the trainer")
        elif not torch.equal(actual, expected):
            diff = (actual.float() - expected.float()).abs().max().item()
            problems.append(f"{name} differs (max abs difference {diff:.3g})")
    return problems


def sampling_kwargs(user: dict[str, Any]) -> dict[str, Any]:
    """The SamplingParams the recipe's `generation_kwargs` ask for, with vLLM's logprobs flat (a few lists per
    sequence instead of a dict and an object per token: `extract_logprobs` reads them without a loop over tokens)
    and its detokenization off (TRL's colocated path reads only token ids and decodes them itself). Detokenization
    stays on when the recipe asks for it or for stop strings (vLLM refuses `stop` without it)."""
    kwargs = {"flat_logprobs": True, **user}
    return kwargs if user.get("stop") else {"detokenize": False, **kwargs}


def extract_logprobs(all_outputs) -> tuple[list | None, list | None]:
    """TRL's `extract_logprobs` (per sequence, per token: [logprob] with NaN as None, [token id]), read straight
    from vLLM's flat lists when every position holds one entry (the sampled token, TRL's `logprobs=0`); other
    outputs (nested dicts, top-k entries) go to TRL's function, whose result this equals."""
    logprobs, token_ids = [], []
    for request in all_outputs:
        for output in request.outputs:
            flat = output.logprobs
            if flat is None:
                return None, None
            values = getattr(flat, "logprobs", None)
            if not isinstance(values, list) or len(values) != len(flat):
                return trl_extract_logprobs(all_outputs)
            logprobs.append([[None if v != v else v] for v in values])  # v != v: NaN
            token_ids.append([[t] for t in flat.token_ids])
    return logprobs, token_ids


class ColocatedEngine(VLLMGeneration):
    """TRL's colocated generation backend with colocate-rl's engine options, sleep levels, bucketed weight push,
    trainer offload and weight check. Server mode falls through to TRL unchanged."""

    options: EngineOptions  # set by install()
    run_dir: Path | None = None  # where start-up memory is reported (events.jsonl); set by install()
    seed: int = 0  # trainer.seed: two runs that differ only in it sample differently; set by install()

    def __init__(self, *args: Any, **kwargs: Any):
        self._reset_cycle_state()
        if self.options.max_num_seqs:
            kwargs["max_num_seqs"] = self.options.max_num_seqs
        # TRL's own wake/sleep calls stay off: this class sleeps and wakes the engine itself.
        kwargs["enable_sleep_mode"] = False
        super().__init__(*args, **kwargs)
        if self.mode == "colocate":
            self.generation_kwargs = sampling_kwargs(self.generation_kwargs)

    def _reset_cycle_state(self) -> None:
        """The cycle's own state before vLLM starts: awake, weights valid, nothing offloaded or checked."""
        self.sleep_level = int(self.options.sleep_level)
        self._asleep: set[str] = set()  # vLLM memory tags currently released
        self._weights_valid = True  # vLLM's weights equal the trainer's last push (or the checkpoint, at start)
        self._offloaded = False
        self._merge = None  # LoRA: the adapted model as vLLM sees it (colocate_rl.rank.lora.AdapterMerge)
        self.last_check: list[str] = []  # parameters compared after the last push

    # ------------------------------------------------------------------ engine start

    def llm_kwargs(self) -> dict[str, Any]:
        """Arguments of `vllm.LLM` for this rank (TRL's fixed ones plus the recipe's engine options)."""
        o, accelerator = self.options, self.accelerator
        kwargs = dict(
            model=self.model.name_or_path,
            tensor_parallel_size=self.tensor_parallel_size,
            gpu_memory_utilization=self.gpu_memory_utilization,
            max_model_len=self.max_model_length,
            max_num_seqs=self.max_num_seqs,
            enable_sleep_mode=self.sleep_level > 0,
            model_impl=self.model_impl,
            distributed_executor_backend="external_launcher",
            seed=(self.seed + accelerator.process_index // self.tensor_parallel_size) % 2**32,  # same in a TP group
            max_num_batched_tokens=o.max_num_batched_tokens,
            logprobs_mode="processed_logprobs",  # the importance-sampling correction needs processed logprobs
            trust_remote_code=self.trust_remote_code,
            enforce_eager=o.enforce_eager,
            enable_prefix_caching=o.enable_prefix_caching,
        )
        if o.kv_cache_memory_bytes:
            kwargs["kv_cache_memory_bytes"] = int(o.kv_cache_memory_bytes)
        return kwargs

    def _init_vllm(self) -> None:
        if self.mode != "colocate":
            return super()._init_vllm()
        from trl.trainer.utils import ensure_master_addr_port
        from vllm import LLM

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
        ensure_master_addr_port()
        empty_cache()  # vLLM's start-up empties torch's cache: release it first, or it counts as vLLM giving back
        free_before, _ = torch.cuda.mem_get_info()
        self.llm = LLM(**self.llm_kwargs())
        awake = (free_before - torch.cuda.mem_get_info()[0]) / 2**30
        asleep = None
        line = f"[colocate-rl engine] rank {accelerator.process_index}: vLLM awake {awake:.3f} GiB"
        if self.sleep_level:
            self._sleep()
            asleep = (free_before - torch.cuda.mem_get_info()[0]) / 2**30
            line += f", asleep (level {self.sleep_level}) {asleep:.3f} GiB"
        config = self.built_config()
        print(line, flush=True)  # for a person reading the log; programs read the event
        print(f"[colocate-rl engine] rank {accelerator.process_index}: vLLM config {json.dumps(config)}", flush=True)
        if self.run_dir is not None:
            events.emit(
                self.run_dir,
                events.ENGINE_MEMORY,
                awake_gib=round(awake, 3),
                asleep_gib=None if asleep is None else round(asleep, 3),
                sleep_level=self.sleep_level,
                config=config,
            )
        accelerator.wait_for_everyone()

    def built_config(self) -> dict[str, Any]:
        """The engine settings as vLLM built them (read back from its config, not from what was asked)."""
        cfg = self.llm.llm_engine.vllm_config
        model, cache, sched = cfg.model_config, cfg.cache_config, cfg.scheduler_config
        return {
            "enforce_eager": model.enforce_eager,
            "enable_sleep_mode": model.enable_sleep_mode,
            "max_model_len": model.max_model_len,
            "enable_prefix_caching": cache.enable_prefix_caching,
            "gpu_memory_utilization": cache.gpu_memory_utilization,
            "kv_cache_memory_bytes": cache.kv_cache_memory_bytes,
            "max_num_seqs": sched.max_num_seqs,
            "max_num_batched_tokens": sched.max_num_batched_tokens,
        }

    # ------------------------------------------------------------------ the cycle

    def _wake(self, tags: list[str]) -> None:
        self.llm.wake_up(tags=tags)
        self._asleep.difference_update(tags)

    def _sleep(self) -> None:
        self.llm.sleep(level=self.sleep_level)
        self._asleep = {"weights", "kv_cache"}
        if self.sleep_level == 2:
            self._weights_valid = False  # discarded: only a push may refill them

    def _engine_model(self):
        return self.llm.llm_engine.model_executor.driver_worker.model_runner.model

    def _named_params_for_push(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(vLLM name, parameter) of the trainer's model, not gathered."""
        for name, param in self.model.named_parameters():
            yield self._fix_param_name_to_vllm(name), param

    def _push_weights(self) -> None:
        """Load the trainer's current weights into vLLM, bucket by bucket."""
        from accelerate.utils import is_peft_model

        engine_model = self._engine_model()
        if is_peft_model(self.model):  # base + adapter, merged out of place bucket by bucket
            merge = self._adapter_merge()
            for bucket in weight_buckets(merge.named_params(), self.options.bucket_bytes):
                params = [p for _, p in bucket]
                with self._dist.gather_params(params + merge.adapter_params(params)):
                    engine_model.load_weights([(name, merge.value(p)) for name, p in bucket])
            return
        if self._dist.is_fsdp:  # TRL's iterator; loads stay bucketed
            for bucket in weight_buckets(self._iter_named_params(), self.options.bucket_bytes):
                engine_model.load_weights(bucket)
            return
        for bucket in weight_buckets(self._named_params_for_push(), self.options.bucket_bytes):
            with self._dist.gather_params([p for _, p in bucket]):
                engine_model.load_weights([(name, p.data) for name, p in bucket])

    def sync_weights(self) -> None:
        """Wake vLLM's weights, push the trainer's, check them and reset the prefix cache."""
        if self.mode != "colocate":
            return super().sync_weights()
        if "weights" in self._asleep:
            empty_cache()  # hand the trainer's cached blocks to the driver before vLLM maps its weights again
            self._wake(["weights"])
        self._push_weights()
        if self.options.check_weights:
            self.check_weights()
        self._weights_valid = True
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights

    def _adapter_merge(self):
        from colocate_rl.rank.lora import AdapterMerge

        if self._merge is None:
            self._merge = AdapterMerge(self.model, self._fix_param_name_to_vllm)
        return self._merge

    def check_weights(self) -> None:
        """Compare a few of vLLM's tensors with the trainer's current ones (gathered under ZeRO-3, independently
        of the push; with LoRA also the last layer's adapted weights, merged again); raise StaleWeightsError on any
        difference. FSDP models are not checked."""
        from accelerate.utils import is_peft_model

        if self._dist.is_fsdp:
            return
        peft = is_peft_model(self.model)
        params = dict(self._adapter_merge().named_params() if peft else self._named_params_for_push())
        names = check_names(list(params), self.tensor_parallel_size)
        with self._dist.gather_params([params[n] for n in names]):
            trainer = {n: params[n].data.detach().clone() for n in names}
        if peft:
            from colocate_rl.rank.lora import expected_tensors

            merge = self._adapter_merge()
            trainer.update(
                expected_tensors(merge, merge.check_targets(self.tensor_parallel_size), self._dist.gather_params)
            )
        self.last_check = list(trainer)
        problems = compare_weights(trainer, dict(self._engine_model().named_parameters()))
        if problems:
            raise StaleWeightsError(
                "vLLM is not generating from the trainer's current weights after the weight sync: "
                + "; ".join(problems)
                + ". Stopping: training on these samples would optimise a stale policy "
                "(generation.check_weights: false turns this check off)"
            )

    def _deepspeed_engine(self):
        engine = getattr(self.accelerator, "deepspeed_engine_wrapped", None)
        return getattr(engine, "engine", None)

    def _offload_trainer(self) -> None:
        if not self.options.offload_trainer:
            return
        engine = self._deepspeed_engine()
        if engine is None or engine.optimizer is None:
            return  # before the first step DeepSpeed has not been prepared yet: nothing to offload
        from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum

        engine.offload_states(include=[OffloadStateTypeEnum(s) for s in OFFLOADED_STATES])
        empty_cache()
        self._offloaded = True

    def _reload_trainer(self) -> None:
        if self._offloaded:
            self._deepspeed_engine().reload_states()
            self._offloaded = False

    def generate(self, prompts, images, num_generations, profiler=None):
        """One generation inside the cycle; TRL's `generate` does the batching, TP slicing and logprobs."""
        if self.mode != "colocate":
            return super().generate(prompts, images, num_generations, profiler)
        if not self._weights_valid:
            self.sync_weights()  # level 2 dropped them since the last push (e.g. a second generation per step)
        elif "weights" in self._asleep:
            empty_cache()
            self._wake(["weights"])  # level 1: restored from CPU, equal to the last push
        self._offload_trainer()
        try:
            if "kv_cache" in self._asleep:
                self._wake(["kv_cache"])
            return super().generate(prompts, images, num_generations, profiler)
        finally:
            if self.sleep_level:
                self._sleep()
            self._reload_trainer()


def install(options: EngineOptions, run_dir: Path | None = None, seed: int = 0) -> type[ColocatedEngine]:
    """Make TRL's GRPO and RLOO trainers construct a ColocatedEngine configured with `options` (and TRL's generate
    read logprobs with `extract_logprobs`); vLLM samples from `seed` (the run's `trainer.seed`) plus the
    tensor-parallel group's index."""
    import trl.generation.vllm_generation as trl_vllm
    import trl.trainer.grpo_trainer as grpo
    import trl.trainer.rloo_trainer as rloo

    engine = type("ColocatedEngine", (ColocatedEngine,), {"options": options, "run_dir": run_dir, "seed": seed})
    grpo.VLLMGeneration = engine
    rloo.VLLMGeneration = engine
    trl_vllm.extract_logprobs = extract_logprobs  # what TRL's generate calls on vLLM's outputs
    return engine
