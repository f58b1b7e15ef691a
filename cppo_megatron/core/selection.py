"""Choose which completions survive pruning.

The ranking is fully deterministic: scores are ordered with a stable sort over a seeded
random permutation, so equal scores are broken by the seed (and the step), never by
whatever order a kernel happens to return. Selection always runs on the CPU so that every
rank, whatever its device, computes bit-identical decisions from identical inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ._checks import as_1d_float, as_group_ids, check_int
from .advantage import GroupStats
from .sampling import grouped_layout, inclusion_probabilities, mass_keep_counts, systematic_sample
from .settings import DEFAULT_PRUNING_RATE, METRICS, SCOPES, check_config, keep_count

if TYPE_CHECKING:
    from .settings import CPPOConfig

__all__ = [
    "DEFAULT_PRUNING_RATE",
    "METRICS",
    "SCOPES",
    "Pools",
    "Selection",
    "choose_kept",
    "keep_count",
    "keep_counts",
    "keep_order",
    "select_completions",
    "seeded_generator",
]

# stream of seeded_generator used by the importance design (stream 0 is the tie-break order)
IMPORTANCE_STREAM = 1

def seeded_generator(seed: int, step: int = 0, stream: int = 0) -> torch.Generator:
    """A CPU ``torch.Generator`` that depends on (seed, step, stream) only: identical on
    every rank. ``seed``: int; ``step``: int >= 0; ``stream``: int, separates independent
    uses of one (seed, step) (the prompt sampler uses 7)."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    check_int("step", step, minimum=0)
    # SplitMix-style mixing keeps nearby (seed, step) pairs far apart.
    x = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + stream * 0x94D049BB133111EB) & (
        (1 << 64) - 1
    )
    x ^= x >> 31
    gen = torch.Generator(device="cpu")
    gen.manual_seed(x & ((1 << 63) - 1))
    return gen


