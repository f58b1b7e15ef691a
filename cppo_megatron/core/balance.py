"""Assign sequences to data-parallel ranks so the slowest rank finishes as early as possible.

After pruning, the survivors are a ragged, long-tailed set; splitting them in contiguous
chunks leaves some ranks with several long reasoning traces and others idle. The balancer
minimises the largest rank workload:

1. Karmarkar-Karp largest differencing (multi-way), the method veRL's ``_balance_batch``
   uses, for up to ``KK_MAX_ITEMS`` items and ``KK_MAX_CELLS`` items x ranks (with
   equal-size parts, also capped LPT, keeping the better start);
   a vectorised longest-processing-time pass in rounds of ``num_parts`` for larger inputs,
   brought within ``_STOP_TOL`` of the bound by the refinement (1M sequences into 256
   ranks in under a second);
2. then a local search that moves or swaps single items between the most loaded rank and
   a lighter one while that lowers the pair's maximum (swaps only in equal-size mode),
   taking the change that leaves the pair's maximum lowest (a sorted search per part),
   until the largest part is within ``_STOP_TOL`` of the lower bound.

The workload of one sequence is ``a * len + b * len**2`` (attention is quadratic); the
defaults a = 24576, b = 1 are veRL's, so both balancers optimise the same objective.
"""

from __future__ import annotations

import gc
import heapq
import math
from dataclasses import dataclass

import numpy as np
import torch

from ._checks import as_1d_float, check_float, check_int

__all__ = [
    "Partition",
    "balance_partitions",
    "naive_partition",
    "pack_micro_batches",
    "sequence_workload",
    "lower_bound",
]

KK_MAX_CELLS = 4_000_000  # items * parts above which KK's O(N k) cost is replaced by rounds
KK_MAX_ITEMS = 8192  # above this many items LPT + refinement replaces KK: within _STOP_TOL, far cheaper
_REL_TOL = 1e-12
_LPT_HEAD_ROUNDS = 8  # largest 8k items placed one by one (heap) before the vectorised rounds
_STOP_TOL = 1e-4  # within 0.01% of the lower bound: further swaps buy nothing a step time can show
_NEAR_PARTS = 8  # swap partners looked for among this many lightest parts before all of them


def sequence_workload(lengths, *, linear: float = 24576.0, quadratic: float = 1.0) -> torch.Tensor:
    """Per-sequence cost model of a forward/backward pass.

    Args:
        lengths: [N] token counts (int or float, >= 0).
        linear, quadratic: a and b in ``a * len + b * len**2``, both >= 0 (defaults: veRL's
            ``_balance_batch`` model).

    Returns:
        [N] float64 workloads.
    """
    n = as_1d_float("lengths", lengths, allow_empty=True).to(torch.float64)
    if bool((n < 0).any()):
        i = int((n < 0).nonzero()[0])
        raise ValueError(f"lengths[{i}] = {n[i].item()} is negative")
    linear = check_float("linear", linear, minimum=0.0)
    quadratic = check_float("quadratic", quadratic, minimum=0.0)
    return linear * n + quadratic * n * n


def lower_bound(workloads, num_parts: int, *, equal_size: bool = False) -> float:
    """No assignment can have a largest part below max(total / k, largest item).

    With ``equal_size`` the part holding the largest item also holds at least
    floor(N / k) - 1 others, so it weighs at least the largest plus that many smallest.

    Args:
        workloads: [N] float, >= 0. num_parts: k >= 1.

    Returns:
        the bound, a float (0.0 for N = 0).
    """
    w = _as_workloads(workloads)
    k = check_int("num_parts", num_parts, minimum=1)
    if w.size == 0:
        return 0.0
    bound = max(w.sum() / k, w.max())
    others = w.size // k - 1
    if equal_size and others > 0:
        bound = max(bound, w.max() + np.sort(w)[:others].sum())
    return float(bound)


@dataclass(frozen=True)
class Partition:
    """An assignment of N items to k parts.

    Attributes:
        parts: k lists of item indices (ints in [0, N)), each ascending.
        loads: [k] float64 numpy array, total workload per part.
        lower_bound: no partition can do better (``lower_bound``).
        method: which algorithm produced it.
    """

    parts: list[list[int]]
    loads: np.ndarray
    lower_bound: float
    method: str

    @property
    def num_parts(self) -> int:
        """k."""
        return len(self.parts)

    @property
    def max_load(self) -> float:
        """The largest part's workload (what the slowest rank costs)."""
        return float(self.loads.max()) if self.loads.size else 0.0

    @property
    def imbalance(self) -> float:
        """max / mean part workload (1.0 is perfect)."""
        mean = float(self.loads.mean()) if self.loads.size else 0.0
        return self.max_load / mean if mean > 0 else 1.0

    @property
    def gap_to_bound(self) -> float:
        """max_load / lower_bound - 1 (0.0: provably optimal)."""
        return self.max_load / self.lower_bound - 1.0 if self.lower_bound > 0 else 0.0

    def assignment(self) -> torch.Tensor:
        """[N] int64 part index of every item."""
        n = sum(len(p) for p in self.parts)
        out = torch.empty(n, dtype=torch.int64)
        for r, p in enumerate(self.parts):
            out[p] = r
        return out

    def metrics(self, prefix: str = "cppo/balance_") -> dict[str, float]:
        """imbalance, gap_to_bound, max_load, min_load as plain floats."""
        return {
            f"{prefix}imbalance": self.imbalance,
            f"{prefix}gap_to_bound": self.gap_to_bound,
            f"{prefix}max_load": self.max_load,
            f"{prefix}min_load": float(self.loads.min()) if self.loads.size else 0.0,
        }


