"""DeepSpeed and accelerate internals used to move the trainer's states off the GPU while vLLM generates (pinned:
deepspeed==0.19.8), each with what it relies on."""

from __future__ import annotations

# The trainer states moved out of the GPU during generation. Not the bf16 parameters: ZeRO-3 needs them for the
# push and the trainer for the log-probabilities right after generation, and vLLM has its own copy.
OFFLOADED_STATES = ("optim_states", "hp_params", "lp_grads", "contiguous_grad_buffer")


def deepspeed_engine(accelerator):
    """The DeepSpeed engine accelerate prepared, or None before the first step (relied on: accelerate keeps it as
    `deepspeed_engine_wrapped.engine`)."""
    return getattr(getattr(accelerator, "deepspeed_engine_wrapped", None), "engine", None)


def offload_states(engine) -> None:
    """Move OFFLOADED_STATES to CPU (relied on: `DeepSpeedEngine.offload_states(include=[OffloadStateTypeEnum])`)."""
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum

    engine.offload_states(include=[OffloadStateTypeEnum(s) for s in OFFLOADED_STATES])


def skip_shm_comm_build() -> None:
    """On CPU, keep DeepSpeed from JIT-compiling its shared-memory comm op at `init_distributed` (~30 s on the first
    run; the op serves only `inference_all_reduce`, never training). Relied on: `deepspeed.comm.torch.build_shm_op`
    builds it only when `deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"]` is true."""
    import deepspeed.ops

    compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
    if isinstance(compatible, dict):
        compatible["deepspeed_shm_comm"] = False


def check() -> list[str]:
    try:
        from deepspeed.runtime.engine import DeepSpeedEngine
        from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum
    except ImportError as e:
        return [f"deepspeed: {e}"]
    problems = [
        f"deepspeed DeepSpeedEngine.{n} is missing"
        for n in ("offload_states", "reload_states")
        if not hasattr(DeepSpeedEngine, n)
    ]
    for state in OFFLOADED_STATES:
        try:
            OffloadStateTypeEnum(state)
        except ValueError:
            problems.append(f"deepspeed OffloadStateTypeEnum has no {state!r}")
    return problems
