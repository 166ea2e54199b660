"""A generation engine in a process of its own on the rank's device (`generation.engine_process`), so that the
trainer can train while it generates (`generation.overlap`).

The rank holds a `ProcessEngine`; a child process (spawned, one per rank, ended with the rank) runs
`colocate_rl.rank.engine_server.serve`, which holds the real engine: colocate-rl's vLLM engine with a world of its
own on a GPU, or transformers with its own copy of the model without vLLM. They talk over one pipe, one command at a time, each
answer tagged with its command's id: `submit` sends a generation and returns at once, `Pending.result()` waits.

Weights do not pass through the host: at start the rank shares one staging buffer (the size of the largest weight
bucket) with the child — a CUDA IPC handle on a GPU, shared memory on CPU (torch.multiprocessing) — then for each
bucket of `weights.trainer_buckets` copies the tensors into it and has the child load them from there. The weight
check stages the trainer's tensors the same way and the child compares its own with them.

What can fail: the child not starting (UserError with the child's own line), the child dying or raising
(EngineProcessError naming it; its traceback is in the rank's log), stale weights (StaleWeightsError).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import time
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

STOP_S = 30.0  # how long `stop` waits for the engine process to exit before it terminates it
POLL_S = 1.0  # how often a rank waiting for its engine process checks that the process is alive


class ProcessEngine(GenerationEngine):
    """The rank's side: the engine process's lifecycle, commands and weight staging."""

    def __init__(self, spec: dict[str, Any], model, gather, *, bucket_bytes: int, check_weights: bool, device):
        """`spec`: what `serve` builds (`vllm_spec` / `transformers_spec`); `model`: the trainer's (unwrapped)
        model, whose weights are pushed; `gather(params)`: makes ZeRO-3 parameters whole."""
        self.spec, self.model, self.gather = spec, model, gather
        self.bucket_bytes, self.check, self.device = bucket_bytes, check_weights, torch.device(device)
        self.returns_logprobs = spec["kind"] == "vllm"
        self.max_batch = spec.get("max_batch")
        self.max_model_len = 2**62
        self.process = None
        self._conn = None
        self._ids = itertools.count()
        self._answers: dict[int, tuple[str, Any, bool]] = {}
        self._unawaited: set[int] = set()  # commands whose answers nobody waits for (`_send_only`)
        self._child_weights_valid = True  # the child's weights equal the last push (or the checkpoint, at start)
        self.last_check: list[str] = []

    # ------------------------------------------------------------------ process

    def start(self) -> None:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self._conn, child_end = ctx.Pipe()
        from colocate_rl.rank.engine_server import serve

        self.process = ctx.Process(target=serve, args=(child_end, self.spec), daemon=True, name="colocate-rl-engine")
        self.process.start()
        child_end.close()
        try:
            info = self._await(-1)
        except EngineProcessError as e:
            raise UserError(f"generation.engine_process: the engine process did not start ({e})") from None
        self.max_model_len = int(info["max_model_len"])
        named = self.merge.named_params() if self.merge is not None else self.model.named_parameters()
        size = staging_bytes(named, self.bucket_bytes)
        self.staging = torch.empty(size, dtype=torch.uint8, device=self.device)
        self._call("stage", shared_handle(self.staging) if self.staging.is_cuda else self.staging)
        print(
            f"[colocate-rl engine] engine process {self.process.pid} ({self.spec['kind']}) ready; staging buffer "
            f"{size / 2**20:.1f} MiB on {self.device}",
            flush=True,
        )

    def stop(self) -> None:
        if self.process is None:
            return
        started, how = time.perf_counter(), "stopped"
        if self.process.is_alive():
            with contextlib.suppress(OSError, EOFError, EngineProcessError):
                self._conn.send(("stop", next(self._ids), None))
            self._drain_until_exit(started + STOP_S)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=10)
            how = "terminated"
        if self.process.is_alive():
            self.process.kill()
            how = "killed"
        print(f"[colocate-rl engine] engine process {how} in {time.perf_counter() - started:.1f} s", flush=True)
        self.process = None

    def _drain_until_exit(self, deadline: float) -> None:
        """Read and drop the answers nobody waits for any more (a generation taken ahead for a step that will not
        run) until the process exits: one bigger than the pipe's buffer would block the process's send, and its
        exit, forever (found on the H200: every overlapped run's stop waited out its 30 s)."""
        while self.process.is_alive() and time.perf_counter() < deadline:
            try:
                if self._conn.poll(0.05):
                    self._conn.recv()
            except (EOFError, OSError):
                self.process.join(timeout=max(0.0, deadline - time.perf_counter()))
                return

    def _died(self) -> EngineProcessError:
        if self.process is not None:
            self.process.join(timeout=10)  # reap it: its exit code is known only then (the pipe may close first)
        code = self.process.exitcode if self.process is not None else None
        return EngineProcessError(
            f"the generation engine process (pid {getattr(self.process, 'pid', '?')}) ended"
            + (f" with exit code {code}" if code is not None else "")
            + "; its error is above in this log"
        )

    def _receive(self) -> None:
        while not self._conn.poll(POLL_S):
            if not self.process.is_alive() and not self._conn.poll(0):
                raise self._died()
        try:
            ident, status, value, valid = self._conn.recv()
        except (EOFError, OSError):
            raise self._died() from None
        if ident in self._unawaited:
            self._unawaited.discard(ident)
            self._check_answer(status, value, valid)
        else:
            self._answers[ident] = (status, value, valid)

    def _check_answer(self, status: str, value: Any, valid: bool) -> None:
        if status == "error":
            raise EngineProcessError(f"the generation engine process failed: {value}")
        self._child_weights_valid = valid

    def _await(self, ident: int) -> Any:
        while ident not in self._answers:
            self._receive()
        status, value, valid = self._answers.pop(ident)
        self._check_answer(status, value, valid)
        return value

    def _send(self, op: str, args: Any = None) -> int:
        ident = next(self._ids)
        try:
            self._conn.send((op, ident, args))
        except (OSError, EOFError):
            raise self._died() from None
        return ident

    def _call(self, op: str, args: Any = None) -> Any:
        return self._await(self._send(op, args))

    def _send_only(self, op: str) -> None:
        """A command not waited for: its answer would queue behind a generation in flight (overlap's next batch);
        an error in it is raised at the next wait."""
        self._unawaited.add(self._send(op))

    # ------------------------------------------------------------------ the interface

    def submit(self, prompt_ids: list[list[int]], sampling: Sampling) -> Pending:
        if not self._child_weights_valid:
            self.push_weights()  # sleep level 2 dropped them after the last generation
        ident = self._send("generate", (prompt_ids, sampling))
        return Pending(lambda: self._await(ident))

    def generate(self, prompt_ids: list[list[int]], sampling: Sampling) -> Generation:
        return self.submit(prompt_ids, sampling).result()

    @functools.cached_property
    def merge(self):
        """With LoRA: the adapted model as the engine holds it (`weights.adapter_merge`, built once); else None."""
        return adapter_merge(self.model)

    def push_weights(self) -> None:
        """Stage the trainer's weights bucket by bucket and have the child load each; then check them."""
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
            problems += self._call("check", stage(self.staging, group))
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


def process_engine(trainer, launch, options, run_dir, seed: int) -> ProcessEngine:
    """The engine process for a TRL trainer: colocate-rl's vLLM engine as `vllm_engine.from_trainer` builds it for the
    rank, or transformers without vLLM; weight buckets and the check as the engine `options` say."""
    from colocate_rl.rank.adapter.trl import gather_params

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
