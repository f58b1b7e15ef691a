"""A veRL device platform for CPU-only machines (``VERL_PLATFORM=cpu``).

veRL 0.9.1 resolves its platform once per process (``verl.plugin.platform.get_platform``),
after plugins are imported, so registering here is enough. What the platform tells veRL:

- device ``cpu`` and collective backend ``gloo``;
- ``current_device()`` is ``torch.device("cpu")``: FSDP calls ``.to(get_device_id())`` and an
  int would mean ``cuda:0``;
- a device module whose cache/stream/memory calls are cheap no-ops (CPU has nothing to free)
  and whose RNG calls are torch's CPU RNG;
- Ray resource ``GPU``: veRL's resource pools always ask for accelerators
  (``ResourcePoolManager.create_resource_pool``), so the run declares logical GPUs
  (``ray_kwargs.ray_init.num_gpus``), one per worker process — slots, not hardware.
"""

from __future__ import annotations

import contextlib
import os
import types
from typing import Any

import torch

__all__ = ["CPU_DEVICE_MODULE", "PlatformCPU", "register"]

PLATFORM_NAME = "cpu"


def _noop(*args, **kwargs) -> None:
    return None


def _zero(*args, **kwargs) -> int:
    return 0


def _mem_get_info(*args, **kwargs) -> tuple[int, int]:
    """(free, total) host memory in bytes, so memory logging prints real numbers."""
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        avail = os.sysconf("SC_AVPHYS_PAGES")
        return int(avail * size), int(pages * size)
    except (ValueError, OSError):
        return 0, 0


def _device_module() -> types.ModuleType:
    """``torch.cpu`` plus what veRL calls on ``torch.cuda`` (grep of veRL 0.9.1:
    empty_cache, synchronize, streams, RNG state, memory statistics, ipc_collect, ...)."""
    mod = types.ModuleType("cppo_verl_cpu_device")
    for name in ("Event", "Stream", "StreamContext", "current_stream", "stream", "synchronize", "is_available"):
        setattr(mod, name, getattr(torch.cpu, name))
    for name in ("empty_cache", "ipc_collect", "set_per_process_memory_fraction", "reset_peak_memory_stats"):
        setattr(mod, name, _noop)
    for name in ("memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved"):
        setattr(mod, name, _zero)
    vars(mod).update(
        device_count=lambda: 1,
        set_device=_noop,  # torch.cpu.set_device rejects ints; veRL passes a local rank
        current_device=lambda: torch.device("cpu"),
        manual_seed=torch.manual_seed,
        manual_seed_all=torch.manual_seed,
        get_rng_state=torch.get_rng_state,
        set_rng_state=torch.set_rng_state,
        mem_get_info=_mem_get_info,
        get_device_name=lambda *a, **k: "cpu",
        is_initialized=lambda: True,
    )
    return mod


CPU_DEVICE_MODULE = _device_module()


def _platform_class():
    from verl.plugin.platform import PlatformBase

    class PlatformCPU(PlatformBase):
        """veRL on CPU processes (gloo). Selected only by ``VERL_PLATFORM=cpu``: never auto-detected,
        so a machine with GPUs keeps veRL's own platform unless the run asks for this one."""

        @property
        def device_name(self) -> str:
            return "cpu"

        @property
        def vendor_name(self) -> str:
            return "cpu"

        @property
        def device_module(self) -> types.ModuleType:
            return CPU_DEVICE_MODULE

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check: bool = False) -> bool:
            return False  # explicit only: auto-detection must never pick the CPU

        def current_device(self) -> Any:
            return torch.device("cpu")

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            return None

        def synchronize(self, device_index: int | None = None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0):
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        @contextlib.contextmanager
        def nvtx_range(self, msg: str):
            yield

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            return "GPU"

        def ray_noset_envvars(self) -> list[str]:
            return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> Any:
            return None

    return PlatformCPU


PlatformCPU = None  # set by register(): the class needs veRL, imported lazily


def register():
    """Register ``PlatformCPU`` under the name ``cpu`` (idempotent); returns the class."""
    global PlatformCPU
    from verl.plugin.platform import PlatformRegistry

    if PlatformCPU is None:
        PlatformCPU = _platform_class()
    if PlatformRegistry.get(PLATFORM_NAME) is not PlatformCPU:
        PlatformRegistry.register(platform=PLATFORM_NAME)(PlatformCPU)
    return PlatformCPU
