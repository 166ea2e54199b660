"""Every use of vLLM's internals (pinned: vllm==0.26.0), each with what it relies on. Importing this module does not
import vLLM; `check` does, and lists what is missing."""

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


def check() -> list[str]:
    """What is missing in the installed vLLM for colocate-rl's engine, one problem a line (imports vLLM)."""
    import dataclasses

    problems = []
    try:
        from vllm import LLM, SamplingParams
        from vllm.logprobs import FlatLogprobs
    except ImportError as e:
        return [f"vllm: {e}"]
    for name in ("wake_up", "sleep", "reset_prefix_cache", "generate"):
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
    return problems


def check_engine(llm) -> list[str]:
    """What is missing on a started vLLM engine (the in-process model and the built config)."""
    try:
        model = engine_model(llm)
        built_config(llm)
    except AttributeError as e:
        return [f"vllm internals changed: {e}"]
    return [] if hasattr(model, "load_weights") else ["vllm's in-process model has no load_weights"]
