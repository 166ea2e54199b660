"""The engine process's side of `colocate_rl.rank.engine_process`: `serve` builds the engine the rank asked for and
answers its commands one at a time until `stop` or until the rank goes away (the pipe closes; on Linux the process
also gets SIGTERM when the rank dies). A command that raises is answered with its one-line error and the process
keeps serving; its traceback goes to the rank's log (this process writes to the rank's stdout and stderr).

Engines: `ChildTransformers` (transformers on its own copy of the model, loaded from the trainer's path) and
`child_vllm` (colocate-rl's VLLMEngine in a world of one process on the rank's GPU). Both load weights from the
staging buffer the rank shares (`weights.stage` / `weights.staged`).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import resource
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from colocate_rl.errors import one_line
from colocate_rl.launch.mps import engine_client_settings
from colocate_rl.rank.engine import Generation, Sampling
from colocate_rl.rank.weights import compare_weights, open_shared, staged
from colocate_rl.telemetry import events


class ChildTransformers:
    """transformers' `generate` on the child's own copy of the model (loaded from the trainer's path, then given the
    trainer's weights by every push)."""

    def __init__(self, spec: dict[str, Any]):
        from transformers import AutoModelForCausalLM

        self.device = torch.device(spec["device"])
        torch.manual_seed(spec["seed"])
        self.model = AutoModelForCausalLM.from_pretrained(spec["model_path"], dtype=getattr(torch, spec["dtype"]))
        self.model.to(self.device).eval()
        self.params = dict(self.model.named_parameters())
        self.base_config, self.pad_token_id = spec["generation_config"], spec["pad_token_id"]
        eos = self.base_config.eos_token_id
        self.eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        self.max_model_len = getattr(self.model.config, "max_position_embeddings", 2**62)
        self.weights_valid = True
        self.buffer = None

    def stage(self, buffer: torch.Tensor | bytes) -> None:
        """`buffer`: the rank's staging buffer, or on a GPU its `weights.shared_handle`."""
        if isinstance(buffer, bytes):
            buffer = open_shared(buffer, self.device.index if self.device.index is not None else 0)
        self.buffer = buffer

    def load(self, specs) -> None:
        with torch.no_grad():
            for name, value in staged(self.buffer, specs):
                if name not in self.params:
                    raise KeyError(f"the engine's model has no parameter {name}")
                self.params[name].copy_(value)

    def compare(self, specs) -> list[str]:
        return compare_weights(dict(staged(self.buffer, specs)), self.params)

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
    """colocate-rl's VLLMEngine in the child, its weights loaded from the staging buffer instead of a trainer model
    in the same process. vLLM's engine core runs in this process (a world of one process: vLLM's external launcher
    on a free port, the rank's GPU) or, with the option `multiprocessing`, in a process vLLM starts beside it on the
    rank's GPU, where the worker extension `adapter.vllm.StagedWeightsWorker` loads and compares the weights."""
    from types import SimpleNamespace

    from colocate_rl.plan.engine_options import EngineOptions
    from colocate_rl.rank.adapter import vllm as vl
    from colocate_rl.rank.vllm_engine import VLLMEngine

    class ChildVLLM(VLLMEngine):
        buffer = None

        def llm_kwargs(self) -> dict[str, Any]:
            kwargs = super().llm_kwargs()
            if self.options.multiprocessing:  # vLLM's own executor: one worker in its engine-core process
                del kwargs["distributed_executor_backend"]
                kwargs["worker_extension_cls"] = vl.WORKER_EXTENSION
            return kwargs

        def stage(self, handle: bytes) -> None:
            if self.options.multiprocessing:
                problems = self.llm.collective_rpc("colocate_rl_stage", args=(handle,))[0]
                if problems:
                    raise RuntimeError("; ".join(problems))
            else:
                self.buffer = open_shared(handle, torch.cuda.current_device())

        def begin_push(self) -> None:
            if "weights" in self._asleep:
                self._wake(["weights"])

        def load(self, specs) -> None:
            if self.options.multiprocessing:
                self.llm.collective_rpc("colocate_rl_load", args=(specs,))
                return
            vl.engine_model(self.llm).load_weights(staged(self.buffer, specs))
            torch.cuda.synchronize()  # the rank overwrites the buffer once this answer arrives

        def compare(self, specs) -> list[str]:
            if self.options.multiprocessing:
                return self.llm.collective_rpc("colocate_rl_compare", args=(specs,))[0]
            return compare_weights(dict(staged(self.buffer, specs)), dict(vl.engine_model(self.llm).named_parameters()))

        def end_push(self) -> None:
            self._weights_valid = True
            self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights

        @property
        def weights_valid(self) -> bool:
            return self._weights_valid

    options = EngineOptions.from_json(spec["options"])
    if options.multiprocessing:
        multiprocessing.current_process().daemon = False  # may start vLLM's engine core (`_exit` ends it)
    torch.cuda.set_device(spec["local_rank"])
    solo_world(os.environ, spec["local_rank"], options.multiprocessing)
    accelerator = SimpleNamespace(
        process_index=0, local_process_index=spec["local_rank"], num_processes=1, wait_for_everyone=lambda: None
    )
    engine = ChildVLLM(
        SimpleNamespace(name_or_path=spec["model_path"]),
        accelerator,
        options,
        {**spec["llm_args"], "tensor_parallel_size": 1},
        lambda params: contextlib.nullcontext(),
        run_dir=None if spec["run_dir"] is None else Path(spec["run_dir"]),
        seed=spec["seed"],
    )
    engine.start()
    if options.multiprocessing:
        pids = ", ".join(str(p.pid) for p in multiprocessing.active_children())
        events.log_line(f"[colocate-rl engine] vLLM's engine core runs in process {pids}")
    return engine


def solo_world(environ, local_rank: int, core_process: bool) -> None:
    """Make `environ` (this process's, after it chose its GPU) that of a world of one process for vLLM: torchrun's
    TORCHELASTIC_* variables removed (with TORCHELASTIC_USE_AGENT_STORE torch waits forever for torchrun's store on
    the new port: seen on the H200), a free local port (the rank's own belongs to the trainer's process group). vLLM's
    engine core in this process, or (`core_process`) in a process of its own that sees only the rank's GPU
    (`local_rank` of this process's visible ones), which vLLM's own executor then takes as its GPU 0."""
    for name in [n for n in environ if n.startswith("TORCHELASTIC_")]:
        del environ[name]
    environ["MASTER_ADDR"] = "127.0.0.1"
    environ["MASTER_PORT"] = str(_free_port())
    environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if core_process else "0"
    if core_process:
        visible = environ.get("CUDA_VISIBLE_DEVICES")
        environ["CUDA_VISIBLE_DEVICES"] = visible.split(",")[local_rank] if visible else str(local_rank)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _end_with_parent() -> None:
    """This process (and what it started) ends when the rank that started it dies: SIGTERM on Linux."""
    signal.signal(signal.SIGTERM, lambda signum, frame: _exit(128 + signum))
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _exit(code: int) -> None:
    """End the processes this one started (vLLM's engine core: nothing else ends it), then this one without
    interpreter teardown (vLLM's can hang or crash after sleep mode, vLLM #16993)."""
    children = multiprocessing.active_children()
    for child in children:
        child.terminate()
    for child in children:
        child.join(timeout=10)
        if child.is_alive():
            child.kill()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def usage_since(before: resource.struct_rusage, started: float) -> dict[str, float]:
    """This process's wall and CPU seconds (all threads) since `started`/`before`, and its involuntary context
    switches: the times the OS gave its CPU to another runnable thread (CPU contention, which CPU time cannot show where
    a wait on the GPU spins)."""
    now = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "generate_s": time.perf_counter() - started,
        "cpu_s": now.ru_utime + now.ru_stime - before.ru_utime - before.ru_stime,
        "preempted": now.ru_nivcsw - before.ru_nivcsw,
    }


