"""Unbiased pruning and adaptive keep counts, vectorised over groups.

Two pieces beyond the paper's fixed top-k:

- ``inclusion_probabilities`` + ``systematic_sample``: keep exactly k_g completions of each
  group by a fixed-size sampling design whose inclusion probabilities are proportional to
  |A| (capped at 1, the excess redistributed). Each survivor carries the Horvitz-Thompson
  weight 1 / pi_i, so sum_kept A_i x_i / pi_i is an unbiased estimate of sum_all A_i x_i for
  any per-completion quantity x (a loss, a gradient).
- ``mass_keep_counts``: per group, the fewest completions whose A^2 reaches a fraction f of
  the group's A^2 total (zero-variance groups keep none).

Design choice: randomised systematic PPS sampling (Madow 1949 on a seeded random order;
Goodman & Kish 1950), not Sampford. Both realise the target inclusion probabilities exactly,
which is all unbiasedness needs. Systematic sampling draws one uniform per group, always
returns exactly k, has no rejection loop (Sampford's rejective step can need many retries
when several pi are near 1) and vectorises over groups as a cumulative sum. What it gives
up - every joint inclusion probability pi_ij > 0, needed to *estimate* the variance from
one sample - the trainer never uses.

Exactness: pi is rounded to integers in units of 2^-40 (largest remainder, summing to
exactly k 2^40 per group), and the sampling runs in int64. The realised design therefore
has inclusion probabilities exactly ``pi_int / 2^40`` and the returned weights are their
inverses: the estimate is unbiased to the last bit, not up to float rounding in a cumsum.
"""

from __future__ import annotations

import torch

__all__ = ["PI_SCALE", "grouped_layout", "inclusion_probabilities", "mass_keep_counts", "systematic_sample"]

PI_SCALE = 1 << 40
# keep_mass: a cumulative A^2 within this relative slack of f * total counts as reaching it,
# so f = 0.5 of eight equal |A| keeps 4, not 5 because of a rounding error in the cumsum
MASS_TOLERANCE = 1e-9


def grouped_layout(inverse: torch.Tensor, size: torch.Tensor, order: torch.Tensor | None = None):
    """Padded [M, Gmax] layout of a batch, vectorising per-group work.

    Args:
        inverse: [N] int64 group position of each completion (0..M-1).
        size: [M] int64 completions per group.
        order: [N] optional permutation; within a group, members appear in this order
            (default: ascending index).

    Returns:
        index: [M, Gmax] int64 completion index at each slot (0 on padding).
        valid: [M, Gmax] bool, False on padding.
    """
    n = inverse.numel()
    m = size.numel()
    order = torch.arange(n) if order is None else order
    grouped = order[torch.sort(inverse[order], stable=True).indices]
    starts = torch.cumsum(size, 0) - size
    slot = torch.arange(n) - starts[inverse[grouped]]
    width = int(size.max()) if m else 0
    index = torch.zeros(m, width, dtype=torch.int64)
    valid = torch.zeros(m, width, dtype=torch.bool)
    index[inverse[grouped], slot] = grouped
    valid[inverse[grouped], slot] = True
    return index, valid


