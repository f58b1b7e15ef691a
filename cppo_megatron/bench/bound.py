"""The speedup bound of completion pruning, shared by every benchmark that reports speedups.

Pruning a fraction P of the completions shrinks only the passes after reward (old-policy and
reference log-probs, policy update); rollout and reward keep their cost. With T_gen and T_rest
the per-step times of those two parts measured on the full (GRPO) batch:

    S_max(P) = (T_gen + T_rest) / (T_gen + (1 - P) * T_rest)

A measured speedup is reported as a fraction of this bound (``fraction_of_bound``).
"""

from __future__ import annotations

import math

__all__ = ["speedup_bound", "fraction_of_bound", "speedup"]


def _finite(name: str, v, *, minimum: float = 0.0) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number, got {v!r}")
    if v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v!r}")
    return float(v)


def speedup_bound(pruning_rate: float, t_gen: float, t_rest: float) -> float:
    """S_max(P) = (t_gen + t_rest) / (t_gen + (1 - P) t_rest).

    Args:
        pruning_rate: P in [0, 1).
        t_gen: seconds per GRPO step in rollout + reward (not shrunk by pruning).
        t_rest: seconds per GRPO step in the old, reference and update passes.
    """
    p = _finite("pruning_rate", pruning_rate)
    if p >= 1.0:
        raise ValueError(f"pruning_rate must be in [0, 1), got {pruning_rate!r}")
    g = _finite("t_gen", t_gen)
    r = _finite("t_rest", t_rest)
    if g + r <= 0:
        raise ValueError(f"t_gen + t_rest must be > 0, got t_gen={t_gen!r}, t_rest={t_rest!r}")
    return (g + r) / (g + (1.0 - p) * r)


def speedup(baseline_seconds: float, seconds: float) -> float:
    """baseline / measured time for the same work (e.g. seconds per prompt processed)."""
    b = _finite("baseline_seconds", baseline_seconds)
    s = _finite("seconds", seconds)
    if s <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds!r}")
    return b / s


def fraction_of_bound(measured_speedup: float, bound: float) -> float:
    """measured / bound (1.0 = the bound is reached; above 1 means something besides
    pruning sped the run up, e.g. larger rollout batches under allocation)."""
    m = _finite("measured_speedup", measured_speedup)
    b = _finite("bound", bound, minimum=1.0)
    return m / b
