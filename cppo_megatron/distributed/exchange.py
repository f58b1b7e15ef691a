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

Fields: a dict name -> value, where a value is either a tensor ``[n, ...]`` (one row per
sequence, "dense") or a list of n tensors ``[L_i, ...]`` whose first dimension varies
("ragged", e.g. token ids of different lengths). Dtypes and trailing shapes must agree
across ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from ..core import PruneResult, balance_partitions, prune, sequence_workload
from ..core._checks import check_config

if TYPE_CHECKING:
    from ..config import CPPOConfig

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

FieldValue = torch.Tensor | list  # dense [n, ...] or ragged: n tensors


# ----------------------------------------------------------------------------- metadata
@dataclass(frozen=True)
class GlobalMetadata:
    """Per-sequence metadata of every rank, in global order (rank 0's rows first).

    Attributes:
        counts: W ints, sequences held by each rank before pruning (N = their sum).
        rewards: [N] float64. group_ids: [N] int64. lengths: [N] int64 token counts.
    """

    counts: list[int]
    rewards: torch.Tensor
    group_ids: torch.Tensor
    lengths: torch.Tensor

    @property
    def world_size(self) -> int:
        """W, the ranks of the group."""
        return len(self.counts)

    @property
    def offsets(self) -> list[int]:
        """W ints: the global index of each rank's first sequence."""
        return [0] + list(np.cumsum(self.counts)[:-1].tolist()) if self.counts else []

    def owner(self) -> torch.Tensor:
        """[N] int64, the rank that holds each sequence."""
        return torch.repeat_interleave(torch.arange(self.world_size), torch.tensor(self.counts))

    def local_index(self) -> torch.Tensor:
        """[N] int64, each sequence's index on its owner."""
        return torch.cat([torch.arange(c) for c in self.counts]) if self.counts else torch.empty(0)


def _group_ctx(group):
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    return rank, world


def _comm_device(group, device) -> torch.device:
    if device is not None:
        return torch.device(device)
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_metadata(rewards, group_ids, lengths, *, group=None, device=None) -> GlobalMetadata:
    """All-gather the per-sequence metadata of every rank in ``group`` (a collective: call
    it on every rank).

    Args:
        rewards: [n] float rewards of this rank's sequences.
        group_ids: [n] int64 global prompt ids (below 2**53).
        lengths: [n] int64 token counts (>= 0).
        group: the process group (default: the world). device: where the buffers live
            (default: cuda for NCCL, else cpu).

    Returns:
        the ``GlobalMetadata`` of all N = sum of n sequences, rank 0's first; identical on
        every rank. ``n`` may differ between ranks and may be 0.
    """
    r = torch.as_tensor(rewards).detach()
    g = torch.as_tensor(group_ids).detach()
    ln = torch.as_tensor(lengths).detach()
    for name, t in (("rewards", r), ("group_ids", g), ("lengths", ln)):
        if t.dim() != 1:
            raise ValueError(f"{name} must be 1-D [n], got shape {tuple(t.shape)}")
    n = r.numel()
    if g.numel() != n or ln.numel() != n:
        raise ValueError(
            f"rewards ({n}), group_ids ({g.numel()}) and lengths ({ln.numel()}) must have one entry "
            "per local sequence"
        )
    if g.is_floating_point() or ln.is_floating_point():
        raise ValueError(f"group_ids and lengths must be integer tensors, got {g.dtype} and {ln.dtype}")
    if n and int(g.abs().max()) >= 2**53:
        raise ValueError(f"group_ids must be below 2**53 (they travel as float64), got {int(g.abs().max())}")
    if n and bool((ln < 0).any()):
        i = int((ln < 0).nonzero()[0])
        raise ValueError(f"lengths[{i}] = {int(ln[i])} is negative")
    dev = _comm_device(group, device)
    _, world = _group_ctx(group)
    count = torch.tensor([n], dtype=torch.int64, device=dev)
    counts_t = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(world)]
    dist.all_gather(counts_t, count, group=group)
    counts = [int(c.item()) for c in counts_t]
    cap = max(max(counts), 1)
    # one [3, cap] float64 buffer per rank: rewards, group ids, lengths (ids < 2**53 are exact)
    buf = torch.zeros(3, cap, dtype=torch.float64, device=dev)
    buf[0, :n] = r.to(dev, torch.float64)
    buf[1, :n] = g.to(dev, torch.float64)
    buf[2, :n] = ln.to(dev, torch.float64)
    bufs = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(bufs, buf, group=group)
    cat = torch.cat([b[:, :c].cpu() for b, c in zip(bufs, counts, strict=True)], dim=1)
    return GlobalMetadata(counts, cat[0].clone(), cat[1].to(torch.int64), cat[2].to(torch.int64))


