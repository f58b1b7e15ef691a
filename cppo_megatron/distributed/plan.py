"""Where every survivor goes: the exchange plan, identical on every rank.

``make_plan`` turns the survivors of a step (global indices into the gathered metadata)
into a destination rank per sequence, from the core balancer's partition (each part
given to the rank that already holds most of it) or, when it balances as well, a plan
that keeps each rank's own survivors local. Pure computation: no communication.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..core import balance_partitions, sequence_workload
from ..core.settings import check_config
from .metadata import GlobalMetadata

if TYPE_CHECKING:
    from ..core import CPPOConfig

__all__ = ["ExchangePlan", "make_plan"]


@dataclass(frozen=True)
class ExchangePlan:
    """Where every sequence goes. Identical on all ranks.

    Attributes:
        counts: W ints, sequences per rank before pruning.
        kept: [K] int64 ascending global indices of the survivors.
        dest: [N] int64 destination rank of each sequence, -1 for pruned ones.
        workloads: [N] float64 workload of every sequence (``sequence_workload``).
        loads: [W] float64 numpy array, planned workload per rank after the exchange.
        loads_unbalanced: [W] float64, workload per rank if survivors stayed on their owners.
        rebalanced: whether sequences move at all.
        method: ``balanced`` (the balancer's partition), ``keep-local`` or ``stay``.
    """

    counts: list[int]
    kept: torch.Tensor
    dest: torch.Tensor
    workloads: torch.Tensor
    loads: np.ndarray
    loads_unbalanced: np.ndarray
    rebalanced: bool
    method: str = "balanced"

    @property
    def world_size(self) -> int:
        """W."""
        return len(self.counts)

    @property
    def offsets(self) -> list[int]:
        """W ints: the global index of each rank's first sequence."""
        return [0] + list(np.cumsum(self.counts)[:-1].tolist())

    def received(self, rank: int) -> torch.Tensor:
        """[m] int64 ascending global indices rank ``rank`` holds after the exchange."""
        return (self.dest == rank).nonzero().squeeze(1)

    def sent(self, src: int, dst: int) -> torch.Tensor:
        """[s] int64 local indices (on ``src``, ascending) of the sequences ``src`` sends to ``dst``."""
        lo = self.offsets[src]
        d = self.dest[lo : lo + self.counts[src]]
        return (d == dst).nonzero().squeeze(1)

    def transfer_counts(self) -> torch.Tensor:
        """[W, W] int64 number of sequences from rank i (row) to rank j (column)."""
        w = self.world_size
        owner = torch.repeat_interleave(torch.arange(w), torch.tensor(self.counts))
        m = torch.zeros(w, w, dtype=torch.int64)
        k = self.dest >= 0
        m.index_put_((owner[k], self.dest[k]), torch.ones(int(k.sum()), dtype=torch.int64), accumulate=True)
        return m

    def metrics(self, prefix: str = "cppo/exchange_") -> dict[str, float]:
        """Imbalance (largest / mean rank workload) with and without the exchange, the
        largest loads, sequences moved and kept: plain floats."""

        def imb(x):
            mean = float(np.mean(x)) if len(x) else 0.0
            return float(np.max(x)) / mean if mean > 0 else 1.0

        t = self.transfer_counts()
        moved = int(t.sum() - t.diagonal().sum())
        return {
            f"{prefix}imbalance": imb(self.loads),
            f"{prefix}imbalance_without": imb(self.loads_unbalanced),
            f"{prefix}max_load": float(np.max(self.loads)) if len(self.loads) else 0.0,
            f"{prefix}max_load_without": float(np.max(self.loads_unbalanced)) if len(self.loads) else 0.0,
            f"{prefix}moved_sequences": float(moved),
            f"{prefix}kept_sequences": float(self.kept.numel()),
            f"{prefix}keep_local_plan": float(self.method == "keep-local"),
        }


def make_plan(meta: GlobalMetadata, kept, cfg: CPPOConfig, *, move_tolerance: float = 0.01) -> ExchangePlan:
    """Assign the survivors ``kept`` (global indices) to ranks with the core balancer.

    ``cfg`` supplies ``rebalance``, ``equal_size``, ``workload_linear`` and
    ``workload_quadratic`` (a ``CPPOConfig``). Without ``rebalance`` survivors stay put.

    Two candidate plans: the balancer's partition (each part given to the rank that
    already holds most of it), and a keep-local plan (each rank keeps its own survivors,
    largest first, up to the balancer's largest load; the overflow goes longest-first to
    the least loaded rank). The keep-local plan moves far fewer sequences; it is taken
    when its largest load is within ``move_tolerance`` (relative) of the balancer's.
    ``move_tolerance=0`` takes it only when it is as good. Not used with ``equal_size``.

    Args:
        meta: the gathered ``GlobalMetadata`` of N sequences on W ranks.
        kept: [K] int64 global indices of the survivors (any order, no duplicates).
        cfg: the ``CPPOConfig``. move_tolerance: float >= 0.

    Returns:
        the ``ExchangePlan``: ``dest`` [N] int64 (rank of each survivor, -1 when pruned),
        identical on every rank that passes the same inputs.
    """
    check_config(cfg)
    if not (isinstance(move_tolerance, (int, float)) and move_tolerance >= 0):
        raise ValueError(f"move_tolerance must be a number >= 0, got {move_tolerance!r}")
    n = int(sum(meta.counts))
    kept = torch.as_tensor(kept, dtype=torch.int64).cpu()
    if kept.numel() and (int(kept.min()) < 0 or int(kept.max()) >= n):
        raise ValueError(f"kept indices must lie in [0, {n}), got range [{int(kept.min())}, {int(kept.max())}]")
    if kept.numel() != torch.unique(kept).numel():
        raise ValueError("kept indices contain duplicates: a sequence would be trained twice")
    kept = torch.sort(kept).values
    world = meta.world_size
    work = sequence_workload(
        meta.lengths.to(torch.float64),
        linear=cfg.workload_linear,
        quadratic=cfg.workload_quadratic,
    )
    owner = meta.owner()
    dest = torch.full((n,), -1, dtype=torch.int64)
    unbalanced = np.zeros(world)
    np.add.at(unbalanced, owner[kept].numpy(), work[kept].numpy())
    rebalance, equal_size = cfg.rebalance, cfg.equal_size
    if rebalance and world > 1 and kept.numel():
        wk, ok = work[kept].numpy(), owner[kept].numpy()
        part = balance_partitions(work[kept], world, equal_size=equal_size)
        method = "balanced"
        assign = np.empty(kept.numel(), dtype=np.int64)
        for r, p in enumerate(_match_parts_to_owners(part.parts, ok, world)):
            assign[p] = r
        if not equal_size:
            local = _keep_local_assignment(wk, ok, world, cap=part.max_load)
            local_max = np.bincount(local, weights=wk, minlength=world).max()
            if local_max <= part.max_load * (1 + move_tolerance):
                assign, method = local, "keep-local"
        dest[kept] = torch.from_numpy(assign)
        loads = np.bincount(assign, weights=wk, minlength=world).astype(np.float64)
    else:
        dest[kept] = owner[kept]
        loads = unbalanced.copy()
        method = "stay"
    return ExchangePlan(list(meta.counts), kept, dest, work, loads, unbalanced, rebalance and world > 1, method)


def _keep_local_assignment(w: np.ndarray, owners: np.ndarray, world: int, cap: float) -> np.ndarray:
    """Each rank keeps its own items, largest first, while its load stays <= cap; the rest
    go largest first to the least loaded rank (ties: lowest rank)."""
    import heapq

    k = w.size
    order = np.lexsort((np.arange(k), -w, owners))  # by owner, then largest first
    ow = owners[order]
    csum = np.cumsum(w[order])
    start = np.searchsorted(ow, ow, side="left")  # first position of each item's owner block
    before = np.where(start > 0, csum[np.maximum(start - 1, 0)], 0.0)
    keep_sorted = (csum - before) <= cap * (1 + 1e-12)
    assign = np.full(k, -1, dtype=np.int64)
    assign[order[keep_sorted]] = ow[keep_sorted]
    loads = np.bincount(owners[assign >= 0], weights=w[assign >= 0], minlength=world).astype(np.float64)
    heap = [(float(loads[r]), r) for r in range(world)]
    heapq.heapify(heap)
    rest = np.nonzero(assign < 0)[0]
    for i in rest[np.lexsort((rest, -w[rest]))]:
        load, r = heapq.heappop(heap)
        assign[i] = r
        heapq.heappush(heap, (load + float(w[i]), r))
    return assign


def _match_parts_to_owners(parts: list[list[int]], owners: np.ndarray, world: int) -> list[list[int]]:
    """Greedy: give each part to the rank that already owns most of its items (ties: lowest rank)."""
    overlap = np.zeros((len(parts), world), dtype=np.int64)
    for i, p in enumerate(parts):
        if p:
            np.add.at(overlap[i], owners[p], 1)
    out: list[list[int] | None] = [None] * world
    free_parts = np.ones(len(parts), dtype=bool)
    free_ranks = np.ones(world, dtype=bool)
    # largest overlaps first; ties by part, then rank (deterministic)
    flat = overlap.reshape(-1)
    cand = np.lexsort((np.tile(np.arange(world), len(parts)), np.repeat(np.arange(len(parts)), world), -flat))
    for c in cand:
        i, r = divmod(int(c), world)
        if free_parts[i] and free_ranks[r]:
            out[r] = parts[i]
            free_parts[i] = free_ranks[r] = False
    return [p if p is not None else [] for p in out]
