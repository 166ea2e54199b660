"""Per-rank memory readings: the driver's view of this rank's GPU (NVML) sampled at ~10 Hz for the
step's peak, torch's allocator counters, or the process RSS on CPU. Readings never raise: a missing
NVML simply leaves the GPU fields out.
"""

from __future__ import annotations

import threading

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


class MemoryProbe:
    """Reads this rank's memory; on GPU a daemon thread tracks the peak between `step_end` calls."""

    def __init__(self, interval_s: float = 0.1):
        import torch

        self.cuda = torch.cuda.is_available()
        self.handle = _nvml_handle(torch.cuda.current_device()) if self.cuda else None
        self.peak = 0
        self._stop = threading.Event()
        if self.handle is not None:
            threading.Thread(target=self._sample, args=(interval_s,), daemon=True).start()

    def _used(self) -> int:
        import pynvml

        return pynvml.nvmlDeviceGetMemoryInfo(self.handle).used

    def _sample(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.peak = max(self.peak, self._used())
            except Exception:
                return

    def step_end(self) -> dict[str, float]:
        """Memory now (right after the optimizer step) and the peak since the last call, in GiB."""
        import torch

        if not self.cuda:
            import psutil

            return {"mem/rss_gib": round(psutil.Process().memory_info().rss / GIB, 3)}
        out = {
            "mem/torch_allocated_gib": round(torch.cuda.memory_allocated() / GIB, 3),
            "mem/torch_reserved_gib": round(torch.cuda.memory_reserved() / GIB, 3),
            "mem/torch_peak_allocated_gib": round(torch.cuda.max_memory_allocated() / GIB, 3),
        }
        torch.cuda.reset_peak_memory_stats()
        if self.handle is not None:
            used = self._used()
            out["mem/gpu_used_gib"] = round(used / GIB, 3)
            out["mem/gpu_peak_gib"] = round(max(self.peak, used) / GIB, 3)
            self.peak = 0
        return out

    def close(self) -> None:
        self._stop.set()
