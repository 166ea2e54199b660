"""Cross-field validation: the recipe against the host it will run on, over what the pre-flight read.

`bind_to_host` decides everything that depends on the machine (ranks per node, generation backend, device,
precision, the DeepSpeed JSON) and checks what needs the planned world size. It reads no file the recipe names and
runs no user code: what those said comes in the pre-flight's result (`colocate_rl.plan.preflight`), whose problems it
raises together with its own in one UserError. (It reads the DeepSpeed JSON the recipe names and checks
`trainer.extra_args` against TRL's field types.)
"""

from __future__ import annotations

from typing import Any

from colocate_rl.errors import UserError
from colocate_rl.plan.deepspeed import AUTO_BASE_CONFIG, ZeroLayout, build_deepspeed_config
from colocate_rl.plan.engine_options import ENGINE_ONLY_KEYS
from colocate_rl.plan.evaluation import check_eval_schedule
from colocate_rl.plan.host import Host
from colocate_rl.plan.overlap import check_overlap, engine_in_process
from colocate_rl.plan.preflight import Preflight
from colocate_rl.plan.resolved import Resolved
from colocate_rl.plan.tools import check_tool_layout
from colocate_rl.plan.trl_args import check_extra_args
from colocate_rl.recipe.schema import Recipe

# Ranks per node on a machine without GPU: at most its CPU cores, but never fewer than a GPU node's ranks, so that a
# GPU recipe (8 ranks per node) still validates and dry-runs on a small CPU machine such as CI's.
MIN_CPU_RANK_LIMIT = 8


def check_engine(recipe: Recipe, deepspeed: dict[str, Any] | None) -> list[str]:
    """Settings of colocate-rl's vLLM engine that the chosen engine or trainer layout cannot honour."""
    gen, problems = recipe.generation, []
    if gen.engine == "trl":
        if gen.sleep_level == 1:
            problems.append(
                "generation.sleep_level: 1 is not supported by generation.engine: trl (TRL sleeps at "
                "level 2 only); use 0 or 2, or generation.engine: colocate-rl"
            )
        defaults = type(gen).model_fields
        for key in ENGINE_ONLY_KEYS:
            if getattr(gen, key) != defaults[key].default:
                problems.append(
                    f"generation.{key}: only applies to generation.engine: colocate-rl (TRL's engine has "
                    "fixed settings); remove it or set generation.engine: colocate-rl"
                )
    if gen.offload_trainer_during_generation:
        zero = ZeroLayout.of(deepspeed)
        if deepspeed is None or zero.stage == 0:
            problems.append(
                "generation.offload_trainer_during_generation: needs DeepSpeed ZeRO stage 1-3 (DeepSpeed's "
                "offload_states); set distributed.deepspeed: zero3 (and distributed.zero_stage) or turn it off"
            )
        elif zero.offload_optimizer:
            problems.append(
                "generation.offload_trainer_during_generation: the optimizer states already live on CPU "
                "(distributed.offload_optimizer); turn one of them off"
            )
        elif zero.stage == 3 and "optimizer" not in deepspeed:
            problems.append(
                "generation.offload_trainer_during_generation: under ZeRO-3 DeepSpeed 0.19 offloads only its "
                "own FusedAdam's states; add an optimizer block (distributed.deepspeed_overrides: "
                "{optimizer: {type: AdamW, params: {lr: auto, betas: auto, eps: auto, weight_decay: auto}}}) "
                "or use distributed.zero_stage: 2"
            )
    return problems


