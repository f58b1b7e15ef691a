import math
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cppo_megatron import CPPOConfig
from cppo_megatron.core import group_advantages, select_completions


@st.composite
def batches(draw):
    """Random uneven groups with arbitrary int64 ids and rewards with many ties."""
    num_groups = draw(st.integers(1, 8))
    sizes = draw(st.lists(st.integers(1, 12), min_size=num_groups, max_size=num_groups))
    ids = draw(st.lists(st.integers(0, 2**40), min_size=num_groups, max_size=num_groups, unique=True))
    group_ids = [gid for gid, s in zip(ids, sizes) for _ in range(s)]
    perm = draw(st.permutations(range(len(group_ids))))
    group_ids = [group_ids[i] for i in perm]
    rewards = draw(
        st.lists(st.sampled_from([0.0, 0.1, 0.5, 1.0]), min_size=len(group_ids), max_size=len(group_ids))
    )
    return torch.tensor(rewards), torch.tensor(group_ids, dtype=torch.int64)


def _score(adv, cfg):
    s = adv.abs() if cfg.use_abs else adv
    return s if cfg.metric == "smallest" else -s


def _reference_kept_scores(adv, gids, cfg):
    """Brute force: per group (or batch) the multiset of the best scores."""
    desirability = _score(adv, cfg).tolist()
    if cfg.scope == "batch":
        n_keep = max(1, math.floor(len(desirability) * (1 - cfg.rate) + 1e-6))
        return Counter(sorted(desirability, reverse=True)[:n_keep])
    out = Counter()
    for gid in set(gids.tolist()):
        members = [desirability[i] for i in range(len(desirability)) if gids[i] == gid]
        k = cfg.keep_for_group(len(members))
        out.update(sorted(members, reverse=True)[:k])
    return out


configs = st.builds(
    CPPOConfig,
    pruning_rate=st.sampled_from([0.0, 0.3, 0.5, 0.75, 0.875, 0.95]),
    metric=st.sampled_from(["smallest", "largest", "random"]),
    use_abs=st.booleans(),
    scope=st.sampled_from(["group", "batch"]),
    seed=st.integers(0, 1000),
)


@settings(max_examples=300, deadline=None)
@given(batches(), configs, st.integers(0, 50))
def test_selection_properties(batch, cfg, step):
    rewards, gids = batch
    adv, _ = group_advantages(rewards, gids)
    sel = select_completions(adv, gids, cfg, step=step)
    n = rewards.numel()
    # kept + pruned partition the input; both sorted
    assert sorted(sel.kept.tolist() + sel.pruned.tolist()) == list(range(n))
    assert sel.kept.tolist() == sorted(sel.kept.tolist())
    assert sel.pruned.tolist() == sorted(sel.pruned.tolist())
    # counts per group as specified
    sizes = dict(zip(sel.group_ids.tolist(), sel.group_size.tolist()))
    kept_count = Counter(gids[sel.kept].tolist())
    assert sel.kept_per_group.tolist() == [kept_count.get(g, 0) for g in sel.group_ids.tolist()]
    if cfg.scope == "group":
        for gid, size in sizes.items():
            assert kept_count[gid] == cfg.keep_for_group(size)
    else:
        assert sel.num_kept == max(1, math.floor(n * (1 - cfg.rate) + 1e-6))
    # brute-force reference on the kept scores (tie-independent)
    if cfg.metric != "random":
        got = Counter(_score(adv, cfg)[sel.kept].tolist())
        assert got == _reference_kept_scores(adv, gids, cfg)
    # determinism: same inputs and seed -> same result
    again = select_completions(adv.clone(), gids.clone(), cfg, step=step)
    assert torch.equal(again.kept, sel.kept)
    # another seed changes only tie-breaks: the kept scores stay the same
    other = select_completions(adv, gids, CPPOConfig(**{**cfg.to_dict(), "seed": cfg.seed + 1}), step=step)
    assert other.num_kept == sel.num_kept
    if cfg.metric != "random":
        assert Counter(_score(adv, cfg)[other.kept].tolist()) == Counter(_score(adv, cfg)[sel.kept].tolist())


def test_seed_changes_random_choices_and_ties():
    adv = torch.zeros(64)  # all tied
    g = torch.arange(64) // 16
    a = select_completions(adv, g, CPPOConfig(pruning_rate=0.5, seed=0))
    b = select_completions(adv, g, CPPOConfig(pruning_rate=0.5, seed=1))
    c = select_completions(adv, g, CPPOConfig(pruning_rate=0.5, seed=0), step=1)
    assert not torch.equal(a.kept, b.kept)
    assert not torch.equal(a.kept, c.kept)
    r1 = select_completions(torch.randn(64), g, CPPOConfig(pruning_rate=0.5, metric="random", seed=3))
    r2 = select_completions(torch.randn(64), g, CPPOConfig(pruning_rate=0.5, metric="random", seed=3))
    assert torch.equal(r1.kept, r2.kept)  # random ignores the scores, depends on the seed only


