#!/usr/bin/env python3
"""The vLLM side of `bench_generation.py`: standalone vLLM with a colocated run's engine, and the probe in its ranks.

Standalone (a separate process on one GPU, after the colocated run of the same workload):

    python benchmarks/generation_vllm.py --run-dir RUN --engine same --variants trl,detok,lean --out OUT.json

- Engine arguments: `VLLMEngine.llm_kwargs()` of colocate_rl/rank/vllm_engine.py, on an engine built from the run
  directory's `launch.json` (its `EngineOptions` and TRL arguments) as the trainer builds it (`from_trainer`), not
  started (`engine_kwargs`). `--engine same` passes them unchanged (vLLM's in-process engine core, as on a rank);
  `--engine mp` drops `distributed_executor_backend` (vLLM's default: engine core in its own process).
- Requests: the prompt token ids rank 0 sent to vLLM, recorded per generation by the probe (below), batch k of the
  standalone = generation k of the run; SamplingParams as colocate-rl's engine builds them for training
  (`sampling_kwargs`), changed per variant (`VARIANTS`). Timed: `LLM.generate` only (prefix cache reset before each
  batch, as after every weight push), and the run's logprob extraction of its outputs (`read_outputs`) separately
  (`post_s`). Variant `rescore` generates without logprobs and then takes the sampled tokens' logprobs from one
  prefill over prompt + completion (`prompt_logprobs=0`, no temperature: vLLM's prompt logprobs skip the sampling
  processors, so it stands in only at temperature 1 without penalties or filters): its `s` is both calls
  (`generate_s`, `rescore_s`), and once after its timed batches it rescores one batch generated with the run's own
  SamplingParams and compares the two logprobs of every sampled token (`agreement`).

Probe (in the colocated run's ranks, through benchmarks/generation_probe/sitecustomize.py): once colocate-rl's
trainer has started its engine, wraps the engine's `llm.generate` and the logprob extraction it runs on vLLM's
outputs (colocate-rl's `VLLMEngine`: `read_outputs`; TRL's engine, `generation.engine: trl`: TRL's
`extract_logprobs`), appending one JSON line per call to RUN/bench/generate_calls.rank<N>.jsonl: prompt token ids,
SamplingParams, completion tokens, seconds in vLLM, in the extraction and in Python's garbage collector, plus the
engine's built config once. COLOCATE_BENCH_GC=off also turns the garbage collector off during `llm.generate` (an
experiment, not a fix). COLOCATE_BENCH_PROFILE=generate=K,train=J runs torch's profiler over generate call K (and the
standalone's batch K of its first variant, into its result's `profile`) and TRL's GRPO training_step call J, into
RUN/bench/profile.{generate,train}.rank<N>.json: wall seconds against GPU kernel seconds, and the top kernels and CPU
operators.

Importing this module needs neither vLLM nor a GPU; `engine_kwargs` and `sampling_kwargs` need TRL (tested on CPU).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import socket
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PROBE_DIR = "bench"  # RUN/bench/generate_calls.rank<N>.jsonl
PROBE_ENV = "COLOCATE_BENCH_PROBE"  # "1": the sitecustomize patches the ranks' engine
GC_ENV = "COLOCATE_BENCH_GC"  # "off": garbage collector off during the ranks' llm.generate
PROFILE_ENV = "COLOCATE_BENCH_PROFILE"  # "generate=K,train=J": torch-profile generate call K, training_step call J

# TRL config fields that no engine or sampling argument reads (colocate_rl/rank/vllm_engine.py `from_trainer`,
# colocate_rl/rank/engine.py `Sampling.from_args`); building TRL's config without them needs no GPU (bf16 checks for
# one) and no process group (deepspeed starts one).
NOT_FOR_GENERATION = ("deepspeed", "bf16", "fp16")

LEAN = {"logprobs": None, "detokenize": False}
VARIANTS = {  # name → (what it changes in TRL's request, SamplingParams changes)
    "trl": ("the run's SamplingParams (colocate-rl's engine: detokenize=False, flat logprobs), n=1 per copy", {}),
    "detok": ("+ detokenize=True (TRL's own engine: vLLM also builds the text)", {"detokenize": True}),
    "nodetok": ("+ detokenize=False (TRL reads only token ids and logprobs)", {"detokenize": False}),
    "nologprobs": ("logprobs=None", {"logprobs": None}),
    "lean": ("logprobs=None, detokenize=False", LEAN),
    "flat": ("+ detokenize=False, flat_logprobs=True", {"detokenize": False, "flat_logprobs": True}),
    "nested": ("+ flat_logprobs=False (a dict and a Logprob per token)", {"flat_logprobs": False}),
    "groupn": ("n=num_generations on one copy of each prompt (vLLM fans out)", {}),
    "rescore": ("lean, then the sampled tokens' logprobs from a prefill of prompt + completion", LEAN),
}
RESCORE = {"max_tokens": 1, "prompt_logprobs": 0, "detokenize": False, "flat_logprobs": True, "temperature": 1.0}
SAMPLING_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "max_tokens",
    "min_tokens",
    "logprobs",
    "prompt_logprobs",
    "seed",
    "detokenize",
    "skip_special_tokens",
    "flat_logprobs",
    "stop",
    "stop_token_ids",
    "ignore_eos",
)


# ---------------------------------------------------------------------------------------------- engine arguments


def read_launch(run_dir: Path):
    from colocate_rl.plan.launch_spec import LaunchSpec
    from colocate_rl.rundir import RunDir

    return LaunchSpec.read(RunDir(Path(run_dir)).launch_spec)


def trl_config(launch):
    """TRL's GRPOConfig / RLOOConfig of the run (the rank builds it the same way, colocate_rl/rank/worker.py),
    without NOT_FOR_GENERATION. A generation batch size given in extra_args is turned into steps per generation with
    the run's world size (TRL derives it from the world size of the process that builds the config)."""
    from colocate_rl.algorithms import trainer_classes
    from colocate_rl.rank.worker import config_args

    Config, _ = trainer_classes(launch.algorithm)
    args = {k: v for k, v in launch.trl_args.items() if k not in NOT_FOR_GENERATION}
    args.update(bf16=False, fp16=False)
    if args.get("generation_batch_size") is not None and args.get("steps_per_generation") is None:
        per_rank_step = args["per_device_train_batch_size"] * launch.world_size
        args["steps_per_generation"] = args.pop("generation_batch_size") // per_rank_step
    return Config(**config_args(Config, args))


