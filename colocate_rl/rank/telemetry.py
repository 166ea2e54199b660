"""Per-rank telemetry: where each step's time and memory go.

`Telemetry.instrument(trainer)` hands its `phase` timer to the trainer (colocate-rl's TRL subclass times
`train`, `prepare`, `generate` and `reward`: colocate_rl.rank.adapter.trl) and to its generation engine
(`weight_sync`, `weight_check`, `wake`, `sleep`, `offload`, `reload`), so that every phase of a step is timed
(exclusive seconds; phases nest, e.g. `generate` contains `wake`, `weight_sync` and `sleep`) and the memory is
read at each phase boundary. The optimizer step is wrapped on the optimizer (or DeepSpeed engine) itself. A daemon
thread samples memory at ~10 Hz for the step's peak. Each rank writes `timeline/rank<N>.jsonl`
(samples, phase edges, step ends); `step_end()` returns the step's metrics, which the worker merges
into TRL's logs (so they reach metrics.jsonl and any `report_to` backend).

Memory is the driver's view of this rank's GPU (NVML, which includes vLLM's pools) on GPU, or the
process RSS on CPU, plus torch's own counters on GPU (the fields: docs/guide/telemetry.md). Nothing here raises
into training: without NVML the GPU fields are left out.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from colocate_rl.rundir import RunDir
from colocate_rl.telemetry.timeline import Timeline

GIB = 2**30


def _nvml_handle(device_index: int):
    """NVML handle of the CUDA device torch calls `device_index` (matched by UUID, else by index)."""
    try:
        import pynvml
        import torch

        pynvml.nvmlInit()
        uuid = getattr(torch.cuda.get_device_properties(device_index), "uuid", None)
        if uuid is not None:
            try:
                return pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
            except pynvml.NVMLError:
                pass
        return pynvml.nvmlDeviceGetHandleByIndex(device_index)
    except Exception:
        return None


class Telemetry:
    """Phase timer, memory reader and timeline writer of one rank. `clock` times the phases (seconds; tests pass
    their own). A resumed run (`resume`) appends to the rank's timeline, its times counted from the same t0."""

    def __init__(
        self,
        run_dir: Path,
        interval_s: float = 0.1,
        clock: Callable[[], float] = time.perf_counter,
        resume: bool = False,
    ):
        self.run_dir, self.interval_s, self.clock, self.resume = Path(run_dir), interval_s, clock, resume
        self.cuda = False
        self.handle = None
        self._process = None  # psutil.Process, made on first CPU read
        self.t0 = time.time()
        self._lines: list[str] = []
        self._file = None
        self._stop = threading.Event()
        self._stack: list[str] = []
        self._mark = self.clock()
        self._step_start = self._mark
        self._exclusive: dict[str, float] = defaultdict(float)
        self._phase_end_mem: dict[str, float] = {}
        self._phase_end_torch: dict[str, float] = {}
        self._peak = 0.0
        self._retries = 0  # the allocator's num_alloc_retries at the last step's end
        self._overhead = 0.0
        self.pending: dict[str, Any] = {}

    # ------------------------------------------------------------------ memory

    def read_memory(self) -> float | None:
        """GiB in use: NVML used memory of this rank's GPU, or this process's RSS on CPU."""
        try:
            if self.handle is not None:
                import pynvml

                return pynvml.nvmlDeviceGetMemoryInfo(self.handle).used / GIB
            if not self.cuda:
                if self._process is None:
                    import psutil

                    self._process = psutil.Process()
                return self._process.memory_info().rss / GIB
        except Exception:
            return None
        return None

    def _record(self, **line: Any) -> float | None:
        mem = self.read_memory()
        if mem is not None:
            self._peak = max(self._peak, mem)
            line["mem"] = round(mem, 3)
        line["t"] = round(time.time() - self.t0, 4)
        self._lines.append(json.dumps(line))
        return mem

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._record()

    # ------------------------------------------------------------------ phases

    def _boundary(self) -> float:
        """Charge the time since the last boundary to the innermost open phase (or 'other')."""
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        now = self.clock()
        self._exclusive[self._stack[-1] if self._stack else "other"] += now - self._mark
        self._mark = now
        return now

    @contextmanager
    def phase(self, name: str):
        """Time `name` (exclusive of nested phases) and read memory at both edges."""
        start = self._boundary()
        self._stack.append(name)
        self._record(phase=name, edge="start")
        self._overhead += self.clock() - start
        try:
            yield
        finally:
            end = self._boundary()
            self._stack.pop()
            mem = self._record(phase=name, edge="end")
            if mem is not None:
                self._phase_end_mem[name] = mem
            if self.cuda:
                import torch

                self._phase_end_torch[name] = torch.cuda.memory_allocated() / GIB
            self._overhead += self.clock() - end

    def wrap(self, obj: Any, attr: str, name: str) -> None:
        """Replace `obj.attr` (a method) by a version timed as phase `name`; absent attributes are skipped."""
        fn = getattr(obj, attr, None)
        if fn is None:
            return

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            with self.phase(name):
                return fn(*args, **kwargs)

        setattr(obj, attr, timed)

    # ------------------------------------------------------------------ lifecycle

    def instrument(self, trainer) -> None:
        """Open this rank's timeline, start the sampler and hand the phase timer to the trainer and its engine."""
        import torch

        self.cuda = torch.cuda.is_available()
        self.handle = _nvml_handle(torch.cuda.current_device()) if self.cuda else None
        rank = trainer.accelerator.process_index
        path = RunDir(self.run_dir).timeline(rank)
        path.parent.mkdir(exist_ok=True)
        head = Timeline.read(path) if self.resume and path.is_file() and path.stat().st_size else None
        if head is not None and head.t0:
            self.t0 = head.t0  # the resumed steps continue the rank's time axis
            self._file = path.open("a")
        else:
            self._file = path.open("w")
            device = f"cuda:{torch.cuda.current_device()}" if self.cuda else "cpu"
            head = {"rank": rank, "device": device, "unit": "GiB", "t0": self.t0, "pid": os.getpid()}
            self._file.write(json.dumps(head) + "\n")
        trainer.phase = self.phase  # colocate-rl's trainer and engine time their own phases with it
        trainer.engine.phase = self.phase
        threading.Thread(target=self._sample, daemon=True).start()

    def instrument_optimizer(self, trainer) -> None:
        """Wrap the optimizer step (DeepSpeed: the engine's step, which runs inside backward)."""
        if getattr(trainer, "is_deepspeed_enabled", False):
            self.wrap(trainer.model_wrapped, "step", "optimizer")
        elif trainer.optimizer is not None:
            self.wrap(trainer.optimizer, "step", "optimizer")

    def step_begin(self) -> None:
        self._boundary()
        self._exclusive.clear()
        self._step_start = self._mark

    def step_end(self, step: int) -> dict[str, Any]:
        """Close the step: its phase seconds, memory at step end / peak; the timeline is flushed."""
        now = self._boundary()
        begin = self.clock()
        mem = self._record(step_end=step)
        metrics: dict[str, Any] = {"time/step_s": round(now - self._step_start, 4)}
        metrics.update({f"time/{k}_s": round(v, 4) for k, v in self._exclusive.items()})
        if self.cuda and self.handle is not None:
            import torch

            metrics["mem/gpu_used_gib"] = round(mem, 3) if mem is not None else None
            metrics["mem/gpu_peak_gib"] = round(self._peak, 3)
            metrics.update({f"mem/{k}_end_gib": round(v, 3) for k, v in self._phase_end_mem.items()})
            metrics.update({f"mem/{k}_end_torch_gib": round(v, 3) for k, v in self._phase_end_torch.items()})
            metrics["mem/torch_allocated_gib"] = round(torch.cuda.memory_allocated() / GIB, 3)
            metrics["mem/torch_reserved_gib"] = round(torch.cuda.memory_reserved() / GIB, 3)
            metrics["mem/torch_peak_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 3)
            retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)
            metrics["mem/alloc_retries"], self._retries = retries - self._retries, retries
            torch.cuda.reset_peak_memory_stats()
        elif mem is not None:
            metrics["mem/rss_gib"] = round(mem, 3)
            metrics["mem/rss_peak_gib"] = round(self._peak, 3)
        self._peak = mem or 0.0
        self._phase_end_mem.clear()
        self._phase_end_torch.clear()
        if self._file is not None:
            lines, self._lines = self._lines, []
            self._file.write("\n".join(lines) + "\n")
            self._file.flush()
        self._overhead += self.clock() - begin
        metrics["telemetry/overhead_s"] = round(self._overhead, 5)
        self._overhead = 0.0
        return {k: v for k, v in metrics.items() if v is not None}

    def close(self) -> None:
        self._stop.set()
        if self._file is not None:
            self._file.write("\n".join(self._lines) + ("\n" if self._lines else ""))
            self._file.close()
            self._file = None
