"""Two waves in the core (``core.two_wave``, ``settings.TwoWaveConfig``): which groups are finished
for planted first-wave rewards, where each wave's rows sit, the accounting counts every
completion, the estimator is GRPO on finished groups and 0 elsewhere, and bad inputs are named."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cppo_megatron.core import (
    CPPOConfig,
    TwoWaveConfig,
    finish_groups,
    group_advantages,
    two_wave_accounting,
    two_wave_advantages,
    wave_rows,
)


def test_finish_groups_finishes_exactly_the_groups_whose_first_wave_varies():
    first = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.1, 0.1, 1.1], [0.1, 0.0, 0.1]])
    assert finish_groups(first).tolist() == [False, True, False, True, True]
    # min_spread: a spread of 0.1 (format alone) is not enough at 0.5; nothing spreads past 1.5
    assert finish_groups(first, min_spread=0.5).tolist() == [False, True, False, True, False]
    assert finish_groups(first, min_spread=1.5).tolist() == [False, False, False, False, False]
    assert finish_groups(torch.zeros(0, 2)).tolist() == []
    assert finish_groups(torch.tensor([[True, False]])).tolist() == [True]  # 0/1 rewards as bools


@pytest.mark.parametrize("bad, message", [
    (torch.ones(4), r"first_wave must be an \[n, k\] tensor of rewards .* got shape \(4,\)"),
    (torch.ones(3, 1), "first_wave has k=1 completions per group: .* at least 2"),
    (torch.tensor([[0.0, float("nan")], [1.0, 1.0]]), r"non-finite rewards \(rows \[0\]\)"),
    (torch.ones(2, 2, dtype=torch.complex64), "must be an"),
])
def test_finish_groups_names_a_bad_first_wave(bad, message):
    with pytest.raises(ValueError, match=message):
        finish_groups(bad)


def test_finish_groups_names_a_bad_min_spread():
    with pytest.raises(ValueError, match="min_spread must be >= 0.0, got -0.1"):
        finish_groups(torch.ones(2, 2), min_spread=-0.1)


def test_wave_rows_places_each_wave_in_the_group_layout():
    first, second, absent = wave_rows(torch.tensor([False, True, False, True]), group_size=4, first_wave=1)
    assert first.tolist() == [0, 4, 8, 12]
    assert second.tolist() == [5, 6, 7, 13, 14, 15]
    assert absent.nonzero().squeeze(1).tolist() == [1, 2, 3, 9, 10, 11]
    # every row is exactly one of: first wave, second wave, absent
    cover = torch.zeros(16, dtype=torch.int64)
    cover[first] += 1
    cover[second] += 1
    cover[absent] += 1
    assert cover.tolist() == [1] * 16


@pytest.mark.parametrize("args, message", [
    ((torch.tensor([True]), 4, 4), "first_wave=4 must be smaller than group_size=4"),
    ((torch.tensor([True]), 1, 1), "group_size must be an integer >= 2, got 1"),
    ((torch.tensor([True]), 4, 0), "first_wave must be an integer >= 1, got 0"),
    ((torch.tensor([1, 0]), 4, 2), r"finish must be an \[n\] bool tensor"),
])
def test_wave_rows_names_bad_arguments(args, message):
    with pytest.raises(ValueError, match=message):
        wave_rows(*args)


def _lengths(finish, G, k, first_len, second_len):
    first, second, absent = wave_rows(finish, G, k)
    ln = torch.zeros(finish.numel() * G, dtype=torch.int64)
    ln[first] = first_len
    ln[second] = second_len
    return ln, absent


def test_accounting_counts_every_completion_and_the_tokens():
    """n = 3 groups of G = 4, k = 2, groups 0 and 2 finished: 3*2 + 2*2 = 10 generated of 12, group
    1's 2 completions generated and never trained; its second wave saved at its first wave's mean."""
    finish = torch.tensor([True, False, True])
    ln, absent = _lengths(finish, 4, 2, torch.tensor([3, 5, 4, 6, 7, 1]), torch.tensor([2, 2, 8, 8]))
    acc = two_wave_accounting(finish, ln, absent, group_size=4, first_wave=2)
    assert (acc.groups, acc.finished, acc.unfinished) == (3, 2, 1)
    assert (acc.completions_wave1, acc.completions_wave2, acc.completions_generated) == (6, 4, 10)
    assert (acc.completions_full, acc.completions_unfinished) == (12, 2)
    assert (acc.tokens_wave1, acc.tokens_wave2, acc.tokens_generated) == (26, 20, 46)
    assert acc.tokens_saved_estimate == 2 * (4 + 6) / 2
    m = acc.metrics()
    assert m["two_wave/finished_share"] == pytest.approx(2 / 3)
    assert m["two_wave/completions_share"] == pytest.approx(10 / 12)
    assert m["two_wave/tokens_share_estimate"] == pytest.approx(46 / 56)
    assert m["two_wave/groups_unfinished"] == 1.0 and m["two_wave/completions_unfinished"] == 2.0
    assert all(isinstance(v, float) for v in m.values())


def test_accounting_of_an_empty_step_and_of_zero_tokens():
    acc = two_wave_accounting(torch.zeros(0, dtype=torch.bool), torch.zeros(0, dtype=torch.int64),
                              torch.zeros(0, dtype=torch.bool), group_size=4, first_wave=2)
    m = acc.metrics()
    assert m["two_wave/finished_share"] == 0.0 and m["two_wave/completions_share"] == 0.0
    assert m["two_wave/tokens_share_estimate"] == 1.0


def test_accounting_refuses_rows_that_do_not_match_the_decisions():
    finish = torch.tensor([True, False])
    ln, absent = _lengths(finish, 4, 2, torch.tensor([1, 1, 1, 1]), torch.tensor([1, 1]))
    with pytest.raises(RuntimeError, match=r"absent rows \[\] differ from the unfinished groups' second waves "
                                           r"\[6, 7\]"):
        two_wave_accounting(finish, ln, torch.zeros(8, dtype=torch.bool), group_size=4, first_wave=2)
    bad = ln.clone()
    bad[6] = 3  # a length on a row never generated
    with pytest.raises(RuntimeError, match="a row never generated has tokens"):
        two_wave_accounting(finish, bad, absent, group_size=4, first_wave=2)
    with pytest.raises(ValueError, match=r"lengths \(7,\) .* must be \[n\*G\] = \[8\]"):
        two_wave_accounting(finish, ln[:7], absent, group_size=4, first_wave=2)
    with pytest.raises(ValueError, match="must be"):
        two_wave_accounting(finish, ln.float(), absent, group_size=4, first_wave=2)


def test_accounting_check_catches_a_miscount():
    acc = two_wave_accounting(torch.tensor([True]), torch.ones(4, dtype=torch.int64),
                              torch.zeros(4, dtype=torch.bool), group_size=4, first_wave=2)
    with pytest.raises(RuntimeError, match=r"2 first-wave and 4 second-wave completions for 1 groups \(1 finished\)"):
        dataclasses.replace(acc, completions_wave2=4).check()
    with pytest.raises(RuntimeError, match=r"for 1 groups \(2 finished\)"):
        dataclasses.replace(acc, finished=2, completions_wave2=4).check()


def test_the_estimator_is_grpo_on_finished_groups_and_zero_elsewhere():
    r = torch.tensor([[1.0, 1.0, 0.0, 1.0],   # first 2 agree: unfinished although the group varies (the bias)
                      [1.0, 0.0, 0.0, 0.0],   # finished
                      [0.0, 0.0, 0.0, 0.0]])  # unfinished, and no signal anyway
    cfg = CPPOConfig(pruning_rate=0.0)
    adv, finish = two_wave_advantages(r, 2, cfg)
    assert finish.tolist() == [False, True, False]
    full, _ = group_advantages(r.reshape(-1), torch.arange(3).repeat_interleave(4))
    assert adv[4:8].tolist() == pytest.approx(full[4:8].tolist())
    assert adv[:4].tolist() == [0.0] * 4 and adv[8:].tolist() == [0.0] * 4
    assert full[:4].abs().sum() > 0  # the signal the first two completions hid
    adv_none, _ = two_wave_advantages(r, 2, CPPOConfig(pruning_rate=0.0, adv_norm="none"))
    assert adv_none[4:8].tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])
    with pytest.raises(ValueError, match="first_wave=4 must be smaller than the group size G=4"):
        two_wave_advantages(r, 4, cfg)
    with pytest.raises(ValueError, match="first_wave must be an integer >= 2, got 1"):
        two_wave_advantages(r, 1, cfg)


def test_config_section_defaults_checks_and_refusals():
    cfg = CPPOConfig(pruning_rate=0.0, two_wave={"enabled": True})
    assert cfg.two_wave.first_wave_for(16) == 4 and cfg.two_wave.first_wave_for(4) == 2
    assert cfg.two_wave.first_wave_for(8) == 2
    assert "two_wave(first_wave=None, min_spread=0)" in cfg.describe()
    assert CPPOConfig.from_dict({"two_wave.enabled": True, "two_wave.first_wave": 3}).two_wave.first_wave == 3
    with pytest.raises(ValueError, match="cppo.two_wave.first_wave=4 must be smaller than rollout.group_size=4"):
        TwoWaveConfig(enabled=True, first_wave=4).first_wave_for(4)
    with pytest.raises(ValueError, match="CPPOConfig.two_wave.first_wave must be >= 2, got 1; one completion never shows"):
        CPPOConfig(two_wave={"first_wave": 1})
    with pytest.raises(ValueError, match="CPPOConfig.two_wave.min_spread must be >= 0, got -1"):
        CPPOConfig(two_wave={"min_spread": -1})
    for other, key in (({"early_stop": {"enabled": True}}, "early_stop.enabled"),
                       ({"selective": {"enabled": True}}, "selective.enabled")):
        with pytest.raises(ValueError, match=f"cppo.two_wave does not combine with cppo.{key}"):
            CPPOConfig(pruning_rate=0.5, two_wave={"enabled": True}, **other)
    # off: the other sections are free
    CPPOConfig(pruning_rate=0.5, two_wave={"enabled": False}, early_stop={"enabled": True})