@dataclass(frozen=True)
class Selection:
    """The outcome of pruning one batch.

    Attributes:
        kept: [K] int64 ascending indices of surviving completions.
        pruned: [N - K] int64 ascending indices of pruned completions.
        group_ids: [M] int64 distinct group ids, ascending.
        group_size: [M] int64 completions per group before pruning.
        kept_per_group: [M] int64 survivors per group.
        advantages: [N] float, the advantages the decision was made on.
        scope, metric, use_abs: the settings used (logged with the run).
        weights: [K] float32, aligned with ``kept``: the factor each survivor's loss is
            multiplied by. 1.0 for the deterministic metrics; 1 / pi_i (Horvitz-Thompson)
            for ``importance``, so that sum_kept w_i l_i is an unbiased estimate of
            sum_all l_i for any per-completion l whose A_i != 0 (and of the whole sum when
            every pi_i > 0). None at construction means all ones.
        keep_mass: the ``keep_mass`` fraction that decided the counts (None: fixed k).
    """

    kept: torch.Tensor
    pruned: torch.Tensor
    group_ids: torch.Tensor
    group_size: torch.Tensor
    kept_per_group: torch.Tensor
    advantages: torch.Tensor
    scope: str
    metric: str
    use_abs: bool
    weights: torch.Tensor | None = None
    keep_mass: float | None = None

    def __post_init__(self) -> None:
        if self.weights is None:
            object.__setattr__(self, "weights", torch.ones(self.kept.numel(), dtype=torch.float32))
        elif self.weights.shape != self.kept.shape:
            raise ValueError(
                f"Selection.weights {tuple(self.weights.shape)} must align with kept {tuple(self.kept.shape)}"
            )

    @property
    def weighted(self) -> bool:
        """True when the survivors carry importance weights (the loss must use them)."""
        return self.metric == "importance"

    @property
    def num_kept(self) -> int:
        """K."""
        return int(self.kept.numel())

    @property
    def num_pruned(self) -> int:
        """N - K."""
        return int(self.pruned.numel())

    @property
    def num_total(self) -> int:
        """N."""
        return self.num_kept + self.num_pruned

    def kept_mask(self) -> torch.Tensor:
        """[N] bool, True for survivors."""
        mask = torch.zeros(self.num_total, dtype=torch.bool)
        mask[self.kept] = True
        return mask

    def metrics(self, prefix: str = "cppo/") -> dict[str, float]:
        """Plain floats a user would plot (``cppo/`` keys)."""
        a = self.advantages.detach().to("cpu", torch.float64)
        absa = a.abs()
        kept_abs = absa[self.kept]
        pruned_abs = absa[self.pruned]
        n = max(self.num_total, 1)
        kpg = self.kept_per_group.to(torch.float64)
        sq_total = float(a.square().sum())
        assert self.weights is not None  # __post_init__ fills None with ones
        w = self.weights.to(torch.float64)
        out = {
            f"{prefix}num_completions": float(self.num_total),
            f"{prefix}num_kept": float(self.num_kept),
            f"{prefix}num_pruned": float(self.num_pruned),
            f"{prefix}kept_ratio": self.num_kept / n,
            f"{prefix}zero_adv_ratio": float((absa == 0).sum()) / n,
            f"{prefix}abs_adv_mean_kept": float(kept_abs.mean()) if kept_abs.numel() else 0.0,
            f"{prefix}abs_adv_mean_pruned": float(pruned_abs.mean()) if pruned_abs.numel() else 0.0,
            f"{prefix}adv_mean_kept": float(a[self.kept].mean()) if self.num_kept else 0.0,
            f"{prefix}num_groups": float(self.group_ids.numel()),
            f"{prefix}groups_fully_pruned": float((self.kept_per_group == 0).sum()),
            f"{prefix}kept_per_group_mean": float(kpg.mean()) if kpg.numel() else 0.0,
            f"{prefix}kept_per_group_min": float(kpg.min()) if kpg.numel() else 0.0,
            f"{prefix}kept_per_group_max": float(kpg.max()) if kpg.numel() else 0.0,
            # the distribution of k per group (adaptive with keep_mass, fixed otherwise)
            f"{prefix}kept_per_group_std": float(kpg.std(unbiased=False)) if kpg.numel() else 0.0,
            f"{prefix}kept_per_group_p10": float(torch.quantile(kpg, 0.1)) if kpg.numel() else 0.0,
            f"{prefix}kept_per_group_p50": float(torch.quantile(kpg, 0.5)) if kpg.numel() else 0.0,
            f"{prefix}kept_per_group_p90": float(torch.quantile(kpg, 0.9)) if kpg.numel() else 0.0,
            # share of the batch's A^2 (the gradient energy proxy keep_mass targets) that survives
            f"{prefix}kept_sq_adv_fraction": float(a[self.kept].square().sum()) / sq_total if sq_total > 0 else 1.0,
            f"{prefix}weight_mean": float(w.mean()) if w.numel() else 0.0,
            f"{prefix}weight_max": float(w.max()) if w.numel() else 0.0,
        }
        return out


def _keep_order(a_cpu: torch.Tensor, metric: str, use_abs: bool, seed: int, step: int) -> torch.Tensor:
    """[N] indices, the completion to keep first at position 0."""
    n = a_cpu.numel()
    # desirability: higher = keep first
    if metric == "random":
        desirability = torch.zeros(n, dtype=torch.float64)
    else:
        # importance: an order is only asked for by hosts that top a kept set up; take |A|
        score = a_cpu.abs() if use_abs else a_cpu
        desirability = -score if metric == "largest" else score
    # Order by desirability (descending), ties by a seeded random permutation.
    perm = torch.randperm(n, generator=seeded_generator(seed, step))
    return perm[torch.sort(desirability[perm], descending=True, stable=True).indices]


def keep_order(advantages: torch.Tensor, cfg: CPPOConfig, *, step: int = 0) -> torch.Tensor:
    """The completions in the order ``select_completions`` ranks them (same metric, same
    seeded tie-breaks), from the first to keep to the first to prune.

    Args:
        advantages: [N] float full-group advantages.
        cfg: the ``CPPOConfig`` (``metric``, ``use_abs``, ``seed``).
        step: int >= 0, as passed to ``select_completions``.

    Returns:
        [N] int64, a permutation of range(N).

    Integrations that must keep more than the selection (a framework's minimum batch)
    take the extra completions from the pruned ones in this order.
    """
    a = as_1d_float("advantages", advantages)
    metric, use_abs, seed = _ranking_settings(cfg, step)
    return _keep_order(a.detach().to("cpu", torch.float64), metric, use_abs, seed, step)


