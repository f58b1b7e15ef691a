import math

import pytest
import torch

from cppo_megatron import CPPOConfig
from cppo_megatron.core import advantages_from_stats, group_advantages, prune


def test_full_group_statistics_case_from_algorithm_md():
    rewards = torch.tensor([1.0, 0, 0, 0, 0, 0, 0, 0])
    res = prune(rewards, torch.zeros(8, dtype=torch.long), CPPOConfig(keep_per_group=4))
    kept = res.kept_advantages
    assert res.selection.num_kept == 4
    assert 0 in res.selection.kept.tolist()
    assert kept[0].item() == pytest.approx(2.4749, abs=1e-4)
    assert torch.allclose(kept[1:], torch.full((3,), -0.35355), atol=1e-4)
    # recomputing over the survivors would have given +1.50 / -0.50: make sure we did not
    assert not torch.allclose(kept[1:], torch.full((3,), -0.5), atol=1e-2)


def test_matches_torch_std_per_group_with_unsorted_noncontiguous_ids():
    gen = torch.Generator().manual_seed(3)
    ids = torch.tensor([907, 5, 907, 12, 5, 5, 12, 907, 907, 40], dtype=torch.int64)
    r = torch.rand(10, generator=gen)
    adv, stats = group_advantages(r, ids, eps=1e-6)
    assert stats.group_ids.tolist() == [5, 12, 40, 907]
    assert stats.size.tolist() == [3, 2, 1, 4]
    for gid in (5, 12, 907):
        m = ids == gid
        expect = (r[m] - r[m].mean()) / (r[m].std() + 1e-6)
        assert torch.allclose(adv[m], expect, atol=1e-6)
    # singleton group: mean 0, std 1 as veRL
    assert adv[ids == 40].item() == pytest.approx(r[9].item() / (1 + 1e-6), rel=1e-6)


def test_dr_grpo_no_std_division():
    r = torch.tensor([1.0, 0.0, 0.0, 3.0])
    adv, _ = group_advantages(r, torch.tensor([0, 0, 1, 1]), adv_norm="none")
    assert adv.tolist() == pytest.approx([0.5, -0.5, -1.5, 1.5])


def test_zero_variance_group_has_zero_advantage():
    adv, stats = group_advantages(torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0]), torch.tensor([0, 0, 0, 1, 1]))
    assert adv[:3].abs().max().item() == 0.0
    assert stats.zero_variance().tolist() == [True, False]


def test_advantages_from_recorded_stats_equal_full_group_values_after_pruning():
    gen = torch.Generator().manual_seed(0)
    r = (torch.rand(64, generator=gen) < 0.4).float()
    g = torch.arange(64) // 16
    res = prune(r, g, CPPOConfig(pruning_rate=0.75))
    kept = res.selection.kept
    again = advantages_from_stats(r[kept], res.stats.row_mean()[kept], res.stats.row_std()[kept])
    assert torch.allclose(again, res.kept_advantages, atol=1e-6)


@pytest.mark.parametrize(
    "rewards, ids, match",
    [
        (torch.tensor([1.0, float("nan")]), torch.tensor([0, 0]), r"rewards\[1\] = nan"),
        (torch.tensor([1.0, float("inf")]), torch.tensor([0, 0]), r"rewards\[1\] = inf"),
        (torch.tensor([1.0, 0.0]), torch.tensor([0, 0, 1]), "lengths must match"),
        (torch.tensor([]), torch.tensor([], dtype=torch.long), "empty"),
        (torch.tensor([1.0, 0.0]), torch.tensor([0, -3]), r"group_ids\[1\] = -3 is negative"),
        (torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]), "integer tensor"),
        (torch.ones(2, 2), torch.tensor([0, 1]), "1-D"),
    ],
)
def test_bad_input_is_an_error(rewards, ids, match):
    with pytest.raises(ValueError, match=match):
        group_advantages(rewards, ids)


def test_unknown_adv_norm():
    with pytest.raises(ValueError, match="adv_norm"):
        group_advantages(torch.ones(2), torch.zeros(2, dtype=torch.long), adv_norm="mean")


def test_large_batch_is_exact_vs_loop():
    gen = torch.Generator().manual_seed(1)
    g = torch.randint(0, 500, (5000,), generator=gen)
    r = torch.randn(5000, generator=gen, dtype=torch.float64)
    adv, stats = group_advantages(r, g)
    for gid in g.unique()[:50].tolist():
        m = g == gid
        if m.sum() == 1:
            continue
        expect = (r[m] - r[m].mean()) / (r[m].std() + 1e-6)
        assert torch.allclose(adv[m], expect, atol=1e-10)
    assert math.isclose(float(stats.size.sum()), 5000)