def balance_partitions(
    workloads,
    num_parts: int,
    *,
    equal_size: bool = False,
    refine: bool = True,
    max_refine_steps: int | None = None,
) -> Partition:
    """Partition items into ``num_parts`` parts minimising the largest part's workload.

    Args:
        workloads: [N] non-negative workloads (e.g. ``sequence_workload(lengths)``).
        num_parts: k, the number of ranks (or micro-batches).
        equal_size: every part gets floor(N/k) or ceil(N/k) items (exactly N/k when k
            divides N), for frameworks that split batches into equal chunks.
        refine: run the move/swap local search after the construction.
        max_refine_steps: bound on local-search improvements (default 4k + 64).

    Returns:
        a ``Partition`` of the N item indices into k parts. Every item lands in exactly
        one part; parts may be empty when N < k (with ``equal_size`` the counts still
        differ by at most one).

    Example::

        >>> balance_partitions([5.0, 4.0, 3.0, 3.0, 3.0], 2).parts  # loads 9 and 9
        [[2, 3, 4], [0, 1]]
    """
    w = _as_workloads(workloads)
    k = check_int("num_parts", num_parts, minimum=1)
    if not isinstance(equal_size, bool):
        raise ValueError(f"equal_size must be true or false, got {equal_size!r}")
    n = w.size
    lb = lower_bound(w, k, equal_size=equal_size) if n else 0.0
    if n == 0:
        return Partition([[] for _ in range(k)], np.zeros(k), 0.0, "empty")

    if n * k <= KK_MAX_CELLS and n <= KK_MAX_ITEMS:
        members = _karmarkar_karp(w, k, equal_size)
        method = "kk"
        if equal_size and k > 1 and max(w[m].sum() for m in members) > lb * (1 + _STOP_TOL):
            # Equal-size KK merges whole rows of k items, which can pair the largest item
            # with other large ones (lognormal tails: 2.2x the mean where 1.6x is optimal).
            # Sequential LPT with a cap on items per part leaves a part holding a huge item
            # open until the others catch up, then fills it with the smallest items. Both
            # are cheap here, so start from whichever is better.
            lpt = _lpt_capped(w, k)
            if max(w[m].sum() for m in lpt) < max(w[m].sum() for m in members):
                members, method = lpt, "lpt"
    else:
        members = _lpt_rounds(w, k, equal_size)
        method = "lpt"
    if refine and k > 1:
        steps = max_refine_steps if max_refine_steps is not None else 4 * k + 64
        members = _refine(w, members, allow_moves=not equal_size, max_steps=steps, bound=lb)
        method += "+refine"
    return _partition(w, members, lb, method)


def _partition(w: np.ndarray, members: list[np.ndarray], lb: float, method: str) -> Partition:
    members = [np.sort(m) for m in members]
    loads = np.array([w[m].sum() for m in members], dtype=np.float64)
    return Partition([m.tolist() for m in members], loads, lb, method)


def naive_partition(workloads, num_parts: int) -> Partition:
    """Contiguous chunks, as a pipeline without rebalancing splits its batch (for comparison).

    Args:
        workloads: [N] float, >= 0. num_parts: k >= 1.

    Returns:
        a ``Partition``: part i holds indices [round(i N / k), round((i + 1) N / k)).
    """
    w = _as_workloads(workloads)
    k = check_int("num_parts", num_parts, minimum=1)
    bounds = np.linspace(0, w.size, k + 1).round().astype(np.int64)
    members = [np.arange(bounds[i], bounds[i + 1]) for i in range(k)]
    return _partition(w, members, lower_bound(w, k) if w.size else 0.0, "naive")


