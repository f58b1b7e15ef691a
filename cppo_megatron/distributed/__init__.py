"""Moving sequences between data-parallel ranks (torch.distributed, gloo and NCCL).

- ``exchange``: ``prune_and_exchange`` decides the survivors over all ranks and rebalances
  them; ``ExchangeHandle.return_to_owners`` routes per-sequence results back. Its pieces:
  ``metadata`` (``gather_metadata``), ``plan`` (``make_plan``: where each survivor goes),
  ``rows`` (``exchange_rows``: point-to-point transfer).
- ``timing``: ``rank_wait_metrics``: per-rank step times and the time each waits at the barrier.
- ``launch``: ``run_local`` runs a function on W local gloo processes (tests, CPU runs).
"""

from .exchange import (
    ExchangeHandle,
    ExchangePlan,
    ExchangeResult,
    GlobalMetadata,
    exchange_kept,
    exchange_rows,
    gather_metadata,
    global_sum,
    make_plan,
    prune_and_exchange,
)
from .launch import free_port, run_local
from .timing import rank_wait_metrics, wait_stats

__all__ = [
    "ExchangeHandle",
    "ExchangePlan",
    "ExchangeResult",
    "GlobalMetadata",
    "exchange_kept",
    "exchange_rows",
    "free_port",
    "gather_metadata",
    "global_sum",
    "make_plan",
    "prune_and_exchange",
    "rank_wait_metrics",
    "run_local",
    "wait_stats",
]