def _ranks(recipe: Recipe, host: Host) -> tuple[int, list[str]]:
    dist = recipe.distributed
    if dist.nproc_per_node == "auto":
        return (host.gpu_count if host.gpu_count else 2), []
    nproc = dist.nproc_per_node
    if host.gpu_count and nproc > host.gpu_count:
        return nproc, [
            f"distributed.nproc_per_node: {nproc} ranks but this machine has {host.gpu_count} GPU(s); "
            "use auto or at most the GPU count"
        ]
    limit = max(host.cpu_count, MIN_CPU_RANK_LIMIT)
    if not host.gpu_count and nproc > limit:
        where = "the planned machine" if host.assumed else "this machine"
        return nproc, [
            f"distributed.nproc_per_node: {nproc} ranks, each a process on a CPU core, but {where} has no GPU "
            f"and {host.cpu_count} CPU core(s); use at most {limit} (auto = 2), or plan for GPUs with --gpus N"
        ]
    return nproc, []


def _backend(recipe: Recipe, host: Host) -> tuple[str, list[str]]:
    backend, has_gpu = recipe.generation.backend, host.gpu_count > 0
    if backend == "auto":
        return ("vllm" if has_gpu and host.has_vllm else "transformers"), []
    if backend == "vllm" and not host.has_vllm:
        return backend, [
            "generation.backend: 'vllm' but vLLM is not installed here; install the GPU extra "
            "(pip install 'colocate-rl[gpu]') or set generation.backend: transformers (or auto)"
        ]
    if backend == "vllm" and not has_gpu:
        return backend, [
            "generation.backend: 'vllm' needs a CUDA GPU and none was found; "
            "set generation.backend: auto to generate with transformers on CPU"
        ]
    return backend, []


def _precision(recipe: Recipe, host: Host) -> tuple[str, str, list[str]]:
    """(trainer precision, model dtype, problems)."""
    precision, problems = recipe.distributed.mixed_precision, []
    if precision == "auto":
        precision = "bf16" if host.gpu_count else "no"
    elif precision == "fp16" and not host.gpu_count:
        problems.append("distributed.mixed_precision: fp16 needs a GPU; use auto or no on CPU")
    model_dtype = recipe.model.dtype
    if model_dtype == "auto":
        model_dtype = {"bf16": "bfloat16", "fp16": "float16"}.get(precision, "float32")
    return precision, model_dtype, problems


