"""Per-sequence metadata of every data-parallel rank, gathered once per step.

``gather_metadata`` all-gathers a few numbers per sequence (reward, group id, token count)
— never the tokens — so that every rank can run the same CPPO decision over the whole
batch (``exchange.prune_and_exchange``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["GlobalMetadata", "comm_device", "gather_metadata", "group_ctx"]


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


def group_ctx(group) -> tuple[int, int]:
    """(rank, world size) of this process in ``group`` (None: the default group)."""
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    return rank, world


def comm_device(group, device) -> torch.device:
    """The device a collective on ``group`` exchanges tensors on: ``device`` when given, else
    the current CUDA device for NCCL and the CPU otherwise."""
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
    dev = comm_device(group, device)
    _, world = group_ctx(group)
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
