"""`generation.overlap`, `generation.engine_process`, `vllm_multiprocessing`, `engine_processes` and `mps`: what rules
one-step overlap out, what explicit settings cannot run together, and what `overlap: auto` decides once the sleep level
is known, how many engine processes `engine_processes: auto` runs, and whether `mps: auto` runs them under CUDA MPS.
Torch-free; reads nothing."""

from __future__ import annotations

from colocate_rl.plan.choices import EngineProcessesChoice, MpsChoice, OverlapChoice
from colocate_rl.plan.host import MPS_CONTROL, Host
from colocate_rl.recipe.schema import Recipe

# engine_processes auto: the largest model (billions of parameters) whose generation waited on vLLM's per-token loop,
# one CPU thread, so that two engine processes generated faster: SmolLM2-135M on an H200 (docs/benchmarks, invocation
# L: a 256-completion batch in 1.67 s with two against 2.10 with one). Larger models are unmeasured: one.
SMALL_MODEL_B = 0.25
AUTO_ENGINE_PROCESSES = 2
ENGINE_CORES = 4  # CPU cores a rank needs for two engine loops beside the trainer and the rest
# mps auto: the smallest model (billions of parameters) measured faster with overlap under MPS: SmolLM2-1.7B's shape
# on an H200 (docs/benchmarks, invocation O: 4.62 s/step against 5.39 without MPS); at 135M it did not help
# (invocation B). Sizes in between are unmeasured: off.
MPS_MODEL_B = 1.7


def parameters(params_b: float) -> str:
    """`params_b` billion parameters as a phrase: "1.71B parameters", "0.29M parameters" for a tiny model."""
    return f"{params_b:.2f}B parameters" if params_b >= 0.01 else f"{params_b * 1e3:.2f}M parameters"


def overlap_blockers(recipe: Recipe, backend: str) -> list[str]:
    """Why one-step overlap cannot run `recipe` (each names the key), [] when it can. The sleep level is not among
    them: `sleep_level: auto` resolves to 0 under overlap; an explicit 1 or 2 is `check_overlap`'s."""
    gen, extra, reasons = recipe.generation, recipe.trainer.extra_args, []
    if gen.engine == "trl":
        reasons.append("generation.engine: trl (TRL's engine generates inside the rank, in turn with training)")
    if recipe.tools.active:
        reasons.append("tools (multi-turn episodes take turns with the tools, not with training)")
    if gen.offload_trainer_during_generation:
        reasons.append("generation.offload_trainer_during_generation (the trainer's states are needed while it trains)")
    if gen.tensor_parallel_size > 1:
        reasons.append("generation.tensor_parallel_size > 1 (an engine process generates on its own rank's GPU)")
    if extra.get("num_iterations", 1) != 1:
        reasons.append("trainer.extra_args.num_iterations other than 1 (a generation batch trained on more than once)")
    for key in ("steps_per_generation", "generation_batch_size"):
        if key in extra:
            reasons.append(f"trainer.extra_args.{key} (overlap generates one optimizer step's batch at a time)")
    if backend == "vllm" and extra.get("vllm_importance_sampling_correction") is False:
        reasons.append("trainer.extra_args.vllm_importance_sampling_correction: false (one-step-old samples need it)")
    return reasons