def test_zero_variance_groups_are_pruned_first_under_smallest():
    # 4 groups of 8: two all-equal (A=0), two with signal; batch scope keeping 25%
    r = torch.tensor([1.0] * 8 + [0.0] * 8 + [1, 0, 0, 0, 0, 0, 0, 1] + [1, 1, 0, 0, 1, 0, 1, 0], dtype=torch.float)
    g = torch.arange(32) // 8
    adv, _ = group_advantages(r, g)
    sel = select_completions(adv, g, CPPOConfig(pruning_rate=0.75, scope="batch"))
    assert sel.kept_per_group.tolist()[:2] == [0, 0]
    assert sel.metrics()["cppo/groups_fully_pruned"] == 2.0
    # the largest metric keeps the zero-advantage ones instead
    worst = select_completions(adv, g, CPPOConfig(pruning_rate=0.75, scope="batch", metric="largest"))
    assert adv[worst.kept].abs().max().item() == 0.0


def test_group_scope_keeps_largest_abs_advantage():
    r = torch.tensor([1.0, 0, 0, 0, 0.5, 0.5, 0.2, 0.9])
    g = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    adv, _ = group_advantages(r, g)
    sel = select_completions(adv, g, CPPOConfig(keep_per_group=1))
    assert sel.kept.tolist() == [0, 7]
    signed = select_completions(adv, g, CPPOConfig(keep_per_group=1, use_abs=False, metric="largest"))
    # signed + largest: prune the highest A, keep the lowest
    assert signed.kept.tolist()[1] == 6


def test_metrics_are_floats_with_cppo_prefix():
    adv, _ = group_advantages(torch.tensor([1.0, 0, 0, 0]), torch.zeros(4, dtype=torch.long))
    m = select_completions(adv, torch.zeros(4, dtype=torch.long), CPPOConfig(keep_per_group=2)).metrics()
    assert all(k.startswith("cppo/") and isinstance(v, float) for k, v in m.items())
    assert m["cppo/kept_ratio"] == 0.5
    assert m["cppo/abs_adv_mean_kept"] > m["cppo/abs_adv_mean_pruned"]


def test_bad_config_object_fields_are_errors():
    class Cfg:  # a look-alike without validation is refused, not read with defaults
        pruning_rate = 0.5

    with pytest.raises(TypeError, match="CPPOConfig"):
        select_completions(torch.zeros(4), torch.zeros(4, dtype=torch.long), Cfg())
    cfg = CPPOConfig()
    cfg.pruning_rate = 1.5  # reassigned after construction
    with pytest.raises(ValueError, match="pruning_rate"):
        select_completions(torch.zeros(4), torch.zeros(4, dtype=torch.long), cfg)


def test_the_two_halves_how_many_per_pool_then_which_ones():
    """keep_counts decides the pools and their counts, choose_kept the members; select_completions is both."""
    from cppo_megatron.core.advantage import GroupStats
    from cppo_megatron.core.selection import choose_kept, keep_counts

    adv = torch.tensor([0.5, -2.0, 1.0, 0.0, 3.0, -1.0, 0.25])
    gids = torch.tensor([7, 7, 7, 9, 9, 9, 9])
    uniq, inverse, size = torch.unique(gids, sorted=True, return_inverse=True, return_counts=True)
    a = adv.double()
    group = keep_counts(a, uniq, inverse, size, CPPOConfig(pruning_rate=0.5))
    assert group.size.tolist() == [3, 4] and group.keep.tolist() == [1, 2] and group.of.tolist() == inverse.tolist()
    batch = keep_counts(a, uniq, inverse, size, CPPOConfig(pruning_rate=0.5, scope="batch"))
    assert batch.size.tolist() == [7] and batch.keep.tolist() == [3] and batch.of.tolist() == [0] * 7
    per_group = keep_counts(a, uniq, inverse, size, CPPOConfig(keep_per_group=2, scope="batch"))
    assert per_group.keep.tolist() == [4]  # k x the number of groups, across the batch
    kept, weights = choose_kept(a, group, CPPOConfig(pruning_rate=0.5), step=0)
    assert sorted(kept.tolist()) == [1, 4, 5] and weights is None  # |A| largest per group: -2 | 3, -1
    kept, _ = choose_kept(a, batch, CPPOConfig(pruning_rate=0.5, scope="batch"), step=0)
    assert sorted(kept.tolist()) == [1, 4, 5]  # |A| largest across the batch: 3, -2, -1
    sel = select_completions(adv, gids, CPPOConfig(pruning_rate=0.5))
    assert sel.kept.tolist() == [1, 4, 5] and sel.kept_per_group.tolist() == [1, 2]
    with pytest.raises(ValueError, match="keep_per_group=4 is larger than group 7 \\(3 completions\\)"):
        select_completions(adv, gids, CPPOConfig(keep_per_group=4, scope="batch"))
    stats = GroupStats.__new__(GroupStats)
    object.__setattr__(stats, "inverse", torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="stats describe 3 completions but the batch has 7"):
        select_completions(adv, gids, CPPOConfig(pruning_rate=0.5), stats=stats)