# ----------------------------------------------------------------------------- plan
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


# ----------------------------------------------------------------------------- moving rows
@dataclass(frozen=True)
class _Spec:
    name: str
    ragged: bool
    dtype: torch.dtype
    trailing: tuple


def _local_specs(fields: dict) -> dict:
    specs: dict[str, tuple[bool, str, tuple[int, ...]] | None] = {}
    for name, v in fields.items():
        if isinstance(v, torch.Tensor):
            if v.dim() < 1:
                raise ValueError(f"field {name!r} must be [n, ...] (one row per sequence), got a scalar")
            specs[name] = (False, str(v.dtype), tuple(v.shape[1:]))
        elif isinstance(v, (list, tuple)):
            rows = [t for t in v if isinstance(t, torch.Tensor)]
            if len(rows) != len(v):
                raise ValueError(f"field {name!r}: a ragged field must be a list of tensors")
            if not rows:
                specs[name] = None  # unknown on this rank
                continue
            for i, t in enumerate(rows):
                if t.dim() < 1:
                    raise ValueError(f"field {name!r}[{i}] must be [L, ...], got a scalar")
                if t.dtype != rows[0].dtype or t.shape[1:] != rows[0].shape[1:]:
                    raise ValueError(
                        f"field {name!r}[{i}] has dtype {t.dtype} and trailing shape {tuple(t.shape[1:])}; "
                        f"row 0 has {rows[0].dtype}, {tuple(rows[0].shape[1:])}"
                    )
            specs[name] = (True, str(rows[0].dtype), tuple(rows[0].shape[1:]))
        else:
            raise ValueError(f"field {name!r} must be a tensor [n, ...] or a list of tensors, got {type(v).__name__}")
    return specs


def _agree_specs(fields: dict, group) -> list[_Spec]:
    """Every rank must describe the same fields; a rank with no rows learns the spec of the others."""
    mine = _local_specs(fields)
    _, world = _group_ctx(group)
    all_specs: list = [None] * world
    dist.all_gather_object(all_specs, mine, group=group)
    names = sorted(all_specs[0])
    out = []
    for r, s in enumerate(all_specs):
        if sorted(s) != names:
            raise ValueError(
                f"rank {r} has fields {sorted(s)} but rank 0 has {names}: every rank needs the same fields"
            )
    for name in names:
        known = [(r, s[name]) for r, s in enumerate(all_specs) if s[name] is not None]
        if not known:
            # nobody has a row: any spec will do
            out.append(_Spec(name, True, torch.float32, ()))
            continue
        r0, ref = known[0]
        for r, s in known[1:]:
            if s != ref:
                raise ValueError(
                    f"field {name!r}: rank {r} has (ragged, dtype, trailing shape) {s} but rank {r0} has {ref}"
                )
        out.append(_Spec(name, ref[0], getattr(torch, ref[1].split(".")[-1]), ref[2]))
    return out


def _numel(shape) -> int:
    return int(np.prod(shape)) if len(shape) else 1


def _p2p(send: dict, recv: dict, group) -> None:
    """send/recv: peer (group rank) -> tensor. One batched round; empty transfers skipped."""
    group = group if group is not None else dist.group.WORLD
    ops = []
    for peer, t in sorted(send.items()):
        if t.numel():
            ops.append(dist.P2POp(dist.isend, t, dist.get_global_rank(group, peer), group))
    for peer, t in sorted(recv.items()):
        if t.numel():
            ops.append(dist.P2POp(dist.irecv, t, dist.get_global_rank(group, peer), group))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()


