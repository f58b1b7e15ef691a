"""Unbiased pruning (metric=importance) and adaptive counts (keep_mass)."""

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cppo_megatron import CPPOConfig
from cppo_megatron.core import AllocationPlanner, group_advantages, prune, select_completions
from cppo_megatron.core.sampling import (
    MASS_TOLERANCE,
    grouped_layout,
    inclusion_probabilities,
    mass_keep_counts,
)

# groups with ties, a single outlier, a zero-variance group and a middle reward (A = 0)
GROUPS = {
    "one_of_eight": [1, 0, 0, 0, 0, 0, 0, 0],
    "ties": [1, 1, 0, 0, 0, 1, 0.5, 0.5],
    "graded": [0.0, 0.1, 0.2, 0.5, 0.9, 1.0],
    "middle_zero": [0.0, 0.5, 1.0, 0.5],
    "flat": [1, 1, 1, 1, 1],
}


def _replicated(rewards, copies):
    """``copies`` independent copies of one group in one batch: each copy is an independent
    draw of the design (one uniform and one permutation per group)."""
    r = torch.tensor(rewards, dtype=torch.float64).repeat(copies)
    g = torch.arange(copies).repeat_interleave(len(rewards))
    return r, g


@pytest.mark.parametrize("name", sorted(GROUPS))
@pytest.mark.parametrize("k", ["one", "half", "all"])
def test_horvitz_thompson_estimate_is_unbiased(name, k):
    """sum_kept A_i x_i / pi_i over many seeded draws: mean within 3 standard errors of
    sum_all A_i x_i, for a random x; k = 1, G/2 and G."""
    rewards = GROUPS[name]
    G = len(rewards)
    kk = {"one": 1, "half": G // 2, "all": G}[k]
    copies = 4000
    r, g = _replicated(rewards, copies)
    x = torch.randn(G, generator=torch.Generator().manual_seed(len(name) * 7 + kk), dtype=torch.float64)
    cfg = CPPOConfig(metric="importance", keep_per_group=kk, seed=11)
    res = prune(r, g, cfg, step=5)
    sel = res.selection
    adv = res.advantages.to(torch.float64)
    truth = float((adv[:G] * x).sum())
    contrib = torch.zeros(copies, dtype=torch.float64)
    kept = sel.kept
    contrib.index_add_(0, g[kept], sel.weights.to(torch.float64) * adv[kept] * x[kept % G])
    assert torch.equal(sel.kept_per_group, torch.full((copies,), kk))
    mean = float(contrib.mean())
    se = float(contrib.std()) / math.sqrt(copies)
    assert abs(mean - truth) <= 3 * se + 1e-5 * (1 + abs(truth)), (name, kk, mean, truth, se)
    if kk == G:  # a census: every draw is exact
        assert torch.allclose(contrib, torch.full_like(contrib, truth), atol=1e-5)


@pytest.mark.parametrize("name", ["one_of_eight", "ties", "graded", "middle_zero"])
def test_inclusion_frequencies_match_probabilities(name):
    """Each completion's empirical inclusion frequency is its pi (binomial, 4 sd), and the
    weights are 1/pi: the design realises the probabilities it claims."""
    rewards = GROUPS[name]
    G = len(rewards)
    copies = 4000
    r, g = _replicated(rewards, copies)
    res = prune(r, g, CPPOConfig(metric="importance", keep_per_group=2, seed=3), step=1)
    sel = res.selection
    freq = torch.zeros(G, dtype=torch.float64).index_add_(
        0, sel.kept % G, torch.ones(sel.num_kept, dtype=torch.float64)) / copies
    index, valid = grouped_layout(torch.zeros(G, dtype=torch.int64), torch.tensor([G]))
    pi = inclusion_probabilities(res.advantages[:G].abs().to(torch.float64)[index], valid,
                                 torch.tensor([2]))[0][torch.argsort(index[0])]
    sd = torch.sqrt(pi * (1 - pi) / copies)
    assert torch.all((freq - pi).abs() <= 4 * sd + 1e-9), (freq, pi)
    w_expected = 1.0 / pi[sel.kept % G]
    assert torch.allclose(sel.weights.to(torch.float64), w_expected, rtol=1e-6)


def test_batch_scope_importance_is_unbiased():
    rewards = torch.tensor([1, 0, 0, 0, 1, 1, 0, 0.5, 1, 1, 1, 1], dtype=torch.float64)
    g = torch.arange(12) // 4
    x = torch.randn(12, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    cfg = CPPOConfig(metric="importance", pruning_rate=0.75, scope="batch", seed=2)
    est = []
    for step in range(800):
        res = prune(rewards, g, cfg, step=step)
        s = res.selection
        assert s.num_kept == 3
        a = res.advantages.to(torch.float64)
        est.append(float((s.weights.to(torch.float64) * a[s.kept] * x[s.kept]).sum()))
    truth = float((res.advantages.to(torch.float64) * x).sum())
    est_t = torch.tensor(est)
    se = float(est_t.std()) / math.sqrt(len(est))
    assert abs(float(est_t.mean()) - truth) <= 3 * se


@st.composite
def pools(draw):
    m = draw(st.integers(1, 6))
    rows = []
    for _ in range(m):
        size = draw(st.integers(1, 10))
        rows.append(draw(st.lists(st.sampled_from([0.0, 0.0, 0.3, 1.0, 2.5, 9.0]), min_size=size,
                                  max_size=size)))
    ks = [draw(st.integers(0, len(r))) for r in rows]
    return rows, ks


def _pad(rows):
    w = max(len(r) for r in rows)
    scores = torch.zeros(len(rows), w, dtype=torch.float64)
    valid = torch.zeros(len(rows), w, dtype=torch.bool)
    for i, r in enumerate(rows):
        scores[i, : len(r)] = torch.tensor(r, dtype=torch.float64)
        valid[i, : len(r)] = True
    return scores, valid


@settings(max_examples=150, deadline=None)
@given(pools())
def test_inclusion_probabilities_sum_to_k_capped_and_proportional(case):
    rows, ks = case
    scores, valid = _pad(rows)
    k = torch.tensor(ks)
    pi = inclusion_probabilities(scores, valid, k)
    assert torch.allclose(pi.sum(1), k.to(torch.float64), atol=1e-9)
    assert bool((pi <= 1.0).all()) and bool((pi >= 0).all())
    assert bool((pi[~valid] == 0).all())
    for i, r in enumerate(rows):
        p = pi[i, : len(r)]
        s = scores[i, : len(r)]
        free = (p < 1 - 1e-12) & (s > 0)
        if int(free.sum()) >= 2:  # below the cap, pi / score is one constant
            ratio = p[free] / s[free]
            assert torch.allclose(ratio, ratio[0].expand_as(ratio), rtol=1e-9)
        # a larger score never gets a smaller probability
        order = torch.argsort(s)
        assert bool((p[order][1:] >= p[order][:-1] - 1e-12).all())


def test_inclusion_probabilities_known_values():
    # scores 4,1,1,0 with k = 2: 4 caps at 1, the other unit shared by the 1s; 0 gets nothing
    scores, valid = _pad([[4.0, 1.0, 1.0, 0.0]])
    pi = inclusion_probabilities(scores, valid, torch.tensor([2]))
    assert torch.allclose(pi[0], torch.tensor([1.0, 0.5, 0.5, 0.0], dtype=torch.float64))
    # k = 3 with two positive scores: the remainder goes uniformly to the zero scores
    scores, valid = _pad([[4.0, 1.0, 0.0, 0.0]])
    pi = inclusion_probabilities(scores, valid, torch.tensor([3]))
    assert torch.allclose(pi[0], torch.tensor([1.0, 1.0, 0.5, 0.5], dtype=torch.float64))
    with pytest.raises(ValueError, match="k=5 is outside"):
        inclusion_probabilities(scores, valid, torch.tensor([5]))


def _brute_min_count(energy, f):
    total = sum(energy)
    if total <= 0:
        return 0
    for size in range(1, len(energy) + 1):
        if any(sum(c) >= total * (f - MASS_TOLERANCE) for c in itertools.combinations(energy, size)):
            return size
    raise AssertionError("unreachable")


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.sampled_from([0.0, 0.25, 0.5, 1.0]), min_size=1, max_size=8), min_size=1,
                max_size=5),
       st.sampled_from([0.1, 0.5, 0.7, 0.9, 0.95, 1.0]))
