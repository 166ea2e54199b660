"""A generation engine in a process of its own on the rank's device (`generation.engine_process`), so that the
trainer can train while it generates (`generation.overlap`).

The rank holds a `ProcessEngine`; a child process (spawned, one per rank, ended with the rank) runs `serve`, which
holds the real engine: colocate-rl's vLLM engine with a world of its own (`ChildVLLM`) on a GPU, or transformers with
its own copy of the model (`ChildTransformers`) without vLLM. They talk over one pipe, one command at a time, each
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
import itertools
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

from colocate_rl.errors import EngineProcessError, UserError, one_line
from colocate_rl.rank.engine import Generation, GenerationEngine, Pending, Sampling
from colocate_rl.rank.weights import compare_weights, expected_weights, full_numel, trainer_buckets, weight_buckets

ALIGN = 256  # bytes: each staged tensor starts at a multiple (a view of the buffer as any dtype must be aligned)
POLL_S = 1.0  # how often a rank waiting for its engine process checks that the process is alive


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def staging_bytes(named_params, bucket_bytes: int) -> int:
    """Bytes of the staging buffer: the largest bucket `trainer_buckets` makes, each tensor aligned."""
    sizes = [
        sum(_aligned(full_numel(p) * p.element_size()) for _, p in bucket)
        for bucket in weight_buckets(named_params, bucket_bytes)
    ]
    return max(sizes, default=ALIGN)


def stage(buffer: torch.Tensor, tensors: list[tuple[str, torch.Tensor]]) -> list[tuple[str, str, tuple, int]]:
    """Copy `tensors` into `buffer` (uint8) one after another; their places as (name, dtype, shape, offset)."""
    specs, offset = [], 0
    for name, tensor in tensors:
        flat = tensor.detach().contiguous().view(-1).view(torch.uint8)
        if offset + flat.numel() > buffer.numel():
            raise ValueError(f"the engine's staging buffer ({buffer.numel()} bytes) cannot hold {name}")
        buffer[offset : offset + flat.numel()].copy_(flat)
        specs.append((name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset))
        offset = _aligned(offset + flat.numel())
    if buffer.is_cuda:
        torch.cuda.synchronize(buffer.device)  # the child reads on its own stream, in its own process
    return specs


def fitting(tensors: list[tuple[str, torch.Tensor]], capacity: int) -> list[list[tuple[str, torch.Tensor]]]:
    """`tensors` in consecutive groups that `stage` fits into `capacity` bytes each."""
    groups: list[list[tuple[str, torch.Tensor]]] = [[]]
    used = 0
    for name, tensor in tensors:
        size = _aligned(tensor.numel() * tensor.element_size())
        if groups[-1] and used + size > capacity:
            groups.append([])
            used = 0
        groups[-1].append((name, tensor))
        used += size
    return [g for g in groups if g]


def staged(buffer: torch.Tensor, specs: list[tuple[str, str, tuple, int]]) -> list[tuple[str, torch.Tensor]]:
    """The child's views of what `stage` copied (no copy)."""
    out = []
    for name, dtype, shape, offset in specs:
        dt = getattr(torch, dtype)
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size()
        out.append((name, buffer[offset : offset + nbytes].view(dt).view(shape)))
    return out


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
        self._child_weights_valid = True  # the child's weights equal the last push (or the checkpoint, at start)
        self._merge = None
        self.last_check: list[str] = []

    # ------------------------------------------------------------------ process

    def start(self) -> None:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self._conn, child_end = ctx.Pipe()
        self.process = ctx.Process(target=serve, args=(child_end, self.spec), daemon=True, name="colocate-rl-engine")
        self.process.start()
        child_end.close()
        try:
            info = self._await(-1)
        except EngineProcessError as e:
            raise UserError(f"generation.engine_process: the engine process did not start ({e})") from None
        self.max_model_len = int(info["max_model_len"])
        merge = self._merge_if_adapted()
        named = merge.named_params() if merge is not None else self.model.named_parameters()
        size = staging_bytes(named, self.bucket_bytes)
        self.staging = torch.empty(size, dtype=torch.uint8, device=self.device)
        self._call("stage", self.staging)
        print(
            f"[colocate-rl engine] engine process {self.process.pid} ({self.spec['kind']}) ready; staging buffer "
            f"{size / 2**20:.1f} MiB on {self.device}",
            flush=True,
        )

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.is_alive():
            with contextlib.suppress(OSError, EOFError, EngineProcessError):
                self._conn.send(("stop", next(self._ids), None))
            self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
        self.process = None

    def _died(self) -> EngineProcessError:
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
        self._answers[ident] = (status, value, valid)

    def _await(self, ident: int) -> Any:
        while ident not in self._answers:
            self._receive()
        status, value, valid = self._answers.pop(ident)
        if status == "error":
            raise EngineProcessError(f"the generation engine process failed: {value}")
        self._child_weights_valid = valid
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

    # ------------------------------------------------------------------ the interface

    def submit(self, prompt_ids: list[list[int]], sampling: Sampling) -> Pending:
        if not self._child_weights_valid:
            self.push_weights()  # sleep level 2 dropped them after the last generation
        ident = self._send("generate", (prompt_ids, sampling))
        return Pending(lambda: self._await(ident))

    def generate(self, prompt_ids: list[list[int]], sampling: Sampling) -> Generation:
        return self.submit(prompt_ids, sampling).result()

    def _merge_if_adapted(self):
        from accelerate.utils import is_peft_model

        if self._merge is None and is_peft_model(self.model):
            from colocate_rl.rank.adapter.peft import AdapterMerge
            from colocate_rl.rank.weights import vllm_name

            self._merge = AdapterMerge(self.model, vllm_name)
        return self._merge

    def push_weights(self) -> None:
        """Stage the trainer's weights bucket by bucket and have the child load each; then check them."""
        with self.phase("weight_sync"):
            self._call("begin_push")
            for bucket in trainer_buckets(self.model, self.bucket_bytes, self.gather, self._merge_if_adapted()):
                self._call("load", stage(self.staging, bucket))
            if self.check:
                with self.phase("weight_check"):
                    self.check_weights()
            self._call("end_push")

    def check_weights(self) -> None:
        from colocate_rl.rank.vllm_engine import raise_if_stale

        expected = expected_weights(self.model, self.gather, 1, self._merge_if_adapted())
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
        self._call("hold_begin")
        try:
            yield
        finally:
            self._call("hold_end")