def _ranking_settings(cfg: CPPOConfig, step: int) -> tuple[str, bool, int]:
    """(metric, use_abs, seed) of a validated ``cfg``, and a valid ``step``."""
    check_config(cfg)
    check_int("step", step, minimum=0)
    return cfg.metric, cfg.use_abs, cfg.seed


def select_completions(
    advantages: torch.Tensor,
    group_ids: torch.Tensor,
    cfg: CPPOConfig,
    *,
    step: int = 0,
    stats: GroupStats | None = None,
) -> Selection:
    """Keep the completions whose advantage teaches the most; count the rest as pruned.

    Args:
        advantages: [N] float full-group advantages (``group_advantages``).
        group_ids: [N] int64 prompt ids.
        cfg: the ``CPPOConfig`` (``pruning_rate``, ``keep_per_group`` or ``keep_mass``,
            ``metric``, ``use_abs``, ``scope``, ``seed``).
        step: int >= 0, the training step; mixed into the seed so random choices differ
            per step while staying identical across ranks.
        stats: the ``GroupStats`` returned with ``advantages`` for these ``group_ids``;
            saves recomputing the grouping (``prune`` passes it).

    Returns:
        a ``Selection``: ``kept`` [K] int64 and ``pruned`` [N - K] int64 indices into the
        N rows, both ascending, together covering range(N) once; per-group counts [M];
        ``weights`` [K] float32 (1/pi for ``importance``, else 1.0).

    How many (``keep_counts``): group scope keeps k_g = floor(G_g (1 - P)) (at least 1) per group; batch
    scope keeps floor(N (1 - P)) (at least 1) across the batch (or k * num_groups with
    ``keep_per_group``). With ``keep_mass = f`` the count is the fewest completions whose
    A^2 reaches f of the group's (batch scope: the batch's) A^2 total; zero-variance groups
    keep none.

    Which (``choose_kept``): score = |A| (or A when ``use_abs`` is False); ``smallest`` prunes the lowest
    scores, ``largest`` the highest, ``random`` ignores the score; ``importance`` draws the
    k by randomised systematic sampling with inclusion probabilities pi proportional to |A|
    (capped at 1) within each group (batch scope: across the batch) and sets
    ``weights = 1 / pi`` (``core.sampling``).
    """
    a = as_1d_float("advantages", advantages)
    g = as_group_ids("group_ids", group_ids, a.numel()).cpu()
    metric, use_abs, seed = _ranking_settings(cfg, step)  # validates every field of cfg
    n = a.numel()
    a_cpu = a.detach().to("cpu", torch.float64)
    if stats is not None:
        if stats.inverse.numel() != n:
            raise ValueError(f"stats describe {stats.inverse.numel()} completions but the batch has {n}")
        uniq, inverse, size = stats.group_ids, stats.inverse, stats.size
    else:
        uniq, inverse, size = torch.unique(g, sorted=True, return_inverse=True, return_counts=True)

    pools = keep_counts(a_cpu, uniq, inverse, size, cfg)
    kept, weight_full = choose_kept(a_cpu, pools, cfg, step=step)
    mask = torch.zeros(n, dtype=torch.bool)
    mask[kept] = True
    kept = mask.nonzero().squeeze(1)  # ascending, without another sort
    kept_per_group = torch.zeros(uniq.numel(), dtype=torch.int64).index_add_(
        0, inverse[kept], torch.ones_like(kept)
    )
    return Selection(
        kept=kept,
        pruned=(~mask).nonzero().squeeze(1),
        group_ids=uniq,
        group_size=size,
        kept_per_group=kept_per_group,
        advantages=a,
        scope=cfg.scope,
        metric=metric,
        use_abs=use_abs,
        weights=None if weight_full is None else weight_full[kept].to(torch.float32),
        keep_mass=cfg.keep_mass,
    )


@dataclass(frozen=True)
class Pools:
    """The sets a keep count applies to (each group with ``scope=group``, the whole batch with
    ``scope=batch``) and how many of each survive: what ``keep_counts`` decides.

    Attributes:
        of: [N] int64, the pool of each completion.
        size: [P] int64, completions per pool.
        keep: [P] int64, how many of each pool to keep, in [0, size].
    """

    of: torch.Tensor
    size: torch.Tensor
    keep: torch.Tensor


