"""The CPPO decision for one batch in one call: full-group advantages, then selection."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .advantage import GroupStats, group_advantages
from ._checks import check_config
from .selection import Selection, select_completions

if TYPE_CHECKING:
    from ..config import CPPOConfig

__all__ = ["PruneResult", "prune"]


@dataclass(frozen=True)
class PruneResult:
    """advantages: [N] full-group advantages of every completion; stats: per-group
    statistics (store ``stats.row_mean()`` / ``row_std()`` on the batch before dropping
    rows); selection: which rows survive."""

    advantages: torch.Tensor
    stats: GroupStats
    selection: Selection

    @property
    def kept_advantages(self) -> torch.Tensor:
        return self.advantages[self.selection.kept.to(self.advantages.device)]

    def metrics(self, prefix: str = "cppo/") -> dict[str, float]:
        out = self.selection.metrics(prefix)
        out[f"{prefix}zero_variance_groups"] = float(self.stats.zero_variance().sum())
        return out


def prune(rewards: torch.Tensor, group_ids: torch.Tensor, cfg: CPPOConfig, *, step: int = 0) -> PruneResult:
    """Advantages over the full groups of ``rewards`` [N], then the survivors by ``cfg``
    (a ``CPPOConfig``). ``step`` varies the seeded tie-breaks between steps."""
    check_config(cfg)
    adv, stats = group_advantages(rewards, group_ids, adv_norm=cfg.adv_norm, eps=cfg.eps)
    return PruneResult(adv, stats, select_completions(adv, group_ids, cfg, step=step, stats=stats))