def serve(conn, spec: dict[str, Any]) -> None:
    """The engine process: build the engine, then answer commands until `stop` or until the rank goes away."""
    _end_with_parent()
    if (settings := engine_client_settings()) is not None:
        events.log_line(f"[colocate-rl engine] engine process {os.getpid()}: MPS client settings {settings}")
    try:
        engine = child_vllm(spec) if spec["kind"] == "vllm" else ChildTransformers(spec)
    except BaseException as e:
        traceback.print_exc()
        conn.send((-1, "error", one_line(e), False))
        _exit(1)
    conn.send((-1, "ok", {"max_model_len": engine.max_model_len}, engine.weights_valid))
    holds = []
    while True:
        try:
            op, ident, args = conn.recv()
        except (EOFError, OSError):
            _exit(0)  # the rank is gone
        try:
            result = None
            if op == "stage":
                engine.stage(args)
            elif op == "generate":
                before, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
                result = engine.generate(*args)
                result.engine_usage = usage_since(before, started)
            elif op == "load":
                engine.load(args)
            elif op == "check":
                result = engine.compare(args)
            elif op in ("begin_push", "end_push", "sleep", "wake"):
                getattr(engine, op)()
            elif op == "hold_begin":
                holds.append(engine.hold())
                holds[-1].__enter__()
            elif op == "hold_end":
                holds.pop().__exit__(None, None, None)
            elif op == "stop":
                conn.send((ident, "ok", None, True))
                _exit(0)
            else:
                raise ValueError(f"unknown command {op!r}")
            conn.send((ident, "ok", result, engine.weights_valid))
        except Exception as e:
            traceback.print_exc()
            sys.stderr.flush()
            conn.send((ident, "error", one_line(e), False))