# ---------------------------------------------------------------------------------------------- specs (rank side)


def vllm_spec(engine, local_rank: int, run_dir) -> dict[str, Any]:
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
    }


def transformers_spec(trainer, dtype: str) -> dict[str, Any]:
    """What the child needs to generate with transformers as `hf_engine.TransformersEngine` does for `trainer`."""
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
    }


# ---------------------------------------------------------------------------------------------- the child


class ChildTransformers:
    """transformers' `generate` on the child's own copy of the model (loaded from the trainer's path, then given the
    trainer's weights by every push)."""

    def __init__(self, spec: dict[str, Any]):
        from transformers import AutoModelForCausalLM

        self.device = torch.device(spec["device"])
        self.model = AutoModelForCausalLM.from_pretrained(spec["model_path"], dtype=getattr(torch, spec["dtype"]))
        self.model.to(self.device).eval()
        self.params = dict(self.model.named_parameters())
        self.base_config, self.pad_token_id = spec["generation_config"], spec["pad_token_id"]
        eos = self.base_config.eos_token_id
        self.eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        self.max_model_len = getattr(self.model.config, "max_position_embeddings", 2**62)
        self.weights_valid = True

    def load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for name, value in tensors:
                if name not in self.params:
                    raise KeyError(f"the engine's model has no parameter {name}")
                self.params[name].copy_(value)

    def compare(self, tensors: list[tuple[str, torch.Tensor]]) -> list[str]:
        return compare_weights(dict(tensors), self.params)

    def generate(self, prompt_ids: list[list[int]], sampling: Sampling) -> Generation:
        from colocate_rl.rank.hf_engine import generate_with

        return generate_with(
            self.model, prompt_ids, sampling, self.base_config, self.pad_token_id, self.eos_ids, self.device
        )

    def begin_push(self) -> None:
        return None

    def end_push(self) -> None:
        return None

    def sleep(self) -> None:
        return None

    def wake(self) -> None:
        return None

    def hold(self):
        return contextlib.nullcontext()


