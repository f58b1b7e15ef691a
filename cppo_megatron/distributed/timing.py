"""How long each rank waits for the slowest one at the step barrier.

A barrier measured with a wall clock mixes in its own latency and scheduling noise.
Instead every rank reports how long its own passes took; a rank waits at the barrier for
exactly (slowest rank's time - its own time). One all-gather of one number per rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["rank_wait_metrics", "wait_stats"]


def rank_wait_metrics(compute_seconds: float, *, group=None, device=None, prefix: str = "cppo/") -> dict[str, float]:
    """Gather every rank's compute time of a step and derive the barrier waits.

    ``compute_seconds``: this rank's busy seconds (float >= 0); a collective over ``group``.

    Returns (identical on all ranks): ``rank_time_max``, ``rank_time_mean``,
    ``rank_time_imbalance`` (max / mean), ``rank_wait_mean`` and ``rank_wait_max``
    (seconds the ranks idle while the slowest finishes), ``rank_wait_fraction`` (idle
    share of the ranks' total step time).
    """
    v = float(compute_seconds)
    if not v >= 0:
        raise ValueError(f"compute_seconds must be >= 0, got {compute_seconds!r}")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    world = dist.get_world_size(group)
    mine = torch.tensor([v], dtype=torch.float64, device=device)
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine, group=group)
    return wait_stats(torch.cat(parts).cpu().tolist(), prefix=prefix)


def wait_stats(seconds, *, prefix: str = "cppo/") -> dict[str, float]:
    """The barrier waits implied by every rank's compute time ``seconds`` ([W] floats, one per
    rank): the metrics of ``rank_wait_metrics``, computed without communication."""
    t = torch.as_tensor(seconds, dtype=torch.float64).reshape(-1)
    if t.numel() == 0 or not bool((t >= 0).all()):
        raise ValueError(f"seconds must be a non-empty list of times >= 0, got {seconds!r}")
    world = t.numel()
    top = float(t.max())
    wait = top - t
    mean = float(t.mean())
    return {
        f"{prefix}rank_time_max": top,
        f"{prefix}rank_time_mean": mean,
        f"{prefix}rank_time_imbalance": top / mean if mean > 0 else 1.0,
        f"{prefix}rank_wait_mean": float(wait.mean()),
        f"{prefix}rank_wait_max": float(wait.max()),
        f"{prefix}rank_wait_fraction": float(wait.sum()) / (top * world) if top > 0 else 0.0,
    }
