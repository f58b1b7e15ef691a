"""Prune and rebalance completions across data-parallel ranks in an SPMD pipeline.

In a multi-controller pipeline (Megatron, NeMo, OpenRLHF-style workers) every
data-parallel rank holds its own rollouts. CPPO needs one decision over the whole batch
(groups may span ranks) and afterwards the survivors are badly spread: one rank may keep
most of its long traces, another none. ``prune_and_exchange``:

1. all-gathers the per-sequence metadata (rewards, group ids, token counts) — a few
   numbers per sequence, never the tokens;
2. runs the core's ``prune`` and ``balance_partitions`` on the gathered metadata; every
   rank computes the same plan from the same inputs (selection runs on the CPU with a
   seeded tie-break), so no rank has to broadcast a decision;
3. moves only the survivors' data with point-to-point collectives (gloo and NCCL);
4. returns an ``ExchangeHandle`` that sends per-sequence results (log-probs, losses)
   back to the ranks that own them, in their original local order.

Row order on a receiving rank is the global order (source rank, then local index), so the
outcome does not depend on timing.

Steps 1-3 live in their own modules — ``metadata`` (the all-gather), ``plan`` (who trains
which survivor: pure computation) and ``rows`` (the point-to-point transfer); this module
composes them and routes results back. Every name stays importable from here.

Fields: a dict name -> value, where a value is either a tensor ``[n, ...]`` (one row per
sequence, "dense") or a list of n tensors ``[L_i, ...]`` whose first dimension varies
("ragged", e.g. token ids of different lengths). Dtypes and trailing shapes must agree
across ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from ..core import PruneResult, prune
from .metadata import GlobalMetadata, comm_device, gather_metadata, group_ctx
from .plan import ExchangePlan, make_plan
from .rows import FieldValue, exchange_rows

if TYPE_CHECKING:
    from ..core import CPPOConfig

__all__ = [
    "ExchangeHandle",
    "ExchangePlan",
    "ExchangeResult",
    "GlobalMetadata",
    "gather_metadata",
    "make_plan",
    "prune_and_exchange",
    "exchange_kept",
    "exchange_rows",
    "global_sum",
]


@dataclass
class ExchangeHandle:
    """Routes per-sequence results from the rank that computed them back to their owner."""

    plan: ExchangePlan
    rank: int
    group: Any = None
    device: Any = None

    @property
    def local_kept(self) -> torch.Tensor:
        """[k] int64 ascending local indices of this rank's own sequences that survived."""
        lo = self.plan.offsets[self.rank]
        return (self.plan.dest[lo : lo + self.plan.counts[self.rank]] >= 0).nonzero().squeeze(1)

    @property
    def num_received(self) -> int:
        """m, the sequences this rank holds after the exchange."""
        return int((self.plan.dest == self.rank).sum())

    def return_to_owners(self, values: FieldValue, *, fill: float = float("nan")) -> FieldValue:
        """Send results for the received rows back to their owners.

        Args:
            values: one row per received sequence, in received order: a tensor [m, ...] or
                a list of m tensors of varying length.
            fill: value for this rank's pruned rows (dense results).

        Returns:
            on every rank, its own n sequences in their original order: a tensor [n, ...]
            (dtype of ``values``) with ``fill`` in pruned rows, or a list of n tensors with
            None for pruned rows.
        """
        plan, me, world = self.plan, self.rank, self.plan.world_size
        m = len(values)
        if m != self.num_received:
            raise ValueError(f"values has {m} rows but rank {me} received {self.num_received} sequences")
        # rows from source s sit contiguously in received order
        recv_from = torch.bincount(self._owner()[plan.dest == me], minlength=world).tolist()
        starts = np.concatenate([[0], np.cumsum(recv_from)[:-1]]).astype(np.int64)
        send_rows = [torch.arange(int(starts[s]), int(starts[s]) + recv_from[s]) for s in range(world)]
        recv_counts = [int(plan.sent(me, d).numel()) for d in range(world)]
        back = exchange_rows({"v": values}, send_rows, recv_counts, group=self.group, device=self.device)["v"]
        # back rows are ordered by the rank that computed them, each in our ascending local order
        order = torch.cat([plan.sent(me, d) for d in range(world)]) if world else torch.empty(0, dtype=torch.int64)
        n = plan.counts[me]
        if isinstance(back, list):
            out: list = [None] * n
            for pos, i in enumerate(order.tolist()):
                out[i] = back[pos]
            return out
        res = torch.full((n, *back.shape[1:]), fill, dtype=back.dtype, device=back.device)
        res[order.to(back.device)] = back
        return res

    def _owner(self) -> torch.Tensor:
        return torch.repeat_interleave(torch.arange(self.plan.world_size), torch.tensor(self.plan.counts))