def keep_counts(advantages: torch.Tensor, group_ids: torch.Tensor, inverse: torch.Tensor, size: torch.Tensor,
                cfg: CPPOConfig) -> Pools:
    """How many survive per pool: the first half of ``select_completions``.

    Args:
        advantages: [N] float64 CPU advantages (only ``keep_mass`` reads them).
        group_ids: [M] int64 distinct group ids, ascending; inverse: [N] int64 group of each
            completion (index into ``group_ids``); size: [M] int64 completions per group.
        cfg: a validated ``CPPOConfig``.

    Returns:
        ``Pools``. ``keep_mass = f``: the fewest completions whose A^2 reaches f of the pool's A^2
        total; else group scope: k_g = ``keep_count(G_g, P, k)`` per group, batch scope:
        ``keep_count(N, P)`` (or k x num_groups with ``keep_per_group``).
    """
    n = advantages.numel()
    if cfg.scope == "batch":
        of, pool_size = torch.zeros(n, dtype=torch.int64), torch.tensor([n], dtype=torch.int64)
    else:
        of, pool_size = inverse, size
    if cfg.keep_mass is not None:
        index, valid = grouped_layout(of, pool_size)
        return Pools(of, pool_size, mass_keep_counts(advantages.square()[index], valid, cfg.keep_mass))
    if cfg.scope == "group":
        distinct, size_inv = torch.unique(size, return_inverse=True)
        k = [keep_count(int(v), cfg.pruning_rate, cfg.keep_per_group) for v in distinct.tolist()]
        return Pools(of, pool_size, torch.tensor(k, dtype=torch.int64)[size_inv])
    if cfg.keep_per_group is not None:
        too_small = size < cfg.keep_per_group
        if bool(too_small.any()):
            j = int(too_small.nonzero()[0])
            raise ValueError(f"keep_per_group={cfg.keep_per_group} is larger than group {int(group_ids[j])} "
                             f"({int(size[j])} completions)")
        return Pools(of, pool_size, torch.tensor([cfg.keep_per_group * group_ids.numel()], dtype=torch.int64))
    # the batch as one pool: floor(N (1 - P)), at least 1
    return Pools(of, pool_size, torch.tensor([keep_count(n, cfg.pruning_rate, None)], dtype=torch.int64))


def choose_kept(advantages: torch.Tensor, pools: Pools, cfg: CPPOConfig, *, step: int
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Which ones survive: the second half of ``select_completions``.

    Args:
        advantages: [N] float64 CPU advantages.
        pools: ``keep_counts``' pools and counts.
        cfg: a validated ``CPPOConfig`` (``metric``, ``use_abs``, ``seed``); step: int >= 0.

    Returns:
        (kept [K] int64 indices, in no particular order; weights [N] float64 1/pi or None).
        ``importance``: a randomised systematic sample with inclusion probabilities pi ~ |A| per
        pool, weights 1/pi; the other metrics: the first ``keep`` of each pool in ``_keep_order``
        (score order, seeded tie-breaks), no weights.
    """
    n = advantages.numel()
    if cfg.metric == "importance":
        gen = seeded_generator(cfg.seed, step, stream=IMPORTANCE_STREAM)
        # a seeded random order within each pool makes the systematic design "randomised"
        index, valid = grouped_layout(pools.of, pools.size, torch.randperm(n, generator=gen))
        pi = inclusion_probabilities(advantages.abs()[index], valid, pools.keep)
        chosen, pi_exact = systematic_sample(pi, valid, pools.keep, gen)
        kept = index[chosen]
        weights = torch.ones(n, dtype=torch.float64)
        weights[kept] = 1.0 / pi_exact[chosen]
        return kept, weights
    # k per pool; members ranked by a stable sort of the global order on pool
    order = _keep_order(advantages, cfg.metric, cfg.use_abs, cfg.seed, step)
    grouped = order[torch.sort(pools.of[order], stable=True).indices]
    starts = torch.cumsum(pools.size, 0) - pools.size
    rank_in_pool = torch.arange(n) - starts[pools.of[grouped]]
    return grouped[rank_in_pool < pools.keep[pools.of[grouped]]], None