def test_keep_mass_keeps_the_minimum_count(groups, f):
    rewards = torch.tensor([r for grp in groups for r in grp])
    gids = torch.tensor([i for i, grp in enumerate(groups) for _ in grp])
    res = prune(rewards, gids, CPPOConfig(keep_mass=f), step=0)
    adv = res.advantages.to(torch.float64)
    for i in range(len(groups)):
        members = (gids == i).nonzero().squeeze(1)
        energy = adv[members].square().tolist()
        want = _brute_min_count(energy, f)
        assert int(res.selection.kept_per_group[i]) == want, (groups[i], f, energy)
        kept = [j for j in res.selection.kept.tolist() if gids[j] == i]
        if want:  # the kept ones reach the mass
            assert sum(adv[kept].square().tolist()) >= sum(energy) * (f - MASS_TOLERANCE)


def test_keep_mass_known_groups_and_batch_scope():
    # 1-of-8: A^2 = 6.125 for the correct one, 0.125 for each wrong one (total 7)
    r = torch.tensor([1.0, 0, 0, 0, 0, 0, 0, 0] + [1.0, 1, 0, 0, 1, 0, 1, 0] + [1.0] * 8)
    g = torch.arange(24) // 8
    sel = prune(r, g, CPPOConfig(keep_mass=0.85)).selection
    # 0.85 * 7 = 5.95 <= 6.125: the correct answer alone; 4-of-8: 7 of 8 equal terms; flat: none
    assert sel.kept_per_group.tolist() == [1, 7, 0]
    assert 0 in sel.kept.tolist()
    sel = prune(r, g, CPPOConfig(keep_mass=0.9)).selection
    assert sel.kept_per_group.tolist() == [3, 8, 0]
    m = sel.metrics()
    assert m["cppo/kept_per_group_p50"] == 3.0 and m["cppo/kept_per_group_max"] == 8.0
    assert m["cppo/kept_sq_adv_fraction"] >= 0.9
    # batch scope: the fewest across the batch reaching 0.4 of the batch A^2 (7 + 7): 6.125 alone
    sel = prune(r, g, CPPOConfig(keep_mass=0.4, scope="batch")).selection
    assert sel.num_kept == 1 and sel.kept.tolist() == [0]


