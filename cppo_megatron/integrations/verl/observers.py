"""Who watches the GPU path: the pruning seam's decision and the features' records, handed to
whatever diagnostics subscribed (none unless asked for: ``diagnostics/__init__.py``).

The GPU path never imports a diagnostic. It decides (``hook.py``, through the core), hands the
decision to its own observers (metrics, the ``cppo`` estimator's statistics, selective
rollout's history, early stopping's learner) and then to the ones subscribed here:

- ``on_prune(fn)``: ``fn(decision)`` once per step with the seam's ``PruneDecision``, before the
  pruned rows are dropped (a V1 observer may still read them from TransferQueue; a legacy
  observer may add a column to the batch, as the audit's row ids do). It must not change
  which rows are kept.
- ``on_record(fn)``: ``fn(kind, role=..., **fields)`` for every named record a feature emits
  (``selective``, ``early_stop``, ``early_stop_boundary``); ``recording()`` says whether anyone
  listens, so a feature skips the work of building a record nobody reads.

The audit (``diagnostics/audit.py``) subscribes to both in audit mode (``CPPO_VERL_AUDIT``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["PruneDecision", "on_prune", "on_record", "prune_decided", "record", "recording", "remove",
           "subscribed"]


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


_PRUNE: list[Callable[[PruneDecision], None]] = []
_RECORD: list[Callable[..., None]] = []


def on_prune(fn: Callable[[PruneDecision], None]) -> None:
    """Subscribe ``fn`` to the seam's decision (idempotent)."""
    if not callable(fn):
        raise TypeError(f"observers.on_prune: {fn!r} is not callable; pass a function of one PruneDecision")
    if fn not in _PRUNE:
        _PRUNE.append(fn)


def on_record(fn: Callable[..., None]) -> None:
    """Subscribe ``fn(kind, role=..., **fields)`` to the features' named records (idempotent)."""
    if not callable(fn):
        raise TypeError(f"observers.on_record: {fn!r} is not callable; pass a function (kind, role=..., **fields)")
    if fn not in _RECORD:
        _RECORD.append(fn)


def remove(fn: Callable[..., None]) -> None:
    """Unsubscribe ``fn`` from both (tests); nothing when it was not subscribed."""
    for subscribers in (_PRUNE, _RECORD):
        if fn in subscribers:
            subscribers.remove(fn)


def subscribed() -> dict[str, list[str]]:
    """Who listens, by qualified name: ``{"prune": [...], "record": [...]}`` (what a test checks)."""
    def name(fn: Callable[..., Any]) -> str:
        return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"

    return {"prune": [name(f) for f in _PRUNE], "record": [name(f) for f in _RECORD]}


def prune_decided(decision: PruneDecision) -> None:
    """Hand the seam's decision to every subscriber, in subscription order."""
    for fn in list(_PRUNE):
        fn(decision)


def recording() -> bool:
    """Whether anyone listens to named records (build a record only then)."""
    return bool(_RECORD)


def record(kind: str, role: str = "trainer", **fields: Any) -> None:
    """Hand one named record to every subscriber (nothing when none listens)."""
    for fn in list(_RECORD):
        fn(kind, role=role, **fields)
