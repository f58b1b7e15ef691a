"""Who watches veRL's GPU path: the pruning seam's decision and the features' records, handed to
whatever diagnostics subscribed (none unless asked for: ``diagnostics/__init__.py``). ``HUB`` is
veRL's own ``Observers`` (``integrations/observers.py``, host-neutral; OpenRLHF's is another
object, so a process loading both keeps them apart); what is veRL's is the decision and its
records.

The GPU path never imports a diagnostic. It decides (``hook.py``, through the core), hands the
decision to its own observers (metrics, the ``cppo`` estimator's statistics, selective
rollout's history, early stopping's learner) and then to the ones subscribed to ``HUB``:

- ``HUB.on_prune(fn)``: ``fn(decision)`` once per step with the seam's ``PruneDecision``, before the
  pruned rows are dropped (a V1 observer may still read them from TransferQueue; a legacy
  observer may add a column to the batch, as the audit's row ids do). It must not change
  which rows are kept.
- ``HUB.on_record(fn)``: ``fn(kind, role=..., **fields)`` for every named record a feature emits
  (``selective``, ``early_stop``, ``early_stop_boundary``); ``HUB.recording()`` says whether anyone
  listens, so a feature skips the work of building a record nobody reads.

The audit (``diagnostics/audit.py``) subscribes to both in audit mode (``CPPO_VERL_AUDIT``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..observers import Observers

__all__ = ["HUB", "PruneDecision"]


@dataclass(frozen=True)
class PruneDecision:
    """One step's decision at the ``_balance_batch`` seam, as the core made it.

    Args:
        step: veRL's ``global_steps``.
        loop: ``"v1"`` (``KVBatchMeta``) or ``"legacy"`` (``DataProto``).
        uids: [N] the prompt uid of each real row (padding excluded), in batch order.
        rewards: [N] float32, each row's outcome reward (``rm_scores`` summed).
        result: the core's ``PruneResult``: ``selection.kept`` / ``selection.pruned`` ([K] / [N-K]
            int64 row indices into ``uids``), the full-group statistics and advantages.
        batch: the host's batch as it reached the seam (read-only for observers, except the
            legacy audit's ``cppo_row`` column).
        keys: V1: [N] the TransferQueue key of each real row; legacy: None.
        filter_metric: DAPO's filter metric when its filter ran before the seam, else None.
        equal_groups: uids of the groups that passed DAPO's filter with all rewards equal.
    """

    step: int
    loop: str
    uids: list[str]
    rewards: torch.Tensor
    result: Any
    batch: Any
    keys: list[str] | None = None
    filter_metric: str | None = None
    equal_groups: list[str] = field(default_factory=list)


# veRL's own subscribers (integrations/observers.py); the other host's hub is another object
HUB: Observers[PruneDecision] = Observers()
