"""Input checks shared by the core functions. Each raises ValueError naming the bad value."""

from __future__ import annotations

import torch


def as_1d_float(name: str, x, *, allow_empty: bool = False) -> torch.Tensor:
    """A finite 1-D float tensor (CPU), or a ValueError naming the first bad entry."""
    if not isinstance(x, torch.Tensor):
        try:
            x = torch.as_tensor(x)
        except Exception as exc:  # noqa: BLE001 - re-raised with the name
            raise ValueError(f"{name} must be a 1-D tensor of numbers, got {type(x).__name__}") from exc
    if x.dim() != 1:
        raise ValueError(f"{name} must be 1-D [N], got shape {tuple(x.shape)}")
    if x.numel() == 0 and not allow_empty:
        raise ValueError(f"{name} is empty: nothing to compute (the batch has no completions)")
    if x.dtype == torch.bool or x.is_complex():
        raise ValueError(f"{name} must hold real numbers, got dtype {x.dtype}")
    if not x.is_floating_point():
        x = x.to(torch.float32)
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(
            f"{name}[{i}] = {x[i].item()} is not finite ({int(bad.sum())} non-finite value(s) in "
            f"{name}); fix the reward function or filter these completions before CPPO"
        )
    return x


def as_group_ids(name: str, g, n: int) -> torch.Tensor:
    """A 1-D int64 tensor of n non-negative group ids."""
    if not isinstance(g, torch.Tensor):
        try:
            g = torch.as_tensor(g)
        except Exception as exc:  # noqa: BLE001
            raise ValueError(f"{name} must be a 1-D tensor of integer ids, got {type(g).__name__}") from exc
    if g.dim() != 1:
        raise ValueError(f"{name} must be 1-D [N], got shape {tuple(g.shape)}")
    if g.numel() != n:
        raise ValueError(f"{name} has {g.numel()} entries but the batch has {n}: lengths must match")
    if g.is_floating_point() or g.dtype == torch.bool or g.is_complex():
        raise ValueError(
            f"{name} must be an integer tensor (int64 ids, one per prompt), got dtype {g.dtype}"
        )
    g = g.to(torch.int64)
    if n and bool((g < 0).any()):
        i = int((g < 0).nonzero()[0])
        raise ValueError(f"{name}[{i}] = {int(g[i])} is negative; group ids must be >= 0")
    return g


def check_int(name: str, v, *, minimum: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {v!r}")
    return v


def check_float(name: str, v, *, minimum: float | None = None) -> float:
    import math

    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number, got {v!r}")
    if minimum is not None and v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v!r}")
    return float(v)
