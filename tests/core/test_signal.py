"""core/signal.py: the per-step signal/* metrics every host logs, pinned by value."""

import pytest
import torch

from cppo_megatron.core.signal import SIGNAL_KEYS, gen_share, signal_metrics


def test_shares_by_value_with_correctness():
    # four groups of 3: all correct (reward 1.1), all wrong and unformatted (0.0), mixed, and all
    # wrong but not equal (formatted 0.1 vs 0.0: has variance, so it carries a signal)
    rewards = torch.tensor([1.1, 1.1, 1.1, 0.0, 0.0, 0.0, 1.1, 0.1, 0.1, 0.1, 0.0, 0.1])
    correct = torch.tensor([1, 1, 1, 0, 0, 0, 1, 0, 0, 0, 0, 0], dtype=torch.float32)
    gids = torch.tensor([7, 7, 7, 3, 3, 3, 9, 9, 9, 1, 1, 1])
    lengths = torch.tensor([40, 42, 44, 96, 96, 90, 30, 50, 70, 60, 61, 62])
    m = signal_metrics(rewards, gids, correct=correct, lengths=lengths)
    assert m == {"signal/groups": 4.0, "signal/zero_variance_share": 0.5, "signal/all_correct_share": 0.25,
                 "signal/all_wrong_share": 0.25, "signal/completions": 12.0, "signal/mean_length": 741 / 12,
                 "signal/generated_tokens": 741.0}
    assert [k.split("/", 1)[1] for k in m] == list(SIGNAL_KEYS)


def test_with_correctness_the_flags_decide_not_the_reward_level():
    # reward weight 0.5 for a correct answer: an all-correct group sits below the 1.0 threshold
    rewards = torch.tensor([0.5, 0.5, 1.0, 1.0, 1.0, 1.0])
    correct = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 0.0])  # and two groups rewarded 1.0 for something else
    gids = torch.tensor([0, 0, 1, 1, 2, 2])
    m = signal_metrics(rewards, gids, correct=correct)
    assert (m["signal/all_correct_share"], m["signal/all_wrong_share"]) == (pytest.approx(1 / 3), pytest.approx(2 / 3))
    # without the flags the 1.0 threshold decides: the other way round
    m = signal_metrics(rewards, gids)
    assert (m["signal/all_correct_share"], m["signal/all_wrong_share"]) == (pytest.approx(2 / 3), pytest.approx(1 / 3))


def test_without_correctness_the_reward_threshold_decides():
    rewards = torch.tensor([1.0, 1.0, 0.5, 0.5, 0.0, 1.0])
    gids = torch.tensor([0, 0, 1, 1, 2, 2])
    m = signal_metrics(rewards, gids)
    assert (m["signal/zero_variance_share"], m["signal/all_correct_share"], m["signal/all_wrong_share"]) == (
        pytest.approx(2 / 3), pytest.approx(1 / 3), pytest.approx(1 / 3))
    m = signal_metrics(rewards, gids, easy_threshold=0.5, prefix="x/")
    assert m["x/all_correct_share"] == pytest.approx(2 / 3) and m["x/all_wrong_share"] == 0.0
    assert "x/mean_length" not in m


def test_uneven_groups_and_singletons():
    # a group of one has no variance to speak of: not counted as zero-variance
    m = signal_metrics(torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.tensor([0, 1, 1, 2]))
    assert m["signal/groups"] == 3 and m["signal/zero_variance_share"] == pytest.approx(1 / 3)
    assert m["signal/all_wrong_share"] == pytest.approx(1 / 3)


def test_empty_batch_and_refusals():
    m = signal_metrics(torch.tensor([]), torch.tensor([], dtype=torch.int64), lengths=torch.tensor([]))
    assert m["signal/groups"] == 0 and m["signal/zero_variance_share"] == 0 and m["signal/mean_length"] == 0
    with pytest.raises(ValueError, match=r"group_ids must be \[N\] integers, one per reward \(N=2\)"):
        signal_metrics(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match=r"group_ids must be \[N\] integers"):
        signal_metrics(torch.tensor([1.0, 0.0]), torch.tensor([0]))
    with pytest.raises(ValueError, match=r"correct must be \[N\] with one entry per reward \(N=2\)"):
        signal_metrics(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), correct=torch.tensor([1.0]))
    with pytest.raises(ValueError, match="lengths must be >= 0 tokens, got -1"):
        signal_metrics(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), lengths=torch.tensor([3, -1]))
    with pytest.raises(ValueError, match="rewards"):
        signal_metrics(torch.tensor([1.0, float("nan")]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="prefix must be a str"):
        signal_metrics(torch.tensor([1.0]), torch.tensor([0]), prefix=None)


def test_gen_share():
    assert gen_share(3.0, 4.0) == {"signal/gen_share": 0.75}
    assert gen_share(0.0, 0.0) == {"signal/gen_share": 0.0}
    for bad in (-1.0, float("nan"), True, "1"):
        with pytest.raises(ValueError, match="t_gen must be seconds >= 0"):
            gen_share(bad, 1.0)