def _check_batch(recipe: Recipe, nproc: int) -> list[str]:
    """Tensor-parallel groups, generation batch vs num_generations and engine processes, context length."""
    dist, gen, trainer, problems = recipe.distributed, recipe.generation, recipe.trainer, []
    if nproc % gen.tensor_parallel_size:
        problems.append(
            f"generation.tensor_parallel_size: {gen.tensor_parallel_size} does not divide "
            f"distributed.nproc_per_node ({nproc}); tensor-parallel groups must stay inside one node"
        )
    world = dist.nnodes * nproc
    extra = trainer.extra_args
    if "generation_batch_size" in extra:
        generation_batch = extra["generation_batch_size"]
    else:
        steps = extra.get("steps_per_generation", trainer.gradient_accumulation_steps)
        generation_batch = trainer.per_device_train_batch_size * world * steps
    if isinstance(generation_batch, int) and generation_batch % trainer.num_generations:
        problems.append(
            f"trainer.num_generations: the generation batch ({generation_batch} = per_device_train_batch_size "
            f"{trainer.per_device_train_batch_size} × {world} ranks × steps per generation) is not divisible by "
            f"num_generations ({trainer.num_generations}); change one of them"
        )
    copies = gen.engine_processes
    if isinstance(copies, int) and isinstance(generation_batch, int) and engine_in_process(recipe):
        if copies > (per_rank := generation_batch // world):
            problems.append(
                f"generation.engine_processes: {copies} is more than the completions a rank generates at once "
                f"({per_rank}: the generation batch {generation_batch} over {world} ranks), so some would only hold "
                f"memory; set at most {per_rank}"
            )
    if gen.max_model_length is not None and gen.max_model_length <= trainer.max_completion_length:
        problems.append(
            f"generation.max_model_length: {gen.max_model_length} leaves no room for the prompt; "
            f"make it larger than trainer.max_completion_length ({trainer.max_completion_length})"
        )
    return problems


def _check_nodes(recipe: Recipe) -> list[str]:
    dist, problems = recipe.distributed, []
    if dist.nnodes > 1 and not dist.rdzv_endpoint:
        problems.append("distributed.rdzv_endpoint: required when nnodes > 1; set it to host:port of node 0")
    if dist.rdzv_endpoint is not None:
        rdzv_host, _, port = dist.rdzv_endpoint.rpartition(":")
        if not rdzv_host or not port.isdigit() or not 0 < int(port) < 65536:
            problems.append(
                f"distributed.rdzv_endpoint: '{dist.rdzv_endpoint}' must be host:port with a port "
                "number, e.g. node0:29500"
            )
    if dist.node_rank >= dist.nnodes:
        problems.append(f"distributed.node_rank: {dist.node_rank} must be below nnodes ({dist.nnodes})")
    return problems


def _deepspeed(recipe: Recipe, precision: str) -> tuple[dict[str, Any] | None, list[str]]:
    """The run's DeepSpeed JSON (None without DeepSpeed). `zero_stage: auto` builds it at ZeRO-3, where every
    setting applies; the auto layout picks the stage later."""
    dist = recipe.distributed
    auto_stage = dist.zero_stage == "auto"
    if dist.deepspeed is None and not auto_stage:
        problems = [
            f"distributed.{key}: needs a DeepSpeed config; set distributed.deepspeed: zero3"
            for key in ("zero_stage", "offload_optimizer", "offload_params")
            if getattr(dist, key) is not None
        ]
        if dist.deepspeed_overrides:
            problems.append("distributed.deepspeed_overrides: needs a DeepSpeed config; set distributed.deepspeed")
        return None, problems
    try:
        return build_deepspeed_config(
            dist.deepspeed or AUTO_BASE_CONFIG,
            precision=precision,
            zero_stage=3 if auto_stage else dist.zero_stage,
            offload_optimizer=dist.offload_optimizer,
            offload_params=dist.offload_params,
            overrides=dist.deepspeed_overrides,
        ), []
    except UserError as e:
        return None, e.lines


def bind_to_host(recipe: Recipe, host: Host, pre: Preflight) -> Resolved:
    """Bind `recipe` to `host`, given its pre-flight `pre`; raise one UserError listing every cross-field problem
    (the pre-flight's included). `zero_stage`, `gradient_checkpointing` and `sleep_level` auto are left to
    `colocate_rl.pipeline.resolve` (the engine checks then wait for the layout chosen). ValueError when `pre` is the
    pre-flight of another recipe (a caller's mistake)."""
    if not pre.matches(recipe):
        raise ValueError("bind_to_host: the pre-flight was read for another recipe's model, data or rewards")
    nproc, problems = _ranks(recipe, host)
    backend, backend_problems = _backend(recipe, host)
    precision, model_dtype, precision_problems = _precision(recipe, host)
    deepspeed, deepspeed_problems = _deepspeed(recipe, precision)
    problems += backend_problems + precision_problems + _check_batch(recipe, nproc) + _check_nodes(recipe)
    problems += deepspeed_problems + list(pre.problems) + check_eval_schedule(recipe) + list(pre.eval_problems)
    problems += check_extra_args(recipe) + check_overlap(recipe, backend)
    if recipe.distributed.zero_stage != "auto":  # auto: the engine's constraints filter the layout candidates
        problems += check_engine(recipe, deepspeed) + check_tool_layout(recipe, backend, nproc, deepspeed)
    if problems:
        raise UserError(*problems)
    return Resolved(
        recipe=recipe,
        host=host,
        nproc_per_node=nproc,
        device="cuda" if host.gpu_count else "cpu",
        backend=backend,
        precision=precision,
        model_dtype=model_dtype,
        deepspeed=deepspeed,
        builtin_layout=pre.builtin_layout,
        preflight=pre,
        gradient_checkpointing=recipe.trainer.gradient_checkpointing is True,
    )
