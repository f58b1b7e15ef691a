"""Full-group reward statistics, recorded when a batch is pruned and read back by the
``cppo`` advantage estimator.

veRL's advantage step sees only the survivors (and, in the V1 trainer, only a fixed list of
fields), so the statistics of the full groups cannot travel on the batch. Both the pruning
hook and the advantage step run in the trainer's driver process (veRL's TaskRunner), one
step after the other, so a process-local table keyed by the prompt ``uid`` carries them.
Each pruning replaces the table: it only ever holds the batch in flight.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

__all__ = ["GroupRecord", "record_groups", "lookup", "recorded_uids", "clear"]


@dataclass(frozen=True)
class GroupRecord:
    """Statistics of one prompt's full group of completions, before pruning.

    mean, std: reward mean and unbiased std of the G completions (veRL's singleton rule:
    mean 0, std 1); size: G; kept: survivors; adv_norm, eps: how advantages are formed;
    step: the trainer step that recorded it.
    """

    mean: float
    std: float
    size: int
    kept: int
    adv_norm: str
    eps: float
    step: int


_LOCK = threading.Lock()
_TABLE: dict[str, GroupRecord] = {}


def record_groups(records: dict[str, GroupRecord]) -> None:
    """Replace the table with ``records`` (uid -> GroupRecord) for the batch in flight."""
    if not isinstance(records, dict):
        raise ValueError(f"records must be a dict uid -> GroupRecord, got {type(records).__name__}")
    for uid, rec in records.items():
        if not isinstance(rec, GroupRecord):
            raise ValueError(f"records[{uid!r}] must be a GroupRecord, got {type(rec).__name__}")
    with _LOCK:
        _TABLE.clear()
        _TABLE.update(records)


def lookup(uid: str) -> GroupRecord | None:
    with _LOCK:
        return _TABLE.get(str(uid))


def recorded_uids() -> list[str]:
    with _LOCK:
        return list(_TABLE)


def clear() -> None:
    with _LOCK:
        _TABLE.clear()
