"""The recipe's `generation:` section: the backend, the colocated vLLM engine's options, sleep mode and overlap.

Mapped to the engine's options by `colocate_rl.plan.engine_options`; overlap and the engine process are planned in
`colocate_rl.plan.overlap`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, field_validator

from colocate_rl.recipe.values import Count, parse_size, whole


class GenerationSection(BaseModel):
    """How completions are generated."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    backend: Literal["auto", "vllm", "transformers"] = Field(
        "auto", description="auto = colocated vLLM when a GPU and vLLM are present, else transformers."
    )
    vllm_gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] | Literal["auto"] = Field(
        0.3,
        description="Share of each GPU's memory vLLM may take (weights + KV cache); auto = what one generation batch "
        "needs by the memory estimate (vLLM's weights, the batch's KV cache and an allowance) plus 5 % of the GPU, "
        "as mem-probe recommends: the trainer gets the rest (larger micro-batches; a bigger share buys vLLM "
        "nothing). Without a GPU to size it for: 0.3.",
    )
    tensor_parallel_size: Count = Field(
        1, description="vLLM tensor-parallel group size (contiguous ranks of one node; divides nproc_per_node)."
    )
    max_model_length: Count | None = Field(None, description="vLLM context length (prompt + completion).")
    engine: Literal["colocate-rl", "trl"] = Field(
        "colocate-rl",
        description="Who drives the colocated vLLM engine: colocate-rl's own cycle (engine options, sleep levels, "
        "bucketed weight sync, trainer offload, weight check) or TRL's built-in one (for comparison).",
    )
    sleep_level: Literal[0, 1, 2, "auto"] = Field(
        "auto",
        description="vLLM sleep mode while the trainer runs: 0 = off (vLLM keeps its memory), 1 = weights "
        "copied to CPU and KV cache freed, 2 = weights and KV cache freed (the trainer's weights are pushed "
        "after every wake); auto = 0 when the memory estimate has trainer and vLLM fit together with the margin "
        "`zero_stage: auto` keeps, else 2 (also when there is no GPU memory to compare with); with "
        "trainer.micro_batch_size auto, 2 instead of 0 where the step-time forecast has a larger micro-batch with "
        "vLLM asleep at least 5 % faster. The engine `trl` "
        "supports only 0 and 2.",
    )
    kv_cache_memory: PositiveInt | str | None = Field(
        None,
        description="Absolute KV-cache budget per GPU, bytes or a size such as `12GiB`, instead of sizing it "
        "from vllm_gpu_memory_utilization (engine colocate-rl).",
    )

    @field_validator("kv_cache_memory", mode="before")
    @classmethod
    def _size(cls, value):
        if value is not None:
            parse_size(value)
        return value

    _sleep_level_whole = field_validator("sleep_level", mode="before")(whole)

    enforce_eager: bool = Field(
        False,
        description="Run vLLM without CUDA graphs/torch.compile (faster start, slower decode; engine colocate-rl).",
    )
    max_num_seqs: Count | None = Field(
        None,
        description="vLLM's concurrent sequences; null = the rank's share of one generation batch "
        "(per_device_train_batch_size × tensor_parallel_size × steps per generation).",
    )
    max_num_batched_tokens: Count = Field(
        4096, description="vLLM's tokens per scheduler step (engine colocate-rl; TRL's engine fixes 4096)."
    )
    enable_prefix_caching: bool = Field(
        True,
        description="Reuse the KV cache of shared prompt prefixes (the "
        "num_generations copies of a prompt); engine colocate-rl.",
    )
    weight_sync_bucket_mb: Count = Field(
        1024,
        description="Bytes per weight-sync bucket, MiB: parameters gathered in one collective and loaded "
        "into vLLM in one call (bounds the sync's extra memory); engine colocate-rl.",
    )
    offload_trainer_during_generation: bool = Field(
        False,
        description="Move the DeepSpeed optimizer states (and fp32 master weights and gradients) to CPU "
        "while vLLM generates, so its KV cache can be larger; needs distributed.deepspeed; engine colocate-rl.",
    )
    check_weights: bool = Field(
        True,
        description="After each weight sync, compare a few of vLLM's tensors with the trainer's and stop "
        "the run if vLLM is not generating from the trainer's current weights; engine colocate-rl.",
    )
    overlap: Literal["off", "one_step", "auto"] = Field(
        "auto",
        description="one_step = generate the next step's prompts while this step trains, from weights one step old "
        "(TRL's importance-sampling correction on; engine in its own process, sleep level 0, single-turn); auto = "
        "one_step with vLLM where trainer and vLLM fit awake together (sleep level 0) and nothing rules it out "
        "(tools, TRL's engine, eager vLLM, tensor parallelism, offload, several generations a batch); off = "
        "generation and training take turns.",
    )
    mps: Literal["off", "on", "auto"] = Field(
        "auto",
        description="With overlap: run each node's ranks and engine processes under a CUDA MPS daemon colocate-rl "
        "starts for the run, so that training's and generation's kernels share the GPU at once instead of by time "
        "slices (needs nvidia-cuda-mps-control). auto = on with overlap on a model of at least 1.7B parameters "
        "(measured faster there: docs/benchmarks), off otherwise.",
    )
    engine_process: bool | Literal["auto"] = Field(
        "auto", description="Run the engine in its own process on the rank's GPU; auto = when overlap is on."
    )
    vllm_multiprocessing: bool = Field(
        False,
        description="With the engine in its own process: vLLM's engine core in a process of its own beside it "
        "(vLLM's V1 multiprocessing). Off by default: beside training it generated slower on an H200 "
        "(docs/benchmarks, invocation H).",
    )
    engine_processes: Count | Literal["auto"] = Field(
        "auto",
        description="With the engine in its own process: how many engine processes per rank share each generation "
        "batch (each with its own copy of the weights and its part of the KV cache). On a small model vLLM's "
        "loop keeps one CPU core busy while the GPU waits; more processes run more loops at once. auto = 2 for "
        "vLLM on a model of at most 0.25B parameters with the share auto and 4 CPU cores a rank, else 1.",
    )
