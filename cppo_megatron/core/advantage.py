"""Group-relative advantages, always from the FULL group (before any pruning)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._checks import as_1d_float, as_group_ids, check_float
from .settings import ADV_NORMS

__all__ = ["ADV_NORMS", "GroupStats", "group_advantages", "advantages_from_stats"]


@dataclass(frozen=True)
class GroupStats:
    """Per-group reward statistics of a batch.

    Attributes:
        group_ids: [M] int64 the distinct group ids, ascending.
        inverse: [N] int64 position of each completion's group in ``group_ids``.
        size: [M] int64 completions per group.
        mean: [M] reward mean, in the rewards' float dtype (0 for singleton groups, as veRL).
        std: [M] unbiased reward std, as torch.std, same dtype (1 for singleton groups, as veRL).
    """

    group_ids: torch.Tensor
    inverse: torch.Tensor
    size: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor

    @property
    def num_groups(self) -> int:
        """M, the number of distinct groups."""
        return int(self.group_ids.numel())

    def row_mean(self) -> torch.Tensor:
        """[N] each completion's full-group mean, float (to store on a batch before pruning)."""
        return self.mean[self.inverse]

    def row_std(self) -> torch.Tensor:
        """[N] each completion's full-group std, float."""
        return self.std[self.inverse]

    def zero_variance(self) -> torch.Tensor:
        """[M] bool: groups of two or more whose rewards are all equal (no learning signal)."""
        return (self.size > 1) & (self.std == 0)


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    adv_norm: str = "std",
    eps: float = 1e-6,
) -> tuple[torch.Tensor, GroupStats]:
    """GRPO outcome advantages with full-group statistics.

    A_i = (r_i - mean(r_g)) / (std(r_g) + eps) for ``adv_norm="std"``; A_i = r_i - mean(r_g)
    for ``"none"`` (Dr. GRPO). std is unbiased (n - 1). A singleton group gets mean 0 and
    std 1, as veRL's ``compute_grpo_outcome_advantage``.

    Args:
        rewards: [N] float finite scalar rewards, one per completion (integers become float32).
        group_ids: [N] int64 ids (any non-negative values, unsorted, uneven group sizes).
        adv_norm: ``std`` or ``none`` (``ADV_NORMS``).
        eps: >= 0, added to the std.

    Returns:
        advantages: [N] in the dtype and on the device of ``rewards`` (float32 for
            integer rewards), row-aligned with ``rewards``.
        stats: the ``GroupStats`` of the M groups (computed in float64 on the CPU).

    Example::

        >>> adv, stats = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.zeros(4, dtype=torch.long))
        >>> adv  # mean 0.25, std 0.5
        tensor([ 1.5000, -0.5000, -0.5000, -0.5000])
    """
    r = as_1d_float("rewards", rewards)
    g = as_group_ids("group_ids", group_ids, r.numel())
    if adv_norm not in ADV_NORMS:
        raise ValueError(f"adv_norm must be one of {list(ADV_NORMS)}, got {adv_norm!r}")
    eps = check_float("eps", eps, minimum=0.0)

    out_dtype = r.dtype
    device = r.device
    r64 = r.detach().to("cpu", torch.float64)
    uniq, inverse = torch.unique(g.cpu(), sorted=True, return_inverse=True)
    m = uniq.numel()
    size = torch.zeros(m, dtype=torch.float64).index_add_(0, inverse, torch.ones_like(r64))
    total = torch.zeros(m, dtype=torch.float64).index_add_(0, inverse, r64)
    mean = total / size
    sq = torch.zeros(m, dtype=torch.float64).index_add_(0, inverse, (r64 - mean[inverse]) ** 2)
    single = size < 2
    std = torch.sqrt(sq / (size - 1).clamp_min(1))
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)

    adv = r64 - mean[inverse]
    if adv_norm == "std":
        adv = adv / (std[inverse] + eps)
    stats = GroupStats(
        group_ids=uniq,
        inverse=inverse,
        size=size.to(torch.int64),
        mean=mean.to(out_dtype),
        std=std.to(out_dtype),
    )
    return adv.to(device=device, dtype=out_dtype), stats


def advantages_from_stats(
    rewards: torch.Tensor,
    row_mean: torch.Tensor,
    row_std: torch.Tensor,
    *,
    adv_norm: str = "std",
    eps: float = 1e-6,
) -> torch.Tensor:
    """Advantages of (kept) completions from full-group statistics recorded before pruning.

    This is what a framework's advantage step must use after pruning: recomputing the
    statistics over the survivors is a bug (it changes every advantage).

    Args:
        rewards: [K] float rewards of the kept completions.
        row_mean: [K] float, each row's full-group mean (``GroupStats.row_mean()[kept]``).
        row_std: [K] float >= 0, each row's full-group std (``GroupStats.row_std()[kept]``).
        adv_norm: ``std`` or ``none``, as when the statistics were recorded.
        eps: >= 0, as when the statistics were recorded.

    Returns:
        [K] advantages in the dtype and on the device of ``rewards``; K may be 0.
    """
    r = as_1d_float("rewards", rewards, allow_empty=True)
    mu = as_1d_float("row_mean", row_mean, allow_empty=True)
    sd = as_1d_float("row_std", row_std, allow_empty=True)
    if not (r.numel() == mu.numel() == sd.numel()):
        raise ValueError(
            f"rewards ({r.numel()}), row_mean ({mu.numel()}) and row_std ({sd.numel()}) must have "
            "the same length"
        )
    if adv_norm not in ADV_NORMS:
        raise ValueError(f"adv_norm must be one of {list(ADV_NORMS)}, got {adv_norm!r}")
    eps = check_float("eps", eps, minimum=0.0)
    adv = r.to(torch.float64) - mu.to(r.device, torch.float64)
    if adv_norm == "std":
        if bool((sd < 0).any()):
            i = int((sd < 0).nonzero()[0])
            raise ValueError(f"row_std[{i}] = {sd[i].item()} is negative")
        adv = adv / (sd.to(r.device, torch.float64) + eps)
    return adv.to(r.dtype)
