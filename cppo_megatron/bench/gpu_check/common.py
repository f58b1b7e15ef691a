"""Small helpers the checks share: device sync, peak memory, finite numbers, quiet megatron."""

from __future__ import annotations

__all__ = ["finite", "peak_memory", "quiet_megatron", "rss_mib", "sync_device"]

import contextlib
import math
import resource
import warnings
from typing import TypeGuard

import torch


def sync_device(device: str) -> None:
    """Wait for queued kernels on ``device`` ("cuda"); nothing to wait for on the CPU."""
    if device == "cuda":
        torch.cuda.synchronize()


def rss_mib() -> float:
    """This process's peak resident memory so far, MiB."""
    # ru_maxrss is KiB on Linux: the process's high-water mark, which never decreases
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


@contextlib.contextmanager
def peak_memory(device: str, box: dict):
    """Measure the peak memory of the ``with`` body into ``box`` (``peak_memory_mib`` and
    ``memory_kind``): CUDA's max allocated on "cuda", the process's peak RSS on the CPU."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    try:
        yield
    finally:
        if device == "cuda":
            torch.cuda.synchronize()
            box["peak_memory_mib"] = torch.cuda.max_memory_allocated() / 2**20
            box["memory_kind"] = "CUDA max_memory_allocated during this check (this process)"
        else:
            box["peak_memory_mib"] = rss_mib()
            box["memory_kind"] = "process peak RSS so far (CPU; never decreases)"


def finite(x: object) -> TypeGuard[float]:
    """True for a finite int or float (not a bool, None, or NaN)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def quiet_megatron() -> None:
    """Silence megatron-core's start-up warnings that do not matter to the checks."""
    # megatron-core announces every missing CUDA extension; none of them matters here
    warnings.filterwarnings(
        "ignore",
        message=r".*(Apex|Transformer Engine|TransformerEngine|cuda_graph_scope|CUDA_DEVICE_MAX_CONNECTIONS).*",
    )
    # bf16 activations meet megatron's float32 RMSNorm weight: torch falls back to the unfused norm
    warnings.filterwarnings("ignore", message=r"Mismatch dtype between input and weight")