def inclusion_probabilities(scores: torch.Tensor, valid: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Inclusion probabilities proportional to ``scores``, capped at 1, summing to k per row.

    Args:
        scores: [M, W] float64 >= 0 (|A| of each group member; padding ignored).
        valid: [M, W] bool, the real members.
        k: [M] int64 sample size per row, 0 <= k <= members.

    Returns:
        pi: [M, W] float64 in [0, 1], 0 on padding, each row summing to k.

    Members whose proportional share reaches 1 are taken with certainty and the rest of k
    is shared by the others in proportion to their scores (repeated until no share exceeds
    1). When the positive scores are all certain and k is not yet reached, the remainder is
    shared uniformly among the zero-score members (they add nothing to sum A x, so any
    choice among them is unbiased; uniform also keeps the rest of the loss, e.g. a KL term,
    unbiased for zero-variance groups).
    """
    if scores.shape != valid.shape or scores.dim() != 2 or k.shape != scores.shape[:1]:
        raise ValueError(
            f"scores {tuple(scores.shape)}, valid {tuple(valid.shape)} and k {tuple(k.shape)} "
            "must be [M, W], [M, W] and [M]"
        )
    if bool((scores < 0).any()):
        raise ValueError("scores must be >= 0 (use |A|)")
    members = valid.sum(1)
    if bool((k < 0).any()) or bool((k > members).any()):
        j = int(((k < 0) | (k > members)).nonzero()[0])
        raise ValueError(f"row {j}: sample size k={int(k[j])} is outside [0, {int(members[j])}]")
    s = torch.where(valid, scores.to(torch.float64), torch.zeros((), dtype=torch.float64))
    kf = k.to(torch.float64)
    certain = torch.zeros_like(valid)
    pi = torch.zeros_like(s)
    # a row that gains no certain member keeps its shares, so gains stop within W + 1 passes
    for _ in range(s.shape[1] + 1):  # pragma: no branch - always left by the break
        free = valid & ~certain
        k_free = kf - certain.sum(1)
        mass = s.where(free, 0.0).sum(1)
        share = torch.where(mass > 0, k_free / mass.clamp_min(1e-300), torch.zeros_like(mass))
        pi = torch.where(certain, 1.0, s * share.unsqueeze(1))
        newly = free & (pi >= 1.0)
        if not bool(newly.any()):
            break
        certain |= newly
    # rows whose positive scores cannot carry k: the remainder, uniform over zero-score members
    free = valid & ~certain
    k_free = kf - certain.sum(1)
    mass = s.where(free, 0.0).sum(1)
    spare = (mass <= 0) & (k_free > 0)
    if bool(spare.any()):
        zero = free & (s <= 0)
        uniform = k_free / zero.sum(1).clamp_min(1)
        pi = torch.where(spare.unsqueeze(1) & zero, uniform.unsqueeze(1), pi)
    return torch.where(valid, pi.clamp(0.0, 1.0), 0.0)


def _integer_probabilities(pi: torch.Tensor, valid: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """[M, W] int64 pi * PI_SCALE rounded by largest remainder so each row sums to k * PI_SCALE
    exactly, every entry in [0, PI_SCALE], zero stays zero."""
    scaled = pi * PI_SCALE
    base = torch.floor(scaled).to(torch.int64)
    frac = scaled - base
    eligible = valid & (pi > 0) & (base < PI_SCALE)
    deficit = k * PI_SCALE - base.sum(1)
    room = eligible.sum(1)
    if bool((deficit < 0).any()) or bool((deficit > room).any()):  # pragma: no cover - an invariant of the above
        j = int(((deficit < 0) | (deficit > room)).nonzero()[0])
        raise RuntimeError(f"inclusion probabilities of row {j} do not sum to k={int(k[j])} (internal error)")
    # rank the fractional parts, largest first; ties by slot (the slots are randomly ordered)
    key = torch.where(eligible, frac, -1.0)
    rank = torch.argsort(torch.argsort(key, dim=1, descending=True, stable=True), dim=1)
    return base + (eligible & (rank < deficit.unsqueeze(1))).to(torch.int64)


def systematic_sample(
    pi: torch.Tensor, valid: torch.Tensor, k: torch.Tensor, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Randomised systematic PPS sample of exactly k per row.

    Args:
        pi: [M, W] float64 inclusion probabilities (``inclusion_probabilities``); the row
            order of the slots should already be a seeded random permutation of each group.
        valid: [M, W] bool.
        k: [M] int64, the row sums of pi.
        generator: CPU generator (seeded from (seed, step): identical on every rank).

    Returns:
        selected: [M, W] bool, exactly k[m] True in row m.
        pi_exact: [M, W] float64, the inclusion probabilities the design realises
            (pi rounded to multiples of 2^-40); survivors' weights are 1 / pi_exact.
    """
    if k.numel() and int(k.max()) >= (1 << 62) // PI_SCALE:
        raise ValueError(
            f"sample size k={int(k.max())} is too large for the int64 design (at most {(1 << 62) // PI_SCALE - 1} "
            "per pool); use scope=group"
        )
    pint = _integer_probabilities(pi, valid, k)
    upper = torch.cumsum(pint, dim=1)
    lower = upper - pint
    start = torch.randint(0, PI_SCALE, (pi.shape[0],), generator=generator, dtype=torch.int64).unsqueeze(1)

    def points_below(x: torch.Tensor) -> torch.Tensor:
        # how many of the points start + j * PI_SCALE (j = 0..k-1) lie below x
        return torch.where(x > start, (x - start + PI_SCALE - 1) // PI_SCALE, torch.zeros_like(x))

    selected = (points_below(upper) - points_below(lower)) > 0
    return selected & valid, pint.to(torch.float64) / PI_SCALE


def mass_keep_counts(energy: torch.Tensor, valid: torch.Tensor, fraction: float) -> torch.Tensor:
    """[M] int64: per row, the fewest members whose ``energy`` reaches ``fraction`` of the row total.

    Args:
        energy: [M, W] float64 >= 0 (A^2 of each group member).
        valid: [M, W] bool.
        fraction: f in (0, 1].

    The fewest members are always the largest ones, so the count is the length of the
    shortest prefix of the row sorted in descending order whose sum reaches f * total (up to
    a relative ``MASS_TOLERANCE``). A row whose total is 0 (a zero-variance group) gets 0.
    """
    if not (0.0 < float(fraction) <= 1.0):
        raise ValueError(f"keep_mass must be in (0, 1], got {fraction!r}")
    e = torch.where(valid, energy.to(torch.float64), 0.0)
    sorted_e = torch.sort(e, dim=1, descending=True).values
    csum = torch.cumsum(sorted_e, dim=1)
    total = csum[:, -1:] if e.shape[1] else torch.zeros(e.shape[0], 1, dtype=torch.float64)
    threshold = total * (float(fraction) - MASS_TOLERANCE)
    count = (csum < threshold).sum(1) + 1
    count = torch.minimum(count, valid.sum(1))
    return torch.where(total.squeeze(1) > 0, count, torch.zeros_like(count))