def build_engine(run_dir: Path, rank: int = 0):
    """colocate-rl's VLLMEngine of `rank` as the run's trainer builds it (`vllm_engine.from_trainer` on the run's TRL
    config, model path and world size, seeded with trainer.seed as the worker does), not started: `llm_kwargs()` is
    then what that rank passes to `vllm.LLM`. Exits when the run did not use colocate-rl's vLLM engine."""
    from colocate_rl.rank.vllm_engine import from_trainer
    from colocate_rl.recipe.load import load_recipe
    from colocate_rl.rundir import RunDir

    launch = read_launch(run_dir)
    if launch.engine is None:
        raise SystemExit(f"{run_dir}: not a run of colocate-rl's vLLM engine (generation.engine colocate-rl on GPUs)")
    accelerator = SimpleNamespace(
        process_index=rank,
        local_process_index=rank,
        num_processes=launch.world_size,
        state=SimpleNamespace(deepspeed_plugin=None, fsdp_plugin=None),
    )
    trainer = SimpleNamespace(
        args=trl_config(launch), model=SimpleNamespace(name_or_path=launch.model_path), accelerator=accelerator
    )
    seed = load_recipe(RunDir(Path(run_dir)).recipe).trainer.seed
    return from_trainer(trainer, launch.engine, None, seed)


def engine_kwargs(run_dir: Path, rank: int = 0) -> dict[str, Any]:
    """The arguments of `vllm.LLM` on `rank` of the run in `run_dir` (VLLMEngine.llm_kwargs)."""
    return build_engine(run_dir, rank).llm_kwargs()


