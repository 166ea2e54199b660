"""A generation engine in a process of its own on the rank's device (`generation.engine_process`), so that the
trainer can train while it generates (`generation.overlap`).

The rank holds a `ProcessEngine`; a child process (spawned, ended with the rank; `generation.engine_processes` of
them, each generating its part of every batch) runs `colocate_rl.rank.engine_server.serve`, which holds the real
engine: colocate-rl's vLLM engine with a world of its own on a GPU, or transformers with its own copy of the model
without vLLM. They talk over one pipe per child, one command at a time, each answer tagged with its command's id:
`submit` sends a generation and returns at once, `Pending.result()` waits.

Weights do not pass through the host: at start the rank shares one staging buffer (the size of the largest weight
bucket) with the children — a CUDA IPC handle on a GPU, shared memory on CPU (torch.multiprocessing) — then for each
bucket of `weights.trainer_buckets` copies the tensors into it and has each child load them from there. The weight
check stages the trainer's tensors the same way and the child compares its own with them.

What can fail: the child not starting (UserError with the child's own line), the child dying or raising
(EngineProcessError naming it; its traceback is in the rank's log), stale weights (StaleWeightsError).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from colocate_rl.errors import EngineProcessError, UserError
from colocate_rl.rank.engine import Generation, GenerationEngine, Pending, Sampling
from colocate_rl.rank.weights import (
    adapter_merge,
    expected_weights,
    fitting,
    shared_handle,
    stage,
    staging_bytes,
    trainer_buckets,
)
from colocate_rl.telemetry import events

STOP_S = 30.0  # how long `stop` waits for the engine processes to exit before it terminates them
POLL_S = 1.0  # how often a rank waiting for an engine process checks that the process is alive
SEED_STRIDE = 2**20  # engine process k of a rank samples with the rank's seed + k × this (above any rank count)


@dataclass
class Child:
    """One engine process: its pipe, its answers not yet taken, the commands whose answers nobody waits for
    (`_send_only`), whether its weights are the last push's (or the checkpoint's, at start)."""

    process: Any
    conn: Any
    answers: dict[int, tuple[str, Any, bool]] = field(default_factory=dict)
    unawaited: set[int] = field(default_factory=set)
    weights_valid: bool = True


class ProcessEngine(GenerationEngine):
    """The rank's side: the engine processes' lifecycle, commands and weight staging. With several engine processes
    (`generation.engine_processes`) each generates its contiguous part of every batch and all of them load every
    push from the one staging buffer."""

    def __init__(
        self,
        spec: dict[str, Any],
        model,
        gather,
        *,
        bucket_bytes: int,
        check_weights: bool,
        device,
        processes=1,
        on_long_wait: Callable[[int, float], None] | None = None,
        long_wait_s: float = float("inf"),
    ):
        """`spec`: what `serve` builds (`vllm_spec` / `transformers_spec`), divided among `processes` engine
        processes by `child_specs`; `model`: the trainer's (unwrapped) model, whose weights are pushed;
        `gather(params)`: makes ZeRO-3 parameters whole; `on_long_wait(pid, since)`: told once per answer awaited
        longer than `long_wait_s` (since: the wait's start, unix time)."""
        self.spec, self.model, self.gather = spec, model, gather
        self.on_long_wait, self.long_wait_s = on_long_wait, long_wait_s
        self.specs = child_specs(spec, processes)
        self.bucket_bytes, self.check, self.device = bucket_bytes, check_weights, torch.device(device)
        self.returns_logprobs = spec["kind"] == "vllm"
        self.max_batch = spec.get("max_batch")
        self.max_model_len = 2**62
        self.children: list[Child] = []
        self._ids = itertools.count()
        self.last_check: list[str] = []

    @property
    def process(self):
        """The first engine process (None before `start` and after `stop`)."""
        return self.children[0].process if self.children else None

    # ------------------------------------------------------------------ processes

    def start(self) -> None:
        """Start the engine processes one after the other (vLLM sizes its memory from what is free as it starts)."""
        import torch.multiprocessing as mp

        from colocate_rl.rank.engine_server import serve

        ctx = mp.get_context("spawn")
        infos = []
        for spec in self.specs:
            conn, child_end = ctx.Pipe()
            process = ctx.Process(target=serve, args=(child_end, spec), daemon=True, name="colocate-rl-engine")
            process.start()
            child_end.close()
            self.children.append(Child(process, conn))
            try:
                infos.append(self._await(self.children[-1], -1))
            except EngineProcessError as e:
                raise UserError(f"generation.engine_process: the engine process did not start ({e})") from None
        self.max_model_len = min(int(info["max_model_len"]) for info in infos)
        named = self.merge.named_params() if self.merge is not None else self.model.named_parameters()
        size = staging_bytes(named, self.bucket_bytes)
        self.staging = torch.empty(size, dtype=torch.uint8, device=self.device)
        self._call("stage", shared_handle(self.staging) if self.staging.is_cuda else self.staging)
        pids = ", ".join(str(c.process.pid) for c in self.children)
        events.log_line(
            f"[colocate-rl engine] engine process{'es' if len(self.children) > 1 else ''} {pids} ({self.spec['kind']}) "
            f"ready; staging buffer {size / 2**20:.1f} MiB on {self.device}"
        )

    def stop(self) -> None:
        if not self.children:
            return
        started, how = time.perf_counter(), "stopped"
        for child in self.children:
            if child.process.is_alive():
                with contextlib.suppress(OSError, EOFError):
                    child.conn.send(("stop", next(self._ids), None))
        dropped = 0  # batches generated ahead for a step that did not run (each engine process has its part)
        for child in self.children:
            drained = self._drain_until_exit(child, started + STOP_S)
            dropped = max(dropped, drained + sum(isinstance(a[1], Generation) for a in child.answers.values()))
        for child in self.children:
            if child.process.is_alive():
                child.process.terminate()
                child.process.join(timeout=10)
                how = "terminated"
            if child.process.is_alive():
                child.process.kill()
                how = "killed"
        plural = "es" if len(self.children) > 1 else ""
        note = ""
        if dropped:
            note = f"; dropped {dropped} batch{'es' if dropped > 1 else ''} generated ahead for a step that did not run"
        events.log_line(
            f"[colocate-rl engine] engine process{plural} {how} in {time.perf_counter() - started:.1f} s{note}"
        )
        self.children = []

    @staticmethod
    def _drain_until_exit(child: Child, deadline: float) -> int:
        """Read and drop the answers nobody waits for any more (a generation taken ahead for a step that will not
        run) until the process exits: one bigger than the pipe's buffer would block the process's send, and its
        exit, forever (found on the H200: every overlapped run's stop waited out its 30 s). Returns how many of
        them were generations."""
        generations = 0
        while child.process.is_alive() and time.perf_counter() < deadline:
            try:
                if child.conn.poll(0.05):
                    generations += isinstance(child.conn.recv()[2], Generation)
            except (EOFError, OSError):
                child.process.join(timeout=max(0.0, deadline - time.perf_counter()))
                break
        return generations

    @staticmethod
    def _died(child: Child) -> EngineProcessError:
        child.process.join(timeout=10)  # reap it: its exit code is known only then (the pipe may close first)
        code = child.process.exitcode
        return EngineProcessError(
            f"the generation engine process (pid {child.process.pid}) ended"
            + (f" with exit code {code}" if code is not None else "")
            + "; its error is above in this log"
        )

    def _receive(self, child: Child) -> None:
        started, since, told = time.monotonic(), time.time(), self.on_long_wait is None
        while not child.conn.poll(POLL_S):
            if not child.process.is_alive() and not child.conn.poll(0):
                raise self._died(child)
            if not told and time.monotonic() - started > self.long_wait_s:
                told = True
                self.on_long_wait(child.process.pid, since)
        try:
            ident, status, value, valid = child.conn.recv()
        except (EOFError, OSError):
            raise self._died(child) from None
        if ident in child.unawaited:
            child.unawaited.discard(ident)
            self._check_answer(child, status, value, valid)
        else:
            child.answers[ident] = (status, value, valid)

    @staticmethod
    def _check_answer(child: Child, status: str, value: Any, valid: bool) -> None:
        if status == "error":
            raise EngineProcessError(f"the generation engine process failed: {value}")
        child.weights_valid = valid

    def _await(self, child: Child, ident: int) -> Any:
        while ident not in child.answers:
            self._receive(child)
        status, value, valid = child.answers.pop(ident)
        self._check_answer(child, status, value, valid)
        return value

    def _send(self, child: Child, op: str, args: Any = None) -> int:
        ident = next(self._ids)
        try:
            child.conn.send((op, ident, args))
        except (OSError, EOFError):
            raise self._died(child) from None
        return ident

    def _call(self, op: str, args: Any = None) -> list[Any]:
        """`op` on every engine process at once; their answers, in order, once all have answered."""
        idents = [self._send(child, op, args) for child in self.children]
        return [self._await(child, ident) for child, ident in zip(self.children, idents)]

    def _send_only(self, op: str) -> None:
        """A command not waited for, to every engine process: its answer would queue behind a generation in flight
        (overlap's next batch); an error in it is raised at the next wait."""
        for child in self.children:
            child.unawaited.add(self._send(child, op))

    # ------------------------------------------------------------------ the interface

    def submit(self, prompt_ids: list[list[int]], sampling: Sampling) -> Pending:
        """Each engine process gets its contiguous part of `prompt_ids` (a prompt's copies stay together where the
        split allows: vLLM reuses their prefix); the result joins the parts in order."""
        if not prompt_ids:
            return Pending(lambda: Generation.empty(self.returns_logprobs))
        if not all(child.weights_valid for child in self.children):
            self.push_weights()  # sleep level 2 dropped them after the last generation
        parts = [(child, part) for child, part in zip(self.children, split(prompt_ids, len(self.children))) if part]
        idents = [(child, self._send(child, "generate", (part, sampling))) for child, part in parts]
        return Pending(lambda: Generation.joined([self._await(child, ident) for child, ident in idents], at_once=True))

    def generate(self, prompt_ids: list[list[int]], sampling: Sampling) -> Generation:
        return self.submit(prompt_ids, sampling).result()

    @functools.cached_property
    def merge(self):
        """With LoRA: the adapted model as the engine holds it (`weights.adapter_merge`, built once); else None."""
        return adapter_merge(self.model)

    def push_weights(self) -> None:
        """Stage the trainer's weights bucket by bucket and have every engine process load each; then check them."""
        with self.phase("weight_sync"):
            self._call("begin_push")
            for bucket in trainer_buckets(self.model, self.bucket_bytes, self.gather, self.merge):
                self._call("load", stage(self.staging, bucket))
            if self.check:
                with self.phase("weight_check"):
                    self.check_weights()
            self._call("end_push")

    def check_weights(self) -> None:
        from colocate_rl.rank.vllm_engine import raise_if_stale

        expected = expected_weights(self.model, self.gather, 1, self.merge, fused=self.spec["kind"] == "vllm")
        self.last_check = list(expected)
        problems = []
        for group in fitting(list(expected.items()), self.staging.numel()):
            for k, found in enumerate(self._call("check", stage(self.staging, group))):
                problems += [f"engine process {k}: {p}" for p in found] if len(self.children) > 1 else found
        raise_if_stale(problems)

    def sleep(self) -> None:
        with self.phase("sleep"):
            self._call("sleep")

    def wake(self) -> None:
        with self.phase("wake"):
            self._call("wake")

    @contextlib.contextmanager
    def hold(self):
        self._send_only("hold_begin")
        try:
            yield
        finally:
            self._send_only("hold_end")


# ---------------------------------------------------------------------------------------------- specs (rank side)


def process_engine(trainer, launch, options, run_dir, seed: int, long_wait_s: float = float("inf")) -> ProcessEngine:
    """The engine process for a TRL trainer: colocate-rl's vLLM engine as `vllm_engine.from_trainer` builds it for the
    rank, or transformers without vLLM; weight buckets and the check as the engine `options` say. An answer awaited
    longer than `long_wait_s` is reported as an `engine_wait` event (for the watchdog to name the process)."""
    from colocate_rl.rank.adapter.trl import gather_params
    from colocate_rl.telemetry import events

    def note(pid: int, since: float) -> None:
        events.emit(run_dir, events.ENGINE_WAIT, pid=pid, since=round(since, 3))

    accelerator = trainer.accelerator
    if launch.backend == "vllm":
        from colocate_rl.rank.vllm_engine import from_trainer

        spec = vllm_spec(from_trainer(trainer, options, run_dir, seed), accelerator.local_process_index)
    else:
        spec = transformers_spec(trainer, launch.model_dtype, seed)
    return ProcessEngine(
        spec,
        trainer.model,
        gather_params(accelerator),
        bucket_bytes=options.bucket_bytes,
        check_weights=options.check_weights,
        device=accelerator.device,
        processes=options.processes,
        on_long_wait=note,
        long_wait_s=long_wait_s,
    )


def vllm_spec(engine, local_rank: int) -> dict[str, Any]:
    """What the child needs to build colocate-rl's vLLM engine as the rank's `engine` (a VLLMEngine, not started)
    would be built: its LLM arguments and options, the rank's seed, the device."""
    return {
        "kind": "vllm",
        "model_path": engine.model.name_or_path,
        "options": engine.options.to_json(),
        "llm_args": engine.llm_args,
        "seed": (engine.seed + engine.accelerator.process_index) % 2**32,
        "local_rank": local_rank,
        "run_dir": None if engine.run_dir is None else str(engine.run_dir),
        "max_batch": None,
    }


def transformers_spec(trainer, dtype: str, seed: int) -> dict[str, Any]:
    """What the child needs to generate with transformers as `hf_engine.TransformersEngine` does for `trainer`; its
    sampling seeded with `seed` + the rank (as vLLM's is), so that a run samples the same again."""
    tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
    args = trainer.args
    return {
        "kind": "transformers",
        "model_path": trainer.model.name_or_path,
        "dtype": dtype,
        "device": str(trainer.accelerator.device),
        "generation_config": trainer.generation_config,
        "pad_token_id": tokenizer.pad_token_id,
        "max_batch": args.per_device_train_batch_size * args.steps_per_generation,
        "seed": (seed + trainer.accelerator.process_index) % 2**32,
    }


def child_specs(spec: dict[str, Any], processes: int) -> list[dict[str, Any]]:
    """The spec of each of `processes` engine processes sharing a rank's batches: its own seed and, for vLLM, its
    part of the memory share, of the KV budget and of the concurrent sequences (the plan's share counts every
    engine process's weights: `memory.estimate`)."""
    specs = []
    for k in range(processes):
        child = {**spec, "seed": (spec["seed"] + k * SEED_STRIDE) % 2**32}
        if spec["kind"] == "vllm" and processes > 1:
            args, options = dict(spec["llm_args"]), dict(spec["options"])
            if "gpu_memory_utilization" in args:
                args["gpu_memory_utilization"] = args["gpu_memory_utilization"] / processes
            for held in (args, options):
                if held.get("max_num_seqs"):
                    held["max_num_seqs"] = -(-held["max_num_seqs"] // processes)
            if options.get("kv_cache_memory_bytes"):
                options["kv_cache_memory_bytes"] = options["kv_cache_memory_bytes"] // processes
            child.update(llm_args=args, options=options)
        specs.append(child)
    return specs


def split(items: list, parts: int) -> list[list]:
    """`items` in `parts` contiguous parts, in order, their sizes differing by at most one (the first ones larger)."""
    size, extra = divmod(len(items), parts)
    bounds = [k * size + min(k, extra) for k in range(parts + 1)]
    return [items[bounds[k] : bounds[k + 1]] for k in range(parts)]
