"""The CPPO decision for one batch in one call: full-group advantages, then selection."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .advantage import GroupStats, group_advantages
from .selection import Selection, select_completions
from .settings import check_config

if TYPE_CHECKING:
    from .settings import CPPOConfig

__all__ = ["PruneResult", "prune"]


@dataclass(frozen=True)
class PruneResult:
    """The CPPO decision for one batch of N completions in M groups.

    Attributes:
        advantages: [N] float full-group advantages of every completion, row-aligned with
            the rewards (dtype and device of the rewards).
        stats: the ``GroupStats`` (store ``stats.row_mean()`` / ``row_std()`` on the batch
            before dropping rows, for a framework's own advantage step).
        selection: which rows survive (``selection.kept``: [K] int64, ascending).
    """

    advantages: torch.Tensor
    stats: GroupStats
    selection: Selection

    @property
    def kept_advantages(self) -> torch.Tensor:
        """[K] float advantages of the survivors, in ``selection.kept`` order."""
        return self.advantages[self.selection.kept.to(self.advantages.device)]

    def metrics(self, prefix: str = "cppo/") -> dict[str, float]:
        """The selection's metrics plus ``zero_variance_groups``, plain floats."""
        out = self.selection.metrics(prefix)
        out[f"{prefix}zero_variance_groups"] = float(self.stats.zero_variance().sum())
        return out


def prune(rewards: torch.Tensor, group_ids: torch.Tensor, cfg: CPPOConfig, *, step: int = 0) -> PruneResult:
    """Advantages over the full groups, then the survivors: the whole CPPO decision.

    Args:
        rewards: [N] float finite rewards, one per completion.
        group_ids: [N] int64 prompt ids (any non-negative values, any order, uneven sizes).
        cfg: the ``CPPOConfig``.
        step: int >= 0, the training step; varies the seeded tie-breaks between steps
            (identically on every rank).

    Returns:
        a ``PruneResult``: ``advantages`` [N] over the full groups, ``stats`` of the M
        groups, ``selection.kept`` [K] int64 indices into the N rows, ascending.

    Example::

        >>> res = prune(torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.zeros(4, dtype=torch.long),
        ...             CPPOConfig(keep_per_group=2))
        >>> res.selection.kept, res.kept_advantages  # |A| = 1.5 first, then a tied row (seeded)
        (tensor([0, 1]), tensor([ 1.5000, -0.5000]))
    """
    check_config(cfg)
    adv, stats = group_advantages(rewards, group_ids, adv_norm=cfg.adv_norm, eps=cfg.eps)
    return PruneResult(adv, stats, select_completions(adv, group_ids, cfg, step=step, stats=stats))
