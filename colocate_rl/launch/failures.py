"""Turn known failures in a run's log into one-line advice that names the recipe keys to change."""

from __future__ import annotations

from colocate_rl.recipe.schema import Recipe

MEM_PROBE = "`colocate-rl mem-probe RECIPE` measures what fits on the GPUs (`--estimate` computes it without one)"


def diagnose(log_text: str, recipe: Recipe) -> list[str]:
    """Advice lines for the failures recognised in `log_text` (empty when none is recognised)."""
    gen = recipe.generation
    util = gen.vllm_gpu_memory_utilization
    advice = []
    if "less than desired GPU memory utilization" in log_text:
        advice.append(
            f"vLLM could not reserve generation.vllm_gpu_memory_utilization={util} of the GPU at start-up (the "
            f"trainer or another process already holds that memory): lower it (e.g. {max(0.05, round(util - 0.1, 2))}),"
            " or free the GPU; " + MEM_PROBE
        )
    if (
        "No available memory for the cache blocks" in log_text
        or "larger than the available KV cache memory" in log_text
    ):
        advice.append(
            f"vLLM's KV cache does not fit in generation.vllm_gpu_memory_utilization={util}: raise it, or lower "
            "generation.max_model_length / trainer.max_completion_length; " + MEM_PROBE
        )
    if "CUDA out of memory" in log_text or "OutOfMemoryError" in log_text:
        steps = []
        if not gen.sleep_level:
            steps.append("turn on sleep mode (generation.sleep_level: 2)")
        steps.append(f"lower generation.vllm_gpu_memory_utilization (now {util})")
        if recipe.distributed.deepspeed is None:
            steps.append("use distributed.deepspeed: zero3")
        elif not recipe.distributed.offload_optimizer:
            steps.append("set distributed.offload_optimizer: true")
        if recipe.trainer.gradient_checkpointing is not True:
            steps.append("set trainer.gradient_checkpointing: true")
        steps.append("lower trainer.per_device_train_batch_size or trainer.max_completion_length")
        advice.append("a rank ran out of GPU memory: " + ", ".join(steps) + "; " + MEM_PROBE)
    return advice
