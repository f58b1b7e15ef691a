"""Small helpers the checks share: device sync, peak memory, finite numbers, quiet megatron."""

from __future__ import annotations

import contextlib
import math
import resource
import warnings

import torch


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _rss_mib() -> float:
    # ru_maxrss is KiB on Linux: the process's high-water mark, which never decreases
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


@contextlib.contextmanager
def _peak_memory(device: str, box: dict):
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
            box["peak_memory_mib"] = _rss_mib()
            box["memory_kind"] = "process peak RSS so far (CPU; never decreases)"


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _quiet_megatron() -> None:
    # megatron-core announces every missing CUDA extension; none of them matters here
    warnings.filterwarnings(
        "ignore", message=r".*(Apex|Transformer Engine|TransformerEngine|cuda_graph_scope|CUDA_DEVICE_MAX_CONNECTIONS).*"
    )
    # bf16 activations meet megatron's float32 RMSNorm weight: torch falls back to the unfused norm
    warnings.filterwarnings("ignore", message=r"Mismatch dtype between input and weight")
