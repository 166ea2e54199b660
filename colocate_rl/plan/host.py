"""What the launching machine has: GPUs, vLLM, CPU cores, CUDA MPS. Cheap to call: no torch import."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from dataclasses import dataclass

MPS_CONTROL = "nvidia-cuda-mps-control"  # NVIDIA's CUDA MPS control daemon (generation.mps)
# NVIDIA's, read as a client's CUDA context is made: its scheduling priority (0 normal, 1 below normal), and the
# percentage of the GPU's SMs its kernels may run on (at most the server's, 100 by default)
PRIORITY = "CUDA_MPS_CLIENT_PRIORITY"
THREADS = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
ENGINE_PRIORITY = "COLOCATE_RL_ENGINE_MPS_PRIORITY"  # what an engine process sets PRIORITY to (launch/mps.py)
ENGINE_THREADS = "COLOCATE_RL_ENGINE_MPS_THREAD_PERCENTAGE"  # and THREADS
# what changes how MPS runs a client's kernels
MPS_SETTINGS = (PRIORITY, THREADS, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", ENGINE_PRIORITY, ENGINE_THREADS)


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_gib: float


@dataclass(frozen=True)
class Host:
    """The facts planning depends on. `assumed` marks a host described by `--gpus N`, not detected."""

    gpus: tuple[Gpu, ...] = ()
    has_vllm: bool = False
    cpu_count: int = 1
    assumed: bool = False
    ram_gib: float | None = None  # this machine's memory; None for a host described on the command line
    mps_control: bool = False  # MPS_CONTROL is on PATH (generation.mps)
    mps_pipe_set: bool = False  # CUDA_MPS_PIPE_DIRECTORY is set: an MPS daemon of the user's serves the run
    mps_settings: tuple[str, ...] = ()  # NAME=value of the MPS client settings in the environment (launch/mps.py)

    @property
    def gpu_count(self) -> int:
        return len(self.gpus)


def _gpus_from_nvml() -> tuple[Gpu, ...] | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else name
            gpus.append(Gpu(name, pynvml.nvmlDeviceGetMemoryInfo(handle).total / 2**30))
        return tuple(gpus)
    finally:
        pynvml.nvmlShutdown()


def _gpus_from_smi() -> tuple[Gpu, ...]:
    if shutil.which("nvidia-smi") is None:
        return ()
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    gpus = []
    for line in out.strip().splitlines():
        name, _, mib = line.rpartition(",")
        gpus.append(Gpu(name.strip(), float(mib) / 1024))
    return tuple(gpus)


def _visible(gpus: tuple[Gpu, ...]) -> tuple[Gpu, ...]:
    """Respect CUDA_VISIBLE_DEVICES (indices only)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return gpus
    picked = []
    for token in visible.split(","):
        token = token.strip()
        if token.isdigit() and int(token) < len(gpus):
            picked.append(gpus[int(token)])
        elif token and not token.isdigit() and not token.startswith("-"):
            return gpus  # UUIDs: trust the driver's count
    return tuple(picked)


def detect_host() -> Host:
    """Detect GPUs (NVML, else nvidia-smi), whether vLLM is importable, CPU cores and memory."""
    import psutil

    gpus = _gpus_from_nvml()
    if gpus is None:
        gpus = _gpus_from_smi()
    return Host(
        gpus=_visible(gpus),
        has_vllm=importlib.util.find_spec("vllm") is not None,
        cpu_count=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1),
        ram_gib=psutil.virtual_memory().total / 2**30,
        mps_control=shutil.which(MPS_CONTROL) is not None,
        mps_pipe_set=bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")),
        mps_settings=tuple(f"{k}={v}" for k, v in sorted(os.environ.items()) if k in MPS_SETTINGS),
    )


def assumed_host(gpus: int, memory_gib: float = 80.0, cpu_count: int = 32) -> Host:
    """A host described on the command line (`--gpus N`): N GPUs with vLLM, e.g. a login node planning a job."""
    return Host(
        gpus=tuple(Gpu("assumed GPU", memory_gib) for _ in range(gpus)),
        has_vllm=gpus > 0,
        cpu_count=cpu_count,
        assumed=True,
        mps_control=gpus > 0,  # NVIDIA's driver utilities, as on the GPU nodes it describes
    )


def planning_host(gpus: int | None = None, gpu_memory_gib: float | None = None, detect=detect_host) -> Host:
    """The host to plan for: `gpus` assumed GPUs of `gpu_memory_gib` (80 by default) — e.g. a login node planning a
    job — or the detected one, its GPUs' memory replaced by `gpu_memory_gib` when given."""
    if gpus is not None:
        return assumed_host(gpus, gpu_memory_gib or 80.0)
    host = detect()
    if gpu_memory_gib and host.gpus:
        from dataclasses import replace

        host = replace(host, gpus=tuple(replace(g, memory_gib=gpu_memory_gib) for g in host.gpus))
    return host