def sampling_kwargs(args) -> dict[str, Any]:
    """SamplingParams arguments of colocate-rl's engine for the training generations of TRL config `args` (what
    `VLLMEngine._generate` passes: `vllm_engine.sampling_kwargs` of `Sampling.from_args`). Structured outputs are not
    benchmarked."""
    from colocate_rl.rank.engine import Sampling
    from colocate_rl.rank.vllm_engine import sampling_kwargs as engine_sampling

    if args.vllm_structured_outputs_regex is not None or (args.generation_kwargs or {}).get("structured_outputs"):
        raise SystemExit("structured outputs (guided decoding) are not benchmarked")
    return engine_sampling(Sampling.from_args(args))


def variant_sampling(base: dict[str, Any], variant: str) -> dict[str, Any]:
    """SamplingParams arguments of `variant` (VARIANTS) from TRL's (`base`)."""
    if variant not in VARIANTS:
        raise SystemExit(f"unknown variant {variant}; known: {', '.join(VARIANTS)}")
    kwargs = {**base, **VARIANTS[variant][1]}
    if kwargs.get("stop") and not kwargs.get("detokenize", True):
        raise SystemExit(f"variant {variant}: generation_kwargs has stop strings, which need detokenize=True")
    return kwargs


def prompt_groups(prompts: list[list[int]]) -> tuple[list[list[int]], int] | None:
    """(one copy of each prompt, copies per prompt) when `prompts` is runs of equal length of one prompt each (TRL's
    RepeatSampler puts a prompt's num_generations copies next to each other); else None."""
    runs: list[list[Any]] = []
    for ids in prompts:
        if runs and runs[-1][0] == ids:
            runs[-1][1] += 1
        else:
            runs.append([ids, 1])
    sizes = {n for _, n in runs}
    return ([ids for ids, _ in runs], sizes.pop()) if len(sizes) == 1 else None


# ---------------------------------------------------------------------------------------------- summaries


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple, set)):
        return [_plain(v) for v in value]
    return str(value)


def sampling_summary(params) -> dict[str, Any]:
    """The SamplingParams fields that decide the work (JSON values)."""
    return {name: _plain(getattr(params, name, None)) for name in SAMPLING_FIELDS}


def config_summary(llm) -> dict[str, Any]:
    """The engine settings as vLLM built them (read back, not asked): scheduler, CUDA graphs, engine core mode."""

    def read(fn):
        try:
            return _plain(fn())
        except Exception:
            return None

    cfg = llm.llm_engine.vllm_config
    sched, cache, model, comp, par = (
        cfg.scheduler_config,
        cfg.cache_config,
        cfg.model_config,
        cfg.compilation_config,
        cfg.parallel_config,
    )
    return {
        "max_num_seqs": read(lambda: sched.max_num_seqs),
        "max_num_batched_tokens": read(lambda: sched.max_num_batched_tokens),
        "async_scheduling": read(lambda: sched.async_scheduling),
        "enable_chunked_prefill": read(lambda: sched.enable_chunked_prefill),
        "max_model_len": read(lambda: model.max_model_len),
        "dtype": read(lambda: model.dtype),
        "enforce_eager": read(lambda: model.enforce_eager),
        "enable_sleep_mode": read(lambda: model.enable_sleep_mode),
        "logprobs_mode": read(lambda: model.logprobs_mode),
        "enable_prefix_caching": read(lambda: cache.enable_prefix_caching),
        "block_size": read(lambda: cache.block_size),
        "num_gpu_blocks": read(lambda: cache.num_gpu_blocks),
        "gpu_memory_utilization": read(lambda: cache.gpu_memory_utilization),
        "compilation_mode": read(lambda: comp.mode),
        "cudagraph_mode": read(lambda: comp.cudagraph_mode),
        "max_cudagraph_capture_size": read(lambda: comp.max_cudagraph_capture_size),
        "distributed_executor_backend": read(lambda: par.distributed_executor_backend),
        "use_v2_model_runner": read(lambda: cfg.use_v2_model_runner),
        "engine_core_client": read(lambda: type(llm.llm_engine.engine_core).__name__),  # InprocClient: in-process
        "vllm": read(lambda: __import__("vllm").__version__),
    }


class GcClock:
    """Seconds and collections of Python's garbage collector while `active` (a gc callback)."""

    def __init__(self):
        self.active, self.seconds, self.collections, self._start = False, 0.0, [0, 0, 0], 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if not self.active:
            return
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start
            self.collections[min(int(info.get("generation", 2)), 2)] += 1

    def reset(self) -> None:
        self.seconds, self.collections = 0.0, [0, 0, 0]