def child_vllm(spec: dict[str, Any]):
    """colocate-rl's VLLMEngine in the child: a world of one process (vLLM's external launcher on a free port, the
    rank's GPU), its weights loaded from the staging buffer instead of a trainer model in the same process."""
    from types import SimpleNamespace

    from colocate_rl.plan.engine_options import EngineOptions
    from colocate_rl.rank.adapter import vllm as vl
    from colocate_rl.rank.vllm_engine import VLLMEngine

    class ChildVLLM(VLLMEngine):
        def begin_push(self) -> None:
            if "weights" in self._asleep:
                self._wake(["weights"])

        def load(self, tensors) -> None:
            vl.engine_model(self.llm).load_weights(tensors)
            torch.cuda.synchronize()  # the rank overwrites the buffer once this answer arrives

        def compare(self, tensors) -> list[str]:
            return compare_weights(dict(tensors), dict(vl.engine_model(self.llm).named_parameters()))

        def end_push(self) -> None:
            self._weights_valid = True
            self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights

        @property
        def weights_valid(self) -> bool:
            return self._weights_valid

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(_free_port())  # the rank's own port belongs to the trainer's process group
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    accelerator = SimpleNamespace(
        process_index=0, local_process_index=spec["local_rank"], num_processes=1, wait_for_everyone=lambda: None
    )
    torch.cuda.set_device(spec["local_rank"])
    engine = ChildVLLM(
        SimpleNamespace(name_or_path=spec["model_path"]),
        accelerator,
        EngineOptions.from_json(spec["options"]),
        {**spec["llm_args"], "tensor_parallel_size": 1},
        lambda params: contextlib.nullcontext(),
        run_dir=None if spec["run_dir"] is None else Path(spec["run_dir"]),
        seed=spec["seed"],
    )
    engine.start()
    return engine


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _end_with_parent() -> None:
    """Linux: this process gets SIGTERM when the rank that started it dies."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def serve(conn, spec: dict[str, Any]) -> None:
    """The engine process: build the engine, then answer commands until `stop` or until the rank goes away."""
    _end_with_parent()
    try:
        engine = child_vllm(spec) if spec["kind"] == "vllm" else ChildTransformers(spec)
    except BaseException as e:
        traceback.print_exc()
        conn.send((-1, "error", one_line(e), False))
        return
    conn.send((-1, "ok", {"max_model_len": engine.max_model_len}, engine.weights_valid))
    buffer, holds = None, []
    while True:
        try:
            op, ident, args = conn.recv()
        except (EOFError, OSError):
            return  # the rank is gone
        try:
            result = None
            if op == "stage":
                buffer = args
            elif op == "generate":
                result = engine.generate(*args)
            elif op == "load":
                engine.load(staged(buffer, args))
            elif op == "check":
                result = engine.compare(staged(buffer, args))
            elif op in ("begin_push", "end_push", "sleep", "wake"):
                getattr(engine, op)()
            elif op == "hold_begin":
                holds.append(engine.hold())
                holds[-1].__enter__()
            elif op == "hold_end":
                holds.pop().__exit__(None, None, None)
            elif op == "stop":
                conn.send((ident, "ok", None, True))
                return
            else:
                raise ValueError(f"unknown command {op!r}")
            conn.send((ident, "ok", result, engine.weights_valid))
        except Exception as e:
            traceback.print_exc()
            sys.stderr.flush()
            conn.send((ident, "error", one_line(e), False))