def exchange_rows(
    fields: dict,
    send_rows: Sequence[torch.Tensor],
    recv_counts: Sequence[int],
    *,
    group=None,
    device=None,
    specs: list | None = None,
) -> dict:
    """Move rows between the ranks of ``group`` point to point (a collective: every rank calls it).

    Args:
        fields: name -> a tensor [n, ...] (dense) or a list of n tensors [L_i, ...] (ragged);
            dtypes and trailing shapes must agree across ranks.
        send_rows: W int64 tensors, ``send_rows[d]`` the local row indices sent to rank d.
        recv_counts: W ints, ``recv_counts[s]`` the rows rank s sends here.
        group, device: as in ``gather_metadata``. specs: the fields' agreed specs, when
            already known (skips one collective).

    Returns:
        name -> [sum(recv_counts), ...] tensor or a list of that many tensors: rows ordered
        by source rank, then in the order the source sent them.
    """
    rank, world = _group_ctx(group)
    if len(send_rows) != world or len(recv_counts) != world:
        raise ValueError(f"send_rows and recv_counts need one entry per rank ({world})")
    dev = _comm_device(group, device)
    specs = specs if specs is not None else _agree_specs(fields, group)
    ragged = [s for s in specs if s.ragged]

    def rows_of(spec, idx):
        v = fields[spec.name]
        if spec.ragged:
            return [v[i] for i in idx.tolist()]
        return v[idx.to(v.device)]

    # round 1: the leading length of every ragged row (receivers cannot know them)
    send_hdr, recv_hdr = {}, {}
    for d in range(world):
        idx = torch.as_tensor(send_rows[d], dtype=torch.int64)
        if d == rank or not ragged:
            continue
        row_lens = [[int(t.shape[0]) for t in rows_of(s, idx)] for s in ragged]
        send_hdr[d] = torch.tensor(row_lens, dtype=torch.int64, device=dev).reshape(-1)
    for s in range(world):
        if s != rank and ragged:
            recv_hdr[s] = torch.empty(len(ragged) * int(recv_counts[s]), dtype=torch.int64, device=dev)
    _p2p(send_hdr, recv_hdr, group)

    # round 2: one byte buffer per peer, field after field
    def pack(idx):
        parts = []
        for s in specs:
            rows = rows_of(s, idx)
            if s.ragged:
                t = torch.cat(rows) if rows else torch.empty((0, *s.trailing), dtype=s.dtype)
            else:
                t = rows
            parts.append(t.detach().to(dev).contiguous().reshape(-1).view(torch.uint8))
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=dev)

    send_buf, recv_buf, recv_lens = {}, {}, {}
    for d in range(world):
        if d != rank:
            send_buf[d] = pack(torch.as_tensor(send_rows[d], dtype=torch.int64))
    for s in range(world):
        if s == rank:
            continue
        c = int(recv_counts[s])
        lens = recv_hdr[s].cpu().reshape(len(ragged), c) if ragged else torch.empty(0, c, dtype=torch.int64)
        recv_lens[s] = lens
        nbytes = 0
        for sp in specs:
            rows = int(lens[ragged.index(sp)].sum()) if sp.ragged else c
            nbytes += rows * _numel(sp.trailing) * torch.empty(0, dtype=sp.dtype).element_size()
        recv_buf[s] = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    _p2p(send_buf, recv_buf, group)

    # unpack in source order; our own rows are copied locally
    out: dict = {s.name: [] for s in specs}
    for src in range(world):
        if src == rank:
            idx = torch.as_tensor(send_rows[rank], dtype=torch.int64)
            for sp in specs:
                rows = rows_of(sp, idx)
                out[sp.name].append([t.to(dev) for t in rows] if sp.ragged else rows.to(dev))
            continue
        buf, pos, c = recv_buf[src], 0, int(recv_counts[src])
        for sp in specs:
            isz = torch.empty(0, dtype=sp.dtype).element_size()
            if sp.ragged:
                row_counts = recv_lens[src][ragged.index(sp)].tolist()
                nb = int(sum(row_counts)) * _numel(sp.trailing) * isz
                # clone first: a byte slice at an unaligned offset cannot be viewed as a wider dtype
                flat = buf[pos : pos + nb].clone().view(sp.dtype).reshape(-1, *sp.trailing)
                out[sp.name].append(list(torch.split(flat, row_counts)) if row_counts else [])
            else:
                nb = c * _numel(sp.trailing) * isz
                out[sp.name].append(buf[pos : pos + nb].clone().view(sp.dtype).reshape(c, *sp.trailing))
            pos += nb
    result: dict[str, FieldValue] = {}
    for sp in specs:
        chunks = out[sp.name]
        if sp.ragged:
            result[sp.name] = [t for ch in chunks for t in ch]
        else:
            empty = torch.empty((0, *sp.trailing), dtype=sp.dtype, device=dev)
            result[sp.name] = torch.cat(chunks) if chunks else empty
    return result


# ----------------------------------------------------------------------------- handle
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
    rank, _ = _group_ctx(group)
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
    rank, world = _group_ctx(group)
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
    dev = _comm_device(group, device)
    t = torch.tensor([float(value)], dtype=torch.float64, device=dev)
    dist.all_reduce(t, group=group)
    return float(t.item())
