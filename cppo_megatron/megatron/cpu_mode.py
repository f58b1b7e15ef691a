"""Run megatron-core on CPU processes (gloo): scoped, reversible workarounds.

megatron-core 0.16 assumes CUDA in a few places that are not about computation:
``torch.cuda.current_device()`` as a device argument (rotary embedding, attention, TP
mappings), ``device="cuda"`` / ``.cuda()`` in the pipeline schedules and p2p
communication, ``torch.cuda.synchronize()``. ``cpu_mode()`` redirects exactly those to the
CPU while it is active and restores everything on exit; with CUDA present it does
nothing. What cannot run on CPU is refused by ``check_cpu_supported`` with a clear
error rather than failing deep inside megatron-core.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["CPUModeError", "CudaToCpu", "check_cpu_supported", "cpu_mode", "cpu_mode_active", "on_cpu"]

_state = threading.local()


class CPUModeError(RuntimeError):
    """A megatron-core feature that needs CUDA was requested on a CPU-only process."""


def on_cpu() -> bool:
    """True when this process has no CUDA device (the workarounds are needed)."""
    return not torch.cuda.is_available()


def cpu_mode_active() -> bool:
    return getattr(_state, "depth", 0) > 0


def _is_cuda(dev) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    return False


class CudaToCpu(TorchFunctionMode):
    """Maps cuda device arguments to cpu, makes ``Tensor.cuda()`` a no-op and has ``Tensor.type()``
    report ``torch.cuda.*`` names (per thread, as every torch function mode; veRL's CPU mode
    extends it for its Megatron engine).

    The type names: megatron-core's optimizers accept only CUDA parameter types
    (``optimizer/optimizer.py:671,690`` for bf16 / fp16 master weights,
    ``distrib_optimizer.py:361,431,582`` for the distributed optimizer's shards); nothing else
    in the actor asks ``Tensor.type()``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else "torch.cuda." + name[len("torch."):]
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


@contextlib.contextmanager
def cpu_mode(enabled: bool | None = None) -> Iterator[bool]:
    """Make megatron-core's CUDA-only calls run on the CPU inside the block.

    Args:
        enabled: force on/off; default: on exactly when CUDA is unavailable.

    Yields whether the workarounds are active. Re-entrant; everything patched is put
    back when the outermost block exits, also on exceptions.
    """
    enabled = on_cpu() if enabled is None else bool(enabled)
    if not enabled or cpu_mode_active():  # off, or an outer block already patched
        yield cpu_mode_active()
        return
    saved: dict[str, Any] = {
        "current_device": torch.cuda.current_device,
        "synchronize": torch.cuda.synchronize,
    }
    # used as a device argument, never as an index: a str where torch types an int, on purpose
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    torch.cuda.synchronize = lambda *a, **k: None
    mode = CudaToCpu()
    mode.__enter__()
    _state.depth = 1
    try:
        yield True
    finally:
        _state.depth = 0
        mode.__exit__(None, None, None)
        torch.cuda.current_device = saved["current_device"]
        torch.cuda.synchronize = saved["synchronize"]


def check_cpu_supported(*, use_distributed_optimizer: bool = False, sequence_parallel: bool = False) -> None:
    """Raise ``CPUModeError`` naming each requested feature that megatron-core cannot run on CPU."""
    if not on_cpu():
        return
    bad = []
    if sequence_parallel:
        bad.append("sequence_parallel=True (its reduce-scatter paths need CUDA)")
    if bad:
        raise CPUModeError(
            "these megatron-core settings cannot run without CUDA: " + "; ".join(bad)
            + ". On CPU use Megatron DDP with the plain (non-distributed) optimizer and no sequence "
            "parallelism (docs/integrations/megatron.md)."
        )