@dataclass
class ExchangeResult:
    """What this rank trains on after pruning and rebalancing.

    Attributes:
        fields: the received rows of every field, in global order.
        global_index: [m] int64 global index of each received row (``meta`` order), ascending.
        advantages: [m] float32 full-group advantages of the received rows.
        weights: [m] float32 loss weights of the received rows: ``Selection.weights`` (1/pi
            for ``metric=importance``, 1.0 otherwise). They need no transfer: every rank made
            the same global decision, so each indexes it by ``global_index``.
        group_ids: [m] int64 and rewards: [m] float64 of the received rows.
        handle: ``return_to_owners`` sends results back.
        prune: the global ``PruneResult`` (same on every rank).
        meta: the gathered ``GlobalMetadata``.
        num_kept: K, sequences kept on all ranks (the global sequence denominator).
        metrics: the prune and exchange metrics, plain floats.
    """

    fields: dict
    global_index: torch.Tensor
    advantages: torch.Tensor
    weights: torch.Tensor
    group_ids: torch.Tensor
    rewards: torch.Tensor
    handle: ExchangeHandle
    prune: PruneResult
    meta: GlobalMetadata
    metrics: dict = field(default_factory=dict)

    @property
    def num_kept(self) -> int:
        """K, sequences kept over all ranks."""
        return int(self.prune.selection.num_kept)

    @property
    def num_total(self) -> int:
        """N, sequences generated on all ranks before pruning (the full batch's sequence
        denominator an importance-weighted loss divides by)."""
        return int(self.prune.selection.num_total)

    @property
    def weighted(self) -> bool:
        """True when ``weights`` must reach the loss (``metric=importance``)."""
        return self.prune.selection.weighted


def prune_and_exchange(
    fields: dict,
    rewards,
    group_ids,
    lengths,
    cfg: CPPOConfig,
    *,
    step: int = 0,
    group=None,
    device=None,
    move_tolerance: float = 0.01,
) -> ExchangeResult:
    """Decide the survivors over all ranks of ``group`` and rebalance them.

    Args:
        fields: this rank's sequences: name -> tensor [n, ...] or list of n tensors.
        rewards: [n] float rewards. group_ids: [n] int64 prompt ids (global: the same
            prompt on two ranks has the same id). lengths: [n] int64 tokens each sequence
            costs in the forward passes (the balancer's workload input).
        cfg: the ``CPPOConfig``.
        step: int >= 0, training step (seeds the tie-breaks, identically on all ranks).
        group: the data-parallel process group (default: the world). Under tensor or
            pipeline parallelism call this on every rank with its DP group; the ranks of a
            model-parallel group hold the same data and so receive the same rows.
        device: where communication buffers live (default: cuda for NCCL, else cpu).
        move_tolerance: accept a plan that moves far fewer sequences if its largest rank
            workload is within this fraction of the balancer's (``make_plan``).

    Returns:
        the ``ExchangeResult`` of this rank: ``fields`` with the m rows it trains on,
        ``global_index`` [m] int64 ascending, ``advantages`` [m] float32 (full-group), and
        ``handle.return_to_owners`` to send per-row results back.
    """
    n = len(rewards)
    for name, v in fields.items():
        if len(v) != n:
            raise ValueError(f"field {name!r} has {len(v)} rows but there are {n} rewards")
    meta = gather_metadata(rewards, group_ids, lengths, group=group, device=device)
    result = prune(meta.rewards, meta.group_ids, cfg, step=step)
    moved, plan, gidx = exchange_kept(fields, meta, result.selection.kept, cfg, group=group, device=device,
                                      move_tolerance=move_tolerance)
    rank, _ = group_ctx(group)
    metrics = {**result.metrics(), **plan.metrics()}
    sel = result.selection
    weight_full = torch.ones(sel.num_total, dtype=torch.float32)
    assert sel.weights is not None  # Selection.__post_init__ fills None with ones
    weight_full[sel.kept] = sel.weights
    return ExchangeResult(
        fields=moved,
        global_index=gidx,
        advantages=result.advantages[gidx].to(torch.float32),
        weights=weight_full[gidx],
        group_ids=meta.group_ids[gidx],
        rewards=meta.rewards[gidx],
        handle=ExchangeHandle(plan, rank, group, device),
        prune=result,
        meta=meta,
        metrics=metrics,
    )


def exchange_kept(fields: dict, meta: GlobalMetadata, kept, cfg: Any, *, group=None, device=None,
                  move_tolerance: float = 0.01) -> tuple[dict, ExchangePlan, torch.Tensor]:
    """Move survivors decided elsewhere (the same ``kept`` on every rank) so every rank of
    ``group`` carries an equal workload.

    Args:
        fields: this rank's sequences (``meta.counts[rank]`` rows each), as in ``prune_and_exchange``.
        meta: every rank's metadata in global (rank-major) order, identical on all ranks.
        kept: [K] int64 global indices (``meta`` order) of the survivors.
        cfg: ``rebalance``, ``equal_size``, ``workload_*`` (a ``CPPOConfig``).

    Returns (received fields, the plan, [m] ascending global indices of the received rows).
    """
    rank, world = group_ctx(group)
    if meta.world_size != world:
        raise ValueError(f"metadata describes {meta.world_size} ranks but the group has {world}")
    for name, v in fields.items():
        if len(v) != meta.counts[rank]:
            raise ValueError(f"field {name!r} has {len(v)} rows but rank {rank} holds {meta.counts[rank]}")
    plan = make_plan(meta, kept, cfg, move_tolerance=move_tolerance)
    send_rows = [plan.sent(rank, d) for d in range(world)]
    recv_counts = [int(plan.sent(s, rank).numel()) for s in range(world)]
    moved = exchange_rows(fields, send_rows, recv_counts, group=group, device=device)
    return moved, plan, plan.received(rank)


def global_sum(value: float | int | torch.Tensor, *, group=None, device=None) -> float:
    """Sum a number over the ranks of ``group`` (e.g. response tokens of the kept set).

    ``value``: a float, int or one-element tensor on this rank. Returns the float64 sum,
    identical on every rank (a collective: call it on every rank)."""
    dev = comm_device(group, device)
    t = torch.tensor([float(value)], dtype=torch.float64, device=dev)
    dist.all_reduce(t, group=group)
    return float(t.item())
