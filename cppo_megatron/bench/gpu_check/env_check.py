"""Check 1, ``environment``: GPU name and memory, torch / CUDA / NCCL versions, bf16 support,
and what every optional backend imports (``cppo-megatron doctor`` in a subprocess, so
importing veRL or vLLM cannot change this process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .settings import GpuCheckSettings

__all__ = ["check_environment"]


def check_environment(s: GpuCheckSettings, ctx: dict) -> tuple[dict, list[str]]:
    """Versions, devices, bf16, and ``doctor``'s table of backends (run in a subprocess)."""
    import torch.distributed as dist

    nums: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "nccl_available": dist.is_nccl_available(),
        "gloo_available": dist.is_gloo_available(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    failures = []
    if torch.cuda.is_available():
        nums["gpus"] = []
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            nums["gpus"].append({"name": p.name, "memory_gib": round(p.total_memory / 2**30, 2),
                                 "capability": f"{p.major}.{p.minor}", "multiprocessors": p.multi_processor_count})
        nums["cudnn"] = torch.backends.cudnn.version()
        try:
            v = torch.cuda.nccl.version()
            nums["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception as exc:  # noqa: BLE001 - reported, not fatal
            nums["nccl"] = f"unavailable ({type(exc).__name__})"
        nums["bf16_supported"] = bool(torch.cuda.is_bf16_supported())
    else:
        # CPU: bf16 support means bf16 matmuls run and round as expected
        a = torch.full((4, 4), 1.0, dtype=torch.bfloat16)
        nums["bf16_supported"] = bool((a @ a).float().eq(4.0).all())
    if s.device == "cuda":
        if not nums["cuda_available"]:
            failures.append("--device cuda but no CUDA device is visible")
        if not nums["bf16_supported"]:
            failures.append("the GPU does not support bf16 (the bf16 log-prob check needs it)")
        if not nums["nccl_available"]:
            failures.append("torch.distributed has no NCCL backend")
    elif not nums["gloo_available"]:
        failures.append("torch.distributed has no gloo backend")

    # doctor's backend table, in a child process (imports are real and some have side effects)
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "cppo_megatron.cli", "doctor", "--json"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(10.0, ctx["budget"] - 5.0))
        rows = json.loads(proc.stdout)["backends"] if proc.returncode == 0 else None
        if rows is None:
            failures.append(f"`cppo-megatron doctor --json` exited {proc.returncode}: {proc.stderr.strip()[-300:]}")
    except (subprocess.TimeoutExpired, json.JSONDecodeError, KeyError) as exc:
        rows = None
        failures.append(f"`cppo-megatron doctor --json` failed: {type(exc).__name__}: {str(exc)[:200]}")
    nums["doctor_seconds"] = round(time.perf_counter() - t0, 2)
    if rows is not None:
        nums["backends"] = {r["backend"]: (r["version"] if r["importable"] else f"no: {r['note'] or 'not installed'}")
                            for r in rows}
        need = {"torch", "numpy", "omegaconf", "transformers", "megatron-core"}
        for r in rows:
            if r["backend"] in need and not r["importable"]:
                failures.append(f"{r['backend']} does not import ({r['note'] or 'not installed'}): "
                                "the later checks need it (scripts/gpu_check.sh installs it offline)")
    return nums, failures