def completion_tokens(outputs) -> int:
    return sum(len(c.token_ids) for o in outputs for c in o.outputs)


def rescore_requests(prompts: list[list[int]], outputs) -> list[dict]:
    """One request per sampled sequence of `outputs` (vLLM's, one per prompt): its prompt followed by its completion."""
    return [{"prompt_token_ids": list(p) + list(o.outputs[0].token_ids)} for p, o in zip(prompts, outputs)]


def rescored_logprobs(outputs, prompt_lengths: list[int]) -> list[list[float]]:
    """The logprob of every completion token from the prompt logprobs of rescoring requests (position p of a prompt
    holds the logprob of its token p given the tokens before it; position 0 holds none): through vLLM's
    `FlatLogprobs` lists where the request asked for no more than the token itself, else position by position."""
    result = []
    for out, n in zip(outputs, prompt_lengths):
        lps, ids = out.prompt_logprobs, out.prompt_token_ids
        starts, values = getattr(lps, "start_indices", None), getattr(lps, "logprobs", None)
        if isinstance(values, list) and len(values) == len(ids) - 1:  # flat, one entry per position after the first
            result.append([values[starts[p]] for p in range(n, len(ids))])
        else:
            result.append([lps[p][ids[p]].logprob for p in range(n, len(ids))])
    return result


def agreement(sampled: list[list[float | None]], rescored: list[list[float]]) -> dict[str, Any]:
    """How the sampler's logprobs of the sampled tokens compare with the rescoring's: tokens compared, largest and
    mean absolute difference, mean difference (sampled − rescored)."""
    pairs = [(a, b) for xs, ys in zip(sampled, rescored) for a, b in zip(xs, ys, strict=True) if a is not None]
    if not pairs:
        return {"tokens": 0}
    diffs = [a - b for a, b in pairs]
    return {
        "tokens": len(pairs),
        "max_abs": round(max(abs(d) for d in diffs), 6),
        "mean_abs": round(statistics.fmean(abs(d) for d in diffs), 6),
        "mean": round(statistics.fmean(diffs), 6),
    }


# ---------------------------------------------------------------------------------------------- the probe


def probe_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / PROBE_DIR / f"generate_calls.rank{rank}.jsonl"


def read_probe(run_dir: Path, rank: int = 0) -> tuple[dict | None, list[dict], dict[int, float]]:
    """(the engine record, the generate calls in order, TRL extraction seconds by call) of a rank's probe file."""
    engine, calls, extract = None, [], {}
    path = probe_path(run_dir, rank)
    lines = path.read_text().splitlines() if path.is_file() else []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("kind") == "engine":
            engine = record
        elif record.get("kind") == "call":
            calls.append(record)
        elif record.get("kind") == "extract":
            extract[record["call"]] = record["s"]
    return engine, calls, extract


def profile_targets() -> dict[str, int]:
    """What COLOCATE_BENCH_PROFILE asks to profile: {"generate": call index, "train": training_step call index}."""
    targets = {}
    for item in os.environ.get(PROFILE_ENV, "").split(","):
        key, sep, value = item.partition("=")
        if sep and key in ("generate", "train") and value.strip().isdigit():
            targets[key] = int(value)
    return targets


