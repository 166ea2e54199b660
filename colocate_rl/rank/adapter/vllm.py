"""Every use of vLLM's internals (pinned: vllm==0.26.0), each with what it relies on, and of the torch IPC that the
engine process's staging buffer relies on. Importing this module does not import vLLM; `check` does, and lists what
is missing."""

from __future__ import annotations

from typing import Any


def engine_model(llm):
    """The torch module vLLM generates with, in this process (relied on: the V1 engine with
    VLLM_ENABLE_V1_MULTIPROCESSING=0 and the external launcher keeps one driver worker in-process, its model runner
    holding `model`; `load_weights` and `named_parameters` on it)."""
    return llm.llm_engine.model_executor.driver_worker.model_runner.model


def built_config(llm) -> dict[str, Any]:
    """The engine settings as vLLM built them (relied on: `llm_engine.vllm_config` and its sub-configs' fields)."""
    cfg = llm.llm_engine.vllm_config
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


def flat_logprobs(output) -> tuple[list[float | None], list[int]] | None:
    """(logprob per position, token id per position) of one sampled sequence from vLLM's flat logprobs, or None when
    they are not flat with one entry per position (relied on: `SamplingParams(flat_logprobs=True)` makes
    `CompletionOutput.logprobs` a `vllm.logprobs.FlatLogprobs` whose `logprobs`/`token_ids` lists hold one entry per
    position when only the sampled token is asked for, `logprobs=0`)."""
    flat = output.logprobs
    values = getattr(flat, "logprobs", None)
    if not isinstance(values, list) or len(values) != len(flat):
        return None
    return [None if v != v else v for v in values], list(flat.token_ids)  # v != v: NaN


WORKER_EXTENSION = "colocate_rl.rank.adapter.vllm.StagedWeightsWorker"


class StagedWeightsWorker:
    """Methods vLLM's GPU worker gains (`LLM(worker_extension_cls=WORKER_EXTENSION)`) where its engine core runs in a
    process of its own: they load and compare weights from the rank's staging buffer there, called by
    `LLM.collective_rpc` (relied on: the worker's `model_runner.model` with `load_weights` and `named_parameters`)."""

    def colocate_rl_stage(self, handle: bytes) -> list[str]:
        """Open the staging buffer (`weights.shared_handle`); what is missing on this worker, one problem a line."""
        import torch

        from colocate_rl.rank.weights import open_shared

        self.colocate_rl_buffer = open_shared(handle, torch.cuda.current_device())
        model = getattr(getattr(self, "model_runner", None), "model", None)
        missing = [name for name in ("load_weights", "named_parameters") if not hasattr(model, name)]
        return [f"vllm's worker has no model_runner.model.{name}" for name in missing]

    def colocate_rl_load(self, specs) -> None:
        import torch

        from colocate_rl.rank.weights import staged

        self.model_runner.model.load_weights(staged(self.colocate_rl_buffer, specs))
        if self.colocate_rl_buffer.is_cuda:
            torch.cuda.synchronize()  # the rank overwrites the buffer once this answer arrives

    def colocate_rl_compare(self, specs) -> list[str]:
        from colocate_rl.rank.weights import compare_weights, staged

        own = dict(self.model_runner.model.named_parameters())
        return compare_weights(dict(staged(self.colocate_rl_buffer, specs)), own)


def check() -> list[str]:
    """What is missing in the installed vLLM for colocate-rl's engine, one problem a line (imports vLLM)."""
    import dataclasses

    problems = []
    try:
        from vllm import LLM, SamplingParams
        from vllm.logprobs import FlatLogprobs
    except ImportError as e:
        return [f"vllm: {e}"]
    for name in ("wake_up", "sleep", "reset_prefix_cache", "generate", "collective_rpc"):
        if not hasattr(LLM, name):
            problems.append(f"vllm LLM.{name} is missing")
    fields = {f.name for f in dataclasses.fields(SamplingParams)} if dataclasses.is_dataclass(SamplingParams) else None
    if fields is None:
        fields = set(getattr(SamplingParams, "__struct_fields__", ()) or getattr(SamplingParams, "__annotations__", ()))
    for name in ("flat_logprobs", "detokenize", "logprobs"):
        if name not in fields:
            problems.append(f"vllm SamplingParams.{name} is missing")
    for name in ("logprobs", "token_ids"):
        if name not in getattr(FlatLogprobs, "__dataclass_fields__", {}) and not hasattr(FlatLogprobs, name):
            problems.append(f"vllm FlatLogprobs.{name} is missing")
    return problems + check_sharing()


def check_sharing() -> list[str]:
    """What `weights.open_shared` relies on in torch (the engine process's staging buffer), one problem a line."""
    import inspect

    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    params = list(inspect.signature(rebuild_cuda_tensor).parameters)
    if params[6:7] != ["storage_device"]:
        return [f"torch's rebuild_cuda_tensor no longer takes storage_device 7th (it takes {params})"]
    return []


def check_engine(llm) -> list[str]:
    """What is missing on a started vLLM engine (the in-process model and the built config)."""
    try:
        model = engine_model(llm)
        built_config(llm)
    except AttributeError as e:
        return [f"vllm internals changed: {e}"]
    return [] if hasattr(model, "load_weights") else ["vllm's in-process model has no load_weights"]