def check_overlap(recipe: Recipe, backend: str) -> list[str]:
    """Explicit settings of `generation.overlap` and `generation.engine_process` that cannot run, one line each."""
    gen, problems = recipe.generation, []
    if gen.overlap == "one_step":
        fix = "set generation.overlap: off"
        problems += [
            f"generation.overlap: one_step cannot run with {r}; {fix}" for r in overlap_blockers(recipe, backend)
        ]
        if backend == "vllm" and gen.sleep_level in (1, 2):
            problems.append(
                f"generation.overlap: one_step keeps vLLM awake while the trainer trains, but generation.sleep_level "
                f"is {gen.sleep_level}; set generation.sleep_level: 0 (or auto), or {fix}"
            )
        if gen.engine_process is False:
            problems.append(
                "generation.overlap: one_step needs the engine in its own process; set generation.engine_process: "
                f"auto (or true), or {fix}"
            )
    if gen.engine_process is True:
        if gen.engine == "trl":
            problems.append(
                "generation.engine_process: true runs colocate-rl's engine in its own process; set generation.engine: "
                "colocate-rl, or generation.engine_process: auto"
            )
        if gen.offload_trainer_during_generation:
            problems.append(
                "generation.engine_process: true cannot move the trainer's DeepSpeed states from another process; "
                "turn generation.offload_trainer_during_generation off, or set generation.engine_process: auto"
            )
        if gen.tensor_parallel_size > 1:
            problems.append(
                "generation.engine_process: true generates on each rank's own GPU; set generation.tensor_parallel_size: "
                "1, or generation.engine_process: auto"
            )
    if gen.vllm_multiprocessing and (backend != "vllm" or not engine_in_process(recipe)):
        problems.append(
            "generation.vllm_multiprocessing: true needs vLLM generating in an engine process of its own (vLLM in "
            "the rank's process shares that process with the trainer); set generation.engine_process: true, or "
            "generation.vllm_multiprocessing: false"
        )
    if isinstance(gen.engine_processes, int) and gen.engine_processes > 1 and not engine_in_process(recipe):
        problems.append(
            f"generation.engine_processes: {gen.engine_processes} needs the engine in its own process; set "
            "generation.engine_process: true (or generation.overlap: one_step), or generation.engine_processes: 1"
        )
    return problems


def overlap_ruled_out(recipe: Recipe, backend: str) -> str | None:
    """Why `overlap: auto` leaves overlap off whatever the sleep level (one clause), or None."""
    if backend != "vllm":
        return f"generation with {backend}: overlap is for vLLM on GPUs (set one_step to force it)"
    if blockers := overlap_blockers(recipe, backend):
        return "; ".join(blockers)
    if recipe.generation.engine_process is False:
        return "generation.engine_process: false (overlap generates in an engine process of its own)"
    if recipe.generation.enforce_eager:  # docs/benchmarks: the trainer's passes ran many times slower beside it
        return "eager vLLM (generation.enforce_eager) beside the trainer slowed it down on an H200"
    return None


def choose_overlap(recipe: Recipe, backend: str, sleep_by_memory: bool) -> OverlapChoice:
    """`generation.overlap: auto` for `recipe` whose sleep level is decided (`sleep_by_memory`: by `sleep_level:
    auto`'s estimate): one_step when vLLM stays awake (level 0) and nothing rules overlap out, else off."""
    if why := overlap_ruled_out(recipe, backend):
        return OverlapChoice(False, why)
    level = recipe.generation.sleep_level
    if level != 0:
        why = "trainer and vLLM do not fit awake together" if sleep_by_memory else "the recipe's generation.sleep_level"
        return OverlapChoice(False, f"vLLM sleeps while training (sleep level {level}: {why})")
    why = "trainer and vLLM fit awake together" if sleep_by_memory else "the recipe keeps vLLM awake"
    return OverlapChoice(True, f"{why} (sleep level 0) and nothing rules it out")


def overlap_may_run(recipe: Recipe, backend: str) -> bool:
    """Whether `overlap: auto` with the engine process auto can turn overlap on for `recipe` whose sleep level is
    not yet decided: nothing rules it out and the level is 0 or auto."""
    gen = recipe.generation
    auto = gen.overlap == gen.engine_process == "auto"
    return auto and gen.sleep_level in (0, "auto") and overlap_ruled_out(recipe, backend) is None


def engine_in_process(recipe: Recipe) -> bool:
    """Whether the engine runs in its own process: `engine_process` true, or auto with overlap on."""
    gen = recipe.generation
    return gen.engine_process is True or (gen.engine_process == "auto" and gen.overlap == "one_step")


def engine_copies(recipe: Recipe) -> int:
    """How many engine processes each rank runs (`generation.engine_processes` with the engine in its own process;
    else 1, the engine in the rank)."""
    return recipe.generation.engine_processes if engine_in_process(recipe) else 1