def test_keep_mass_counts_function_zero_rows():
    energy, valid = _pad([[0.0, 0.0], [4.0, 1.0, 1.0]])
    assert mass_keep_counts(energy, valid, 0.6).tolist() == [0, 1]
    assert mass_keep_counts(energy, valid, 1.0).tolist() == [0, 3]
    with pytest.raises(ValueError, match="keep_mass must be in"):
        mass_keep_counts(energy, valid, 0.0)


def test_importance_is_deterministic_and_varies_by_step():
    r, g = _replicated(GROUPS["graded"], 20)
    cfg = CPPOConfig(metric="importance", keep_per_group=2, seed=4)
    a = prune(r, g, cfg, step=7).selection
    b = prune(r, g, cfg, step=7).selection
    assert torch.equal(a.kept, b.kept) and torch.equal(a.weights, b.weights)
    c = prune(r, g, cfg, step=8).selection
    assert not torch.equal(a.kept, c.kept)
    d = prune(r, g, CPPOConfig(metric="importance", keep_per_group=2, seed=5), step=7).selection
    assert not torch.equal(a.kept, d.kept)


def test_deterministic_metrics_have_unit_weights():
    r, g = _replicated(GROUPS["ties"], 3)
    for cfg in (CPPOConfig(), CPPOConfig(metric="random"), CPPOConfig(keep_mass=0.8)):
        sel = prune(r, g, cfg).selection
        assert sel.weights.dtype == torch.float32 and torch.equal(sel.weights, torch.ones(sel.num_kept))
        assert not sel.weighted
    assert prune(r, g, CPPOConfig(metric="importance")).selection.weighted


def test_config_refuses_bad_combinations():
    with pytest.raises(ValueError, match="keep_mass=0.9 decides"):
        CPPOConfig(keep_mass=0.9, pruning_rate=0.5)
    with pytest.raises(ValueError, match="keep_mass works with metric"):
        CPPOConfig(keep_mass=0.9, metric="random")
    with pytest.raises(ValueError, match=r"keep_mass must be in \(0, 1\], got 1.5"):
        CPPOConfig(keep_mass=1.5)
    with pytest.raises(ValueError, match="use_abs=true"):
        CPPOConfig(metric="importance", use_abs=False)
    with pytest.raises(ValueError, match="no fixed k per group"):
        CPPOConfig(keep_mass=0.9).keep_for_group(16)
    # a config whose fields were reassigned after construction is validated again
    cfg = CPPOConfig(keep_mass=0.5)
    cfg.pruning_rate = 0.5
    adv, _ = group_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="unset pruning_rate"):
        select_completions(adv, torch.tensor([0, 0]), cfg)


def test_planner_fills_capacity_with_keep_mass():
    G = 8
    planner = AllocationPlanner(64, G, keep_mass=0.9)
    assert planner.adaptive
    first = planner.begin_step()
    assert first == 64 // (G // 2)  # G/2 survivors per prompt before any data
    planner.record_round(first, first * G)
    # suppose the rule kept 2 per prompt: 32 survivors, 32 short; running mean is 2 per prompt
    extra = planner.next_fill(2 * first)
    assert extra == 16
    planner.record_round(extra, extra * G)
    assert planner.next_fill(64) == 0  # full
    r = torch.tensor([1.0, 0, 0, 0, 0, 0, 0, 1] * (first + extra))
    g = torch.arange(r.numel()) // G
    sel = prune(r, g, CPPOConfig(keep_mass=0.9)).selection
    out = planner.end_step(sel)
    assert out["alloc/fill_rounds"] == 1.0 and out["alloc/prompts_drawn"] == first + extra
    # the next step plans from the running mean of survivors per drawn prompt
    per_prompt = sel.num_kept / (first + extra)
    assert planner.begin_step() == int(64 / per_prompt)


def test_planner_fill_rounds_are_bounded_and_off_for_fixed_k():
    planner = AllocationPlanner(64, 8, keep_mass=0.5, max_refill_rounds=2)
    n = planner.begin_step()
    planner.record_round(n, n * 8)
    assert planner.next_fill(0) > 0 and planner.next_fill(0) > 0 and planner.next_fill(0) == 0
    fixed = AllocationPlanner(64, 8, pruning_rate=0.75)
    fixed.begin_step()
    assert fixed.next_fill(0) == 0
    off = AllocationPlanner(64, 8, keep_mass=0.5, allocation=False)
    assert off.begin_step() == 8 and not off.adaptive