def profiled(fn, *args, **kwargs) -> tuple[Any, dict]:
    """`fn(*args, **kwargs)` under torch's profiler (CPU and CUDA); its result and `profile_summary`. A profiler
    that fails is recorded as `error` (the call still runs); what `fn` raises propagates."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    try:
        prof = profile(activities=activities)
        prof.__enter__()
    except Exception as e:
        return fn(*args, **kwargs), {"error": repr(e)}
    start = time.perf_counter()
    try:
        result = fn(*args, **kwargs)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    finally:
        wall = time.perf_counter() - start
        try:
            prof.__exit__(None, None, None)
            summary = profile_summary(prof, wall)
        except Exception as e:
            summary = {"error": repr(e), "wall_s": round(wall, 5)}
    return result, summary


def profile_summary(prof, wall_s: float, top: int = 15) -> dict:
    """Wall seconds, seconds of GPU kernels (their self time summed: one stream), kernel count, and the kernels and
    CPU operators that took the most time."""
    from torch.autograd import DeviceType

    rows = prof.key_averages()
    kernels = [e for e in rows if e.device_type == DeviceType.CUDA]
    cpu = [e for e in rows if e.device_type == DeviceType.CPU]
    kernels.sort(key=lambda e: -e.self_device_time_total)
    cpu.sort(key=lambda e: -e.self_cpu_time_total)
    return {
        "wall_s": round(wall_s, 5),
        "kernel_s": round(sum(e.self_device_time_total for e in kernels) / 1e6, 5),
        "kernels": sum(e.count for e in kernels),
        "top_kernels_ms": [[e.key[:90], round(e.self_device_time_total / 1e3, 3), e.count] for e in kernels[:top]],
        "top_cpu_ms": [[e.key[:90], round(e.self_cpu_time_total / 1e3, 3), e.count] for e in cpu[:top]],
    }


def write_profile(run_dir: Path, what: str, rank: int, summary: dict) -> None:
    path = Path(run_dir) / PROBE_DIR / f"profile.{what}.rank{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1) + "\n")


def attach_probe(llm, rank: int, run_dir: Path, extraction: tuple[Any, str]) -> None:
    """Wrap `llm.generate` (a rank's vllm.LLM) and the function `extraction` names (module, attribute: the logprob
    extraction the engine calls on vLLM's outputs) to record each call into `run_dir`'s probe file of `rank`."""
    if getattr(llm.generate, "_bench_probe", False):
        return
    path = probe_path(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    clock, state, targets = GcClock(), {"call": -1}, profile_targets()
    gc_off = os.environ.get(GC_ENV) == "off"

    def write(record: dict) -> None:
        with path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    write({"kind": "engine", "rank": rank, "gc_off": gc_off, "config": config_summary(llm)})
    generate = llm.generate

    def probed_generate(prompts, sampling_params=None, *args, **kwargs):
        state["call"] += 1
        record: dict[str, Any] = {"kind": "call", "call": state["call"], "rank": rank}
        if state["call"] == 0:
            record["gc_tracked_objects"] = len(gc.get_objects())  # outside the timed part, in the warm-up step
        enabled = gc.isenabled()
        clock.reset()
        clock.active = True
        if gc_off:
            gc.disable()
        start = time.perf_counter()
        try:
            if state["call"] == targets.get("generate"):
                outputs, summary = profiled(generate, prompts, sampling_params, *args, **kwargs)
                write_profile(run_dir, "generate", rank, summary)
            else:
                outputs = generate(prompts, sampling_params, *args, **kwargs)
        finally:
            seconds = time.perf_counter() - start
            clock.active = False
            if gc_off and enabled:
                gc.enable()
        ids = [p["prompt_token_ids"] if isinstance(p, dict) else p for p in prompts]
        record.update(
            llm_generate_s=round(seconds, 5),
            gc_s=round(clock.seconds, 5),
            gc_collections=list(clock.collections),
            requests=len(prompts),
            completion_tokens=completion_tokens(outputs),
            sampling=sampling_summary(sampling_params),
            prompt_token_ids=[list(i) for i in ids],
        )
        write(record)
        return outputs

    probed_generate._bench_probe = True
    llm.generate = probed_generate
    module, name = extraction
    extract = getattr(module, name)
    if getattr(extract, "_bench_probe", False):
        return

    def probed_extract(outputs):
        start = time.perf_counter()
        result = extract(outputs)
        write({"kind": "extract", "call": state["call"], "s": round(time.perf_counter() - start, 5)})
        return result

    probed_extract._bench_probe = True
    setattr(module, name, probed_extract)


def worker_run_dir() -> Path | None:
    """RUN_DIR of `python -m colocate_rl.worker RUN_DIR` (this process, a rank)."""
    return Path(sys.argv[1]) if len(sys.argv) > 1 else None


def probe_engine(engine) -> None:
    """Attach the probe to a started engine's vLLM: colocate-rl's VLLMEngine (its `llm`, run directory and
    `read_outputs`) or TRL's (`generation.engine: trl`: its VLLMGeneration's `llm` in colocate mode, the worker's
    run directory, TRL's `extract_logprobs`). An engine without vLLM (transformers) is left alone."""
    from colocate_rl.rank import hf_engine, vllm_engine

    if isinstance(engine, vllm_engine.VLLMEngine):
        rank = engine.accelerator.process_index
        attach_probe(engine.llm, rank, engine.run_dir or worker_run_dir(), (vllm_engine, "read_outputs"))
    elif isinstance(engine, hf_engine.TRLEngine) and getattr(engine.vllm, "llm", None) is not None:
        import trl.generation.vllm_generation as trl_vllm

        rank = engine.vllm.accelerator.process_index
        attach_probe(engine.vllm.llm, rank, worker_run_dir(), (trl_vllm, "extract_logprobs"))


def patch_engine(module) -> None:
    """colocate_rl.rank.adapter.trl: colocate-rl's trainer attaches the probe to its engine once it has started it."""
    hooks = module._EngineHooks
    init = hooks.__init__
    if getattr(init, "_bench_probe", False):
        return

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        probe_engine(self.engine)

    __init__._bench_probe = True
    hooks.__init__ = __init__


def patch_trainer(module) -> None:
    """trl.trainer.grpo_trainer: profile the training_step call COLOCATE_BENCH_PROFILE names (`train=J`, counted
    from 0 over the run) on every rank, into RUN/bench/profile.train.rank<N>.json."""
    target = profile_targets().get("train")
    cls = module.GRPOTrainer
    if target is None or getattr(cls.training_step, "_bench_probe", False):
        return
    step, calls = cls.training_step, {"n": -1}

    def training_step(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] != target:
            return step(self, *args, **kwargs)
        result, summary = profiled(step, self, *args, **kwargs)
        write_profile(worker_run_dir(), "train", self.accelerator.process_index, summary)
        return result

    training_step._bench_probe = True
    cls.training_step = training_step


def patch_engine_process(module) -> None:
    """colocate_rl.rank.engine_server: in the engine's own process (`generation.engine_process`), the probe attaches to
    the vLLM engine it builds (rank = its process index there, 0: one GPU per engine process)."""
    build = module.child_vllm
    if getattr(build, "_bench_probe", False):
        return

    def child_vllm(spec):
        engine = build(spec)
        probe_engine(engine)
        return engine

    child_vllm._bench_probe = True
    module.child_vllm = child_vllm


PATCHES = {  # module → what the sitecustomize applies once it is imported in a rank (or its engine process)
    "colocate_rl.rank.adapter.trl": patch_engine,
    "trl.trainer.grpo_trainer": patch_trainer,
    "colocate_rl.rank.engine_server": patch_engine_process,
}


# ---------------------------------------------------------------------------------------------- standalone run


def launch_env(run_dir: Path) -> dict[str, str]:
    """The variables launch.sh exports to the ranks (OMP_NUM_THREADS, TOKENIZERS_PARALLELISM, HF_HUB_OFFLINE, ...)."""
    env = {}
    path = Path(run_dir) / "launch.sh"
    for line in path.read_text().splitlines() if path.is_file() else []:
        if line.startswith("export "):
            key, _, value = line[len("export ") :].partition("=")
            env[key] = shlex.split(value)[0] if value else ""
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`KEY=VALUE` engine-argument overrides; VALUE is JSON when it parses, else text."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--override {item}: use KEY=VALUE")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def run_standalone(args: argparse.Namespace) -> dict[str, Any]:
    for key, value in launch_env(args.run_dir).items():  # before torch is imported
        os.environ.setdefault(key, value)
    if args.engine == "same":  # vLLM's external launcher reads the torchrun variables; one process, rank 0
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ["MASTER_PORT"] = str(free_port())
    engine = build_engine(args.run_dir, args.rank)
    kwargs = engine.llm_kwargs()
    if kwargs["tensor_parallel_size"] != 1:
        raise SystemExit("the standalone comparison runs tensor_parallel_size 1 only")
    if args.engine == "mp":
        kwargs.pop("distributed_executor_backend")
    kwargs.update(parse_overrides(args.override))
    base = sampling_kwargs(trl_config(read_launch(args.run_dir)))
    _, calls, _ = read_probe(args.run_dir, args.rank)
    batches = [c["prompt_token_ids"] for c in calls]
    needed = args.warmup + args.batches
    if len(batches) < needed:
        raise SystemExit(f"{probe_path(args.run_dir, args.rank)}: {len(batches)} recorded generations, need {needed}")

    from vllm import LLM, SamplingParams

    from colocate_rl.rank.vllm_engine import read_outputs  # the extraction colocate-rl's engine runs

    llm = LLM(**kwargs)
    result: dict[str, Any] = {
        "engine": args.engine,
        "rank": args.rank,
        "llm_kwargs": _plain(kwargs),
        "config": config_summary(llm),
        "recorded_sampling": calls[0].get("sampling"),
        "variants": {},
    }
    clock, profile_at = GcClock(), profile_targets().get("generate")
    rescore_params = SamplingParams(**RESCORE)
    for variant in args.variants:
        params = SamplingParams(**variant_sampling(base, variant))
        rows = []
        for k in range(needed):
            prompts, params_k = batches[k], params
            if variant == "groupn":
                grouped = prompt_groups(prompts)
                if grouped is None:
                    raise SystemExit("variant groupn: the recorded prompts are not groups of equal copies")
                prompts, copies = grouped
                params_k = SamplingParams(**{**variant_sampling(base, variant), "n": copies})
            llm.reset_prefix_cache()  # as after every weight push of the colocated run
            clock.reset()
            clock.active = True
            start = time.perf_counter()
            requests = [{"prompt_token_ids": p} for p in prompts]
            if variant == args.variants[0] and k == profile_at:  # as the probe profiles the colocated call
                outputs, result["profile"] = profiled(llm.generate, requests, params_k, use_tqdm=False)
            else:
                outputs = llm.generate(requests, params_k, use_tqdm=False)
            seconds = time.perf_counter() - start
            clock.active = False
            row = {"s": round(seconds, 5), "tokens": completion_tokens(outputs), "gc_s": round(clock.seconds, 5)}
            if variant == "rescore":  # the sampled tokens' logprobs from a second call, counted in `s`
                start = time.perf_counter()
                rescored = llm.generate(rescore_requests(prompts, outputs), rescore_params, use_tqdm=False)
                rescored_logprobs(rescored, [len(p) for p in prompts])
                row.update(generate_s=row["s"], rescore_s=round(time.perf_counter() - start, 5))
                row["s"] = round(row["generate_s"] + row["rescore_s"], 5)
            if params.logprobs is not None:  # what the engine does with them, timed apart
                start = time.perf_counter()
                read_outputs(outputs)
                row["post_s"] = round(time.perf_counter() - start, 5)
            rows.append(row)
        result["variants"][variant] = {"sampling": sampling_summary(params), "batches": rows}
        if variant == "rescore":  # one batch with the run's own SamplingParams: its logprobs against the rescoring's
            prompts = batches[args.warmup]
            llm.reset_prefix_cache()
            sampled = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(**base), use_tqdm=False)
            rescored = llm.generate(rescore_requests(prompts, sampled), rescore_params, use_tqdm=False)
            result["variants"][variant]["agreement"] = agreement(
                read_outputs(sampled).logprobs, rescored_logprobs(rescored, [len(p) for p in prompts])
            )
        measured = rows[args.warmup :]
        seconds = sum(r["s"] for r in measured)
        print(
            json.dumps(
                {
                    "variant": variant,
                    "s_per_batch": round(statistics.median(r["s"] for r in measured), 4),
                    "tokens_per_s": round(sum(r["tokens"] for r in measured) / seconds, 1) if seconds else None,
                }
            ),
            flush=True,
        )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, required=True, help="the colocated run (with the probe's records)")
    parser.add_argument("--engine", choices=("same", "mp"), default="same")
    parser.add_argument("--variants", default="trl", help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--warmup", type=int, default=2, help="batches before the timed ones (generations 0..)")
    parser.add_argument("--batches", type=int, default=10, help="timed batches")
    parser.add_argument("--rank", type=int, default=0, help="whose prompts and sampling seed")
    parser.add_argument("--override", action="append", default=[], help="engine argument KEY=VALUE (JSON value)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    for variant in args.variants:
        variant_sampling({}, variant)  # unknown names fail before vLLM starts
    result = run_standalone(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