def pack_micro_batches(token_counts, max_tokens: int, *, min_batches: int = 1) -> list[list[int]]:
    """Split sequences into the fewest balanced micro-batches of at most ``max_tokens`` tokens.

    Args:
        token_counts: [N] int tokens per sequence (what a padding-free forward processes).
        max_tokens: the budget per micro-batch; a single longer sequence is an error.
        min_batches: at least this many micro-batches (e.g. pipeline stages to fill).

    Returns:
        micro-batches: lists of sequence indices (ints in [0, N), each list ascending),
        largest token total first; every index appears exactly once.
    """
    w = _as_workloads(token_counts)
    budget = check_int("max_tokens", max_tokens, minimum=1)
    check_int("min_batches", min_batches, minimum=1)
    if w.size == 0:
        return []
    too_long = np.nonzero(w > budget)[0]
    if too_long.size:
        i = int(too_long[0])
        raise ValueError(
            f"sequence {i} has {int(w[i])} tokens, more than max_tokens={budget}: raise the micro-batch "
            "token budget to at least the longest sequence"
        )
    m = max(min_batches, math.ceil(float(w.sum()) / budget))
    m = min(m, w.size)
    while True:
        part = balance_partitions(w, m)
        if part.max_load <= budget or m >= w.size:
            break
        m += 1
    batches = [p for p in part.parts if p]
    batches.sort(key=lambda p: -float(w[p].sum()))
    return batches


# ---------------------------------------------------------------------------- internals
def _as_workloads(workloads) -> np.ndarray:
    t = as_1d_float("workloads", workloads, allow_empty=True)
    w = t.detach().to("cpu", torch.float64).numpy()
    neg = np.nonzero(w < 0)[0]
    if neg.size:
        i = int(neg[0])
        raise ValueError(f"workloads[{i}] = {w[i]} is negative")
    return w


def _karmarkar_karp(w: np.ndarray, k: int, equal_size: bool) -> list[np.ndarray]:
    """Multi-way largest differencing. A state is k slots (sum, members) sorted by sum,
    descending; members are nested pairs so that combining two slots is O(1)."""
    order = np.argsort(-w, kind="stable")
    states: list[tuple[float, int, list[float], list]] = []
    counter = 0
    if equal_size:
        # Each state starts as k consecutive items (largest first), one per slot, so
        # every merge adds the same count to every slot.
        for start in range(0, w.size, k):
            chunk = order[start : start + k]
            sums = [float(w[i]) for i in chunk] + [0.0] * (k - len(chunk))
            mem = [int(i) for i in chunk] + [None] * (k - len(chunk))
            states.append((-(sums[0] - sums[-1]), counter, sums, mem))
            counter += 1
    else:
        for i in order:
            sums = [float(w[i])] + [0.0] * (k - 1)
            states.append((-sums[0], counter, sums, [int(i)] + [None] * (k - 1)))
            counter += 1
    heapq.heapify(states)
    # The merges build many small nested tuples; the cyclic garbage collector would rescan
    # them all on every collection (most of KK's time at 4096 items x 256 ranks). They hold
    # no cycles, so pausing it is safe.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _kk_merge(states, k, counter)
    finally:
        if gc_was_enabled:
            gc.enable()


def _kk_merge(states: list, k: int, counter: int) -> list[np.ndarray]:
    while len(states) > 1:
        _, _, sa, ma = heapq.heappop(states)
        _, _, sb, mb = heapq.heappop(states)
        # largest slot of one with the smallest of the other
        combined = sorted(
            ((sa[i] + sb[k - 1 - i], _join(ma[i], mb[k - 1 - i])) for i in range(k)),
            key=lambda t: -t[0],
        )
        sums = [c[0] for c in combined]
        mem = [c[1] for c in combined]
        heapq.heappush(states, (-(sums[0] - sums[-1]), counter, sums, mem))
        counter += 1
    _, _, _, mem = states[0]
    return [np.array(_flatten(m), dtype=np.int64) for m in mem]


