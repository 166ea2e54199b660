"""Known failures in a run's log: one table of signatures (vLLM's and torch's own wording), used to classify a
measuring probe's trial (`colocate_rl.memory.probe`) and to turn a failed run's log into one-line advice that names
the recipe keys to change (`diagnose`)."""

from __future__ import annotations

import re

from colocate_rl.recipe.schema import Recipe

OK = "ok"
START_REFUSED = "vLLM refused to start"  # the share is not free at start-up: too high
KV_TOO_SMALL = "KV cache too small"  # the share leaves no KV room for one sequence / batch: too low
OOM = "out of memory"  # a rank ran out of GPU memory while training or generating: too high
NO_SPACE = "no space left"  # a disk filled up (run dir, cache)
TIMEOUT = "timeout"
FAILED = "failed"  # anything else
TOO_HIGH, TOO_LOW = {START_REFUSED, OOM}, {KV_TOO_SMALL}

SIGNATURES: list[tuple[str, str]] = [
    (START_REFUSED, r"less than desired GPU memory utilization"),
    (KV_TOO_SMALL, r"No available memory for the cache blocks"),
    (KV_TOO_SMALL, r"larger than the available KV cache memory"),
    (KV_TOO_SMALL, r"maximum number of tokens that can be stored in KV cache"),
    (KV_TOO_SMALL, r"estimated maximum model length is"),
    (KV_TOO_SMALL, r"Try increasing `?gpu_memory_utilization`?"),
    (OOM, r"CUDA out of memory"),
    (OOM, r"OutOfMemoryError"),
    (OOM, r"(?i)CUDA error: out of memory"),  # also vLLM's sleep-pool allocator: "CUDA Error: out of memory at …"
    (OOM, r"CUDA_ERROR_OUT_OF_MEMORY"),
    (OOM, r"cudaErrorMemoryAllocation"),
    (NO_SPACE, r"No space left on device"),
]
MEM_PROBE = "`colocate-rl mem-probe RECIPE` measures what fits on the GPUs (`--estimate` computes it without one)"


def classify_failure(text: str) -> tuple[str, str]:
    """(kind, the log line) of the earliest known failure in `text`; (FAILED, '') when none is recognised."""
    found = []
    for kind, pattern in SIGNATURES:
        match = re.search(pattern, text)
        if match:
            found.append((match.start(), kind))
    if not found:
        return FAILED, ""
    pos, kind = min(found)
    line_start = text.rfind("\n", 0, pos) + 1
    line_end = text.find("\n", pos)
    return kind, text[line_start : line_end if line_end >= 0 else len(text)].strip()[:400]


def failures_in(text: str) -> list[str]:
    """Every kind of known failure in `text`, in SIGNATURES order."""
    return [
        kind
        for kind in dict.fromkeys(k for k, _ in SIGNATURES)
        if any(re.search(p, text) for k, p in SIGNATURES if k == kind)
    ]


def advice(kind: str, recipe: Recipe) -> str | None:
    """One line naming the recipe keys to change for a failure of `kind`; None for kinds without advice. `recipe` is
    the run directory's (what each `auto` chose, e.g. the micro-batch, written out)."""
    gen = recipe.generation
    util = gen.vllm_gpu_memory_utilization
    if kind == START_REFUSED:
        return (
            f"vLLM could not reserve generation.vllm_gpu_memory_utilization={util} of the GPU at start-up (the "
            f"trainer or another process already holds that memory): lower it (e.g. {max(0.05, round(util - 0.1, 2))}),"
            " or free the GPU; " + MEM_PROBE
        )
    if kind == KV_TOO_SMALL:
        return (
            f"vLLM's KV cache does not fit in generation.vllm_gpu_memory_utilization={util}: raise it, or lower "
            "generation.max_model_length / trainer.max_completion_length; " + MEM_PROBE
        )
    if kind == OOM:
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
        micro, step = recipe.trainer.per_device_train_batch_size, recipe.trainer.step_completions
        smaller = next((m for m in range(micro - 1, 0, -1) if step % m == 0), None)
        if smaller:  # the same step in smaller micro-batches (what micro_batch_size auto may have raised)
            steps.append(
                f"split the step into smaller micro-batches (trainer.micro_batch_size: {smaller}; now {micro})"
            )
        steps.append("lower trainer.max_completion_length or the completions per step")
        return "a rank ran out of GPU memory: " + ", ".join(steps) + "; " + MEM_PROBE
    if kind == NO_SPACE:
        return (
            f"a disk is full (No space left on device): free space where the run directory "
            f"({recipe.output.run_dir}) or the cache lives, then resume from the last checkpoint: "
            f"colocate-rl train --resume {recipe.output.run_dir}"
        )
    return None


def diagnose(log_text: str, recipe: Recipe) -> list[str]:
    """Advice lines for the failures recognised in `log_text` (empty when none is recognised)."""
    return [line for kind in failures_in(log_text) if (line := advice(kind, recipe))]


ROOT_CAUSE = re.compile(
    r"Root Cause \(first observed failure\):.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.DOTALL
)
PREFIX = re.compile(r"^((?:\[[\w-]+\]:)*) ?")  # torch's "[rank1]:" (and "[default1]:" on several nodes)
LAUNCHER_ERRORS = ("ChildFailedError", "SignalException")  # torchrun's own traceback, not a rank's


def rank_failure(log_text: str) -> str | None:
    """The failed rank's own error, from torchrun's "Root Cause" and that rank's traceback in the log: `rank 1:
    OSError: ...`, `rank 1 was killed by SIGKILL`; None when the log names no failed rank."""
    import signal

    causes = list(ROOT_CAUSE.finditer(log_text))
    if not causes:
        return None
    cause = causes[-1]
    rank, code = int(cause.group(1)), int(cause.group(2))
    if code < 0:
        try:
            return f"rank {rank} was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"rank {rank} was killed by signal {-code}"
    found, in_traceback = None, False
    for line in log_text.splitlines():
        prefix = PREFIX.match(line)
        text = line[prefix.end() :]
        if prefix.group(1) and f"[rank{rank}]" not in prefix.group(1):
            continue  # another rank's line
        if text.startswith("Traceback (most recent call last):"):
            in_traceback = True
        elif in_traceback and text and not text[0].isspace():
            in_traceback = False
            if not any(name in text for name in LAUNCHER_ERRORS):
                found = text.strip()
    return f"rank {rank}: {found[:400]}" if found else f"rank {rank} exited with code {code}"