def choose_engine_processes(
    recipe: Recipe, backend: str, params_b: float | None, cores: int, auto_share: bool
) -> EngineProcessesChoice:
    """`generation.engine_processes: auto` for `recipe` bound to a host (`backend`; `params_b`: the model's
    parameters in billions, None when unknown; `cores`: the CPU cores a rank has): AUTO_ENGINE_PROCESSES where vLLM
    generates in an engine process, on a model of at most SMALL_MODEL_B, with vLLM's share auto (`auto_share`: then
    sized for every copy); else 1. Decided before the share (`overlap: auto` plans the engine process first:
    `colocate_rl.pipeline.resolve`)."""
    if not engine_in_process(recipe):
        return EngineProcessesChoice(1, "the engine runs in the rank's process")
    if backend != "vllm":
        return EngineProcessesChoice(1, f"generation with {backend}")
    if not auto_share:
        return EngineProcessesChoice(
            1,
            "generation.vllm_gpu_memory_utilization is set, for one engine process (set "
            "generation.engine_processes: 2 to split it)",
        )
    if params_b is None or params_b > SMALL_MODEL_B:
        size = "of unknown size" if params_b is None else f"of {parameters(params_b)}"
        return EngineProcessesChoice(
            1, f"a model {size}: more engine processes were measured faster only up to {SMALL_MODEL_B}B"
        )
    if cores < ENGINE_CORES:
        return EngineProcessesChoice(1, f"{cores} CPU cores a rank (two engine loops need {ENGINE_CORES})")
    return EngineProcessesChoice(
        AUTO_ENGINE_PROCESSES,
        f"a model of {parameters(params_b)}: vLLM's per-token loop on one CPU core is what its generation waits "
        f"for, so {AUTO_ENGINE_PROCESSES} loops each generate part of every batch ({cores} CPU cores a rank)",
    )


def check_mps(recipe: Recipe, host: Host) -> list[str]:
    """`generation.mps: on` for `recipe` with overlap decided, on `host`: what keeps it from running, one line each."""
    if recipe.generation.mps != "on":
        return []
    fix, problems = "or set generation.mps: off", []
    if recipe.generation.overlap != "one_step":
        problems.append(
            "generation.mps: on lets generation's kernels run beside training's, which only overlap does; set "
            f"generation.overlap: one_step, {fix}"
        )
    if not host.mps_control:
        problems.append(
            f"generation.mps: on needs {MPS_CONTROL} (NVIDIA's driver utilities) on PATH; install it, {fix}"
        )
    if host.mps_pipe_set:
        problems.append(
            "generation.mps: on starts an MPS daemon of its own, but CUDA_MPS_PIPE_DIRECTORY is set (a daemon of "
            f"yours); unset it, {fix} (yours then serves the run)"
        )
    return problems


def choose_mps(recipe: Recipe, backend: str, params_b: float | None, host: Host) -> MpsChoice:
    """`generation.mps: auto` for `recipe` with overlap decided (`params_b`: the model's parameters in billions,
    None when unknown): on where overlap runs vLLM beside the trainer on a model of at least MPS_MODEL_B and the
    host can start a daemon of its own; else off."""
    if recipe.generation.overlap != "one_step":
        return MpsChoice(False, "without overlap, generation and training take turns on the GPU")
    if backend != "vllm":
        return MpsChoice(False, f"generation with {backend}")
    if host.mps_pipe_set:
        return MpsChoice(False, "CUDA_MPS_PIPE_DIRECTORY is set: the MPS daemon there serves the run")
    if not host.mps_control:
        return MpsChoice(False, f"{MPS_CONTROL} is not on PATH")
    if params_b is None or params_b < MPS_MODEL_B:
        size = "of unknown size" if params_b is None else f"of {parameters(params_b)}"
        return MpsChoice(False, f"a model {size}: overlap was measured faster under MPS from {MPS_MODEL_B}B")
    return MpsChoice(
        True,
        f"a model of {parameters(params_b)}: the trainer's and the engine processes' kernels run on the GPU at "
        "once instead of by time slices",
    )