def _join(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return (a, b)


def _flatten(m) -> list[int]:
    out: list[int] = []
    stack = [m]
    while stack:
        x = stack.pop()
        if x is None:
            continue
        if isinstance(x, tuple):
            stack.extend(x)
        else:
            out.append(x)
    return out


def _lpt_rounds(w: np.ndarray, k: int, equal_size: bool) -> list[np.ndarray]:
    """Longest processing time first, vectorised: the largest items go one by one to the
    least loaded rank (skipped in equal-size mode), the rest k at a time, the round's
    largest to the least loaded rank (every rank gets one item per round)."""
    order = np.argsort(-w, kind="stable")
    loads = np.zeros(k)
    owner = np.empty(w.size, dtype=np.int64)
    head = 0 if equal_size else min(w.size, _LPT_HEAD_ROUNDS * k)
    heap = [(0.0, r) for r in range(k)]
    for i in order[:head]:
        load, r = heapq.heappop(heap)
        owner[i] = r
        heapq.heappush(heap, (load + w[i], r))
    for load, r in heap:
        loads[r] = load
    for start in range(head, w.size, k):
        idx = order[start : start + k]
        ranks = np.argsort(loads, kind="stable")[: idx.size]
        loads[ranks] += w[idx]
        owner[idx] = ranks
    order = np.argsort(owner, kind="stable")
    counts = np.bincount(owner, minlength=k)
    return np.split(order, np.cumsum(counts)[:-1])


def _lpt_capped(w: np.ndarray, k: int) -> list[np.ndarray]:
    """Largest first, each to the least loaded part that still has room; parts hold
    ceil(N/k) (the first N mod k parts) or floor(N/k) items."""
    n = w.size
    caps = [n // k + (1 if r < n % k else 0) for r in range(k)]
    owner = np.empty(n, dtype=np.int64)
    heap = [(0.0, r) for r in range(k) if caps[r] > 0]
    heapq.heapify(heap)
    for i in np.argsort(-w, kind="stable").tolist():
        load, r = heapq.heappop(heap)
        owner[i] = r
        caps[r] -= 1
        if caps[r]:
            heapq.heappush(heap, (load + w[i], r))
    order = np.argsort(owner, kind="stable")
    return np.split(order, np.cumsum(np.bincount(owner, minlength=k))[:-1])


def _refine(w: np.ndarray, members: list[np.ndarray], *, allow_moves: bool, max_steps: int, bound: float):
    """Lower the largest part: move one item (or swap two) between it and a lighter part
    while the pair's maximum drops, taking the change that leaves the pair's maximum lowest
    with the lightest part, else among the ``_NEAR_PARTS`` lightest, else among all. Each
    accepted change strictly lowers the sum of squared loads, so the search terminates;
    ``max_steps`` bounds it anyway."""
    items = [np.asarray(m, dtype=np.int64) for m in members]
    loads = np.array([w[m].sum() for m in items], dtype=np.float64)
    for _ in range(max_steps):
        h = int(np.argmax(loads))
        top = loads[h]
        if top <= bound * (1 + _STOP_TOL):
            break
        change = _best_change(w, items, loads, h, allow_moves)
        if change is None:
            break  # no move or swap lowers the largest part: done
        a, b, j, delta = change
        xh = items[h][a]
        if b is None:  # move
            items[h] = np.delete(items[h], a)
            items[j] = np.append(items[j], xh)
        else:
            yj = items[j][b]
            items[h][a] = yj
            items[j][b] = xh
        loads[h] -= delta
        loads[j] += delta
    return items


def _best_change(w: np.ndarray, items: list[np.ndarray], loads: np.ndarray, h: int, allow_moves: bool):
    """The move (position a of the heaviest part h to part j) or swap (a <-> position b of
    part j) after which max(load_h, load_j) is lowest, if below the current load_h.
    Returns (a, b or None, j, transferred workload) or None.

    For one pair the best transfer is the one closest to half their difference, so per
    candidate part a sorted search finds it in O(m log m)."""
    top = loads[h]
    hw = w[items[h]]  # not empty: _refine calls this only while top > bound >= the largest item
    best: tuple[float, int, int | None, int, float] | None = None  # (new pair max, a, b or None: a move, j, delta)
    if allow_moves:
        j = int(np.argmin(loads))
        diff = top - loads[j]
        ok = (hw > 0) & (hw < diff)
        if j != h and ok.any():
            score = np.where(ok, np.abs(hw - diff / 2), np.inf)
            a = int(np.argmin(score))
            best = (max(top - hw[a], loads[j] + hw[a]), a, None, j, float(hw[a]))
    by_load = np.argsort(loads, kind="stable")
    sizes = np.array([m.size for m in items])
    by_load = by_load[(by_load != h) & (loads[by_load] < top) & (sizes[by_load] > 0)]  # swap partners
    for tier in (by_load[:1], by_load[1:_NEAR_PARTS], by_load[_NEAR_PARTS:]):
        for j in tier.tolist():
            jw = w[items[j]]
            diff = top - loads[j]
            order = np.argsort(jw, kind="stable")
            ys = jw[order]
            pos = np.searchsorted(ys, hw - diff / 2)
            for cand in (np.minimum(pos, ys.size - 1), np.maximum(pos - 1, 0)):
                delta = hw - ys[cand]
                ok = (delta > 0) & (delta < diff)
                if not ok.any():
                    continue
                score = np.where(ok, np.abs(delta - diff / 2), np.inf)
                a = int(np.argmin(score))
                new_max = max(top - delta[a], loads[j] + delta[a])
                if best is None or new_max < best[0]:
                    best = (new_max, a, int(order[cand[a]]), j, float(delta[a]))
        if best is not None and best[0] < top * (1 - _REL_TOL):
            break
    if best is None or not best[0] < top * (1 - _REL_TOL):
        return None
    return best[1:]
