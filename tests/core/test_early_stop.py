"""core.early_stop: the stop rule, the estimator, the predictor and the accounting, pinned by value."""

from __future__ import annotations

import math

import pytest
import torch

from cppo_megatron.core import prune
from cppo_megatron.core.early_stop import (
    FINISHED,
    RUNNING,
    STOPPED,
    PrefixPredictor,
    StopAccounting,
    calibration,
    decide_stops,
    early_stop_prune,
    replay_early_stop,
    estimate_full_lengths,
    explore_groups,
    feature_names,
    imputed_moments,
    prefix_features,
    roc_auc,
)
from cppo_megatron.core.settings import EarlyStopConfig
from cppo_megatron.core.settings import CPPOConfig


def _cfg(**es) -> CPPOConfig:
    return CPPOConfig(pruning_rate=0.5, early_stop={"enabled": True, **es})


# ---------------------------------------------------------------------------------- the rule
def test_planted_scores_stop_exactly_the_completions_the_rule_names():
    # group 0: expected success share 0.2833 < 1/2, so success is the minority: the running members
    # most likely to FAIL are stopped, the most certain first, down to min_running = 2 alive
    q = torch.tensor([0.9, 0.1, 0.2, 0.05, 0.3, 0.15, 0.5, 0.5])
    g = torch.tensor([0, 0, 0, 0, 0, 0, 1, 1])
    status = torch.tensor([RUNNING] * 5 + [FINISHED, RUNNING, RUNNING])
    d = decide_stops(q, g, status, min_running=2, min_confidence=0.6)
    assert d.stop.nonzero().squeeze(1).tolist() == [1, 2, 3, 4]
    assert d.majority.tolist() == pytest.approx([0.1, 0.9, 0.8, 0.95, 0.7, 0.85, 0.0, 0.0])
    assert d.expected_share[0].item() == pytest.approx(1.7 / 6)
    # one stop fewer allowed (min_running 3): the least certain candidate (q 0.3, majority 0.7) runs on
    d3 = decide_stops(q, g, status, min_running=3, min_confidence=0.6)
    assert d3.stop.nonzero().squeeze(1).tolist() == [1, 2, 3]
    # only two allowed: the two most certain (0.95, then 0.9)
    d4 = decide_stops(q, g, status, min_running=4, min_confidence=0.6)
    assert d4.stop.nonzero().squeeze(1).tolist() == [1, 3]


def test_majority_success_stops_the_likely_successes():
    q = torch.tensor([0.95, 0.9, 0.8, 0.1, 0.7])
    d = decide_stops(q, torch.zeros(5, dtype=torch.long), torch.zeros(5, dtype=torch.long), min_running=2,
                     min_confidence=0.75)
    # share 0.69 > 1/2: failure is the minority; q >= 0.75 are candidates (0.95, 0.9, 0.8), all three go
    assert d.stop.tolist() == [True, True, True, False, False]


def test_confidence_threshold_and_no_majority():
    g = torch.zeros(4, dtype=torch.long)
    run = torch.zeros(4, dtype=torch.long)
    d = decide_stops(torch.tensor([0.45, 0.4, 0.3, 0.36]), g, run, min_running=1, min_confidence=0.65)
    assert d.stop.tolist() == [False, False, True, False]  # only 1 - 0.3 = 0.7 reaches 0.65
    tie = decide_stops(torch.tensor([0.9, 0.1, 0.9, 0.1]), g, run, min_running=1, min_confidence=0.5)
    assert not tie.stop.any()  # share exactly 1/2: no majority, nothing stops


def test_stopped_members_keep_counting_in_the_share_and_alive_count():
    # 3 stopped failures (q 0.1) keep the share at 0.4 < 1/2 although the 4 alive members balance
    q = torch.tensor([0.1, 0.1, 0.1, 0.9, 0.9, 0.2, 0.2])
    status = torch.tensor([STOPPED] * 3 + [RUNNING] * 4)
    d = decide_stops(q, torch.zeros(7, dtype=torch.long), status, min_running=3, min_confidence=0.6)
    assert d.expected_share[0].item() == pytest.approx(2.5 / 7)
    assert d.stop.tolist() == [False] * 5 + [True, False]  # 4 alive - 3 = one stop; stopped rows never again


def test_inactive_groups_never_stop_and_ties_follow_the_seed():
    q = torch.full((8,), 0.1)
    g = torch.tensor([0] * 4 + [1] * 4)
    run = torch.zeros(8, dtype=torch.long)
    active = torch.tensor([False] * 4 + [True] * 4)
    d = decide_stops(q, g, run, min_running=2, min_confidence=0.6, active=active, seed=3, step=5)
    assert not d.stop[:4].any() and d.num_stopped == 2
    again = decide_stops(q, g, run, min_running=2, min_confidence=0.6, active=active, seed=3, step=5)
    assert torch.equal(d.stop, again.stop)
    picks = {tuple(decide_stops(q, g, run, min_running=2, min_confidence=0.6, active=active, seed=s).stop.tolist())
             for s in range(12)}
    assert len(picks) > 1  # equal scores: the seed decides, not the row order


def test_decide_stops_refuses_bad_input():
    q, g, st = torch.tensor([0.1, 0.2]), torch.tensor([0, 0]), torch.tensor([0, 0])
    with pytest.raises(ValueError, match="min_confidence"):
        decide_stops(q, g, st, min_running=1, min_confidence=0.4)
    with pytest.raises(ValueError, match="status"):
        decide_stops(q, g, torch.tensor([0, 5]), min_running=1, min_confidence=0.6)
    with pytest.raises(ValueError, match="min_running"):
        decide_stops(q, g, st, min_running=0, min_confidence=0.6)
    assert decide_stops(torch.zeros(0), torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long),
                        min_running=1, min_confidence=0.6).num_stopped == 0


def test_explore_groups_is_seeded_and_counts_the_share():
    a = explore_groups(16, 0.25, seed=1, step=2)
    assert int(a.sum()) == 4 and torch.equal(a, explore_groups(16, 0.25, seed=1, step=2))
    assert not torch.equal(a, explore_groups(16, 0.25, seed=1, step=3))
    assert int(explore_groups(10, 0.0, seed=0, step=0).sum()) == 0
    assert bool(explore_groups(5, 1.0, seed=0, step=0).all())
    counts = [int(explore_groups(4, 0.3, seed=0, step=s).sum()) for s in range(400)]
    assert sum(counts) / 400 == pytest.approx(1.2, abs=0.1)  # floor(share M + u): share M on average
    with pytest.raises(ValueError, match="share"):
        explore_groups(4, 1.5, seed=0, step=0)


# ---------------------------------------------------------------------------------- estimator
def test_impute_estimator_by_value():
    r = torch.tensor([1.0, 0, 0, 0, 1, 0, 0, 1])
    stop = torch.tensor([0, 0, 1, 1, 0, 0, 0, 0], dtype=torch.bool)
    g = torch.tensor([0, 0, 0, 0, 0, 0, 1, 1])
    mu, sq = imputed_moments(torch.full((8,), 0.2), (0.0, 1.0))
    res = early_stop_prune(r, stop, g, _cfg(), expected=mu, expected_sq=sq)
    # group 0: mean (2 + 0.4) / 6 = 0.4; SS = 2 + 0.4 - 6 * 0.16 - 2 * 0.16 / 6 = 1.38667; std sqrt(SS / 5)
    assert res.stats.mean.tolist() == pytest.approx([0.4, 0.5])
    std0 = math.sqrt((2.4 - 0.96 - 0.32 / 6) / 5)
    assert res.stats.std.tolist() == pytest.approx([std0, math.sqrt(0.5)])
    a1 = (1 - 0.4) / (std0 + 1e-6)
    assert res.advantages[[0, 1, 2, 3]].tolist() == pytest.approx([a1, -0.4 / (std0 + 1e-6), 0.0, 0.0])
    # k = floor(6 * 0.5) = 3 of the FULL group, among the 4 finished; group 1 keeps 1 of 2
    assert res.selection.kept.tolist() == [0, 1, 4, 6]
    assert res.stopped.tolist() == [2, 3] and res.pruned_after.tolist() == [5, 7]
    assert set(res.selection.kept.tolist()).isdisjoint(res.stopped.tolist())
    assert res.selection.num_kept + res.pruned_after.numel() + res.stopped.numel() == 8


def test_impute_mean_and_variance_are_unbiased_for_a_calibrated_predictor():
    # 6 members; the finished ones (0..2) have known rewards, members 3..5 are stopped with success
    # probabilities q. Over every outcome of the stopped ones, weighted by its probability, the
    # imputed mean and variance equal the expected full-group mean and (unbiased) variance exactly.
    import itertools

    q = torch.tensor([0.0, 0.0, 0.0, 0.3, 0.7, 0.1], dtype=torch.float64)
    r_fin = [1.0, 0.0, 1.0]
    g = torch.zeros(6, dtype=torch.long)
    stop = torch.tensor([0, 0, 0, 1, 1, 1], dtype=torch.bool)
    mu, sq = imputed_moments(q, (0.0, 1.0))
    s = early_stop_prune(torch.tensor(r_fin + [0.0] * 3), stop, g, _cfg(), expected=mu, expected_sq=sq).stats
    mean = var = 0.0
    for outcome in itertools.product([0.0, 1.0], repeat=3):
        p = math.prod(float(q[3 + i]) if o else 1 - float(q[3 + i]) for i, o in enumerate(outcome))
        r = torch.tensor(r_fin + list(outcome), dtype=torch.float64)
        mean += p * float(r.mean())
        var += p * float(r.var())
    assert float(s.mean[0]) == pytest.approx(mean, abs=1e-12)
    assert float(s.std[0]) ** 2 == pytest.approx(var, abs=1e-12)


def test_finished_estimator_uses_the_finished_rows_alone():
    r = torch.tensor([1.0, 0, 0, 0, 1, 0])
    stop = torch.tensor([0, 0, 1, 1, 0, 0], dtype=torch.bool)
    res = early_stop_prune(r, stop, torch.zeros(6, dtype=torch.long), _cfg(estimator="finished"))
    assert res.stats.mean.tolist() == pytest.approx([0.5])
    assert res.stats.std.tolist() == pytest.approx([math.sqrt(1 / 3)])
    assert res.advantages[2].item() == 0.0 and res.advantages[3].item() == 0.0


def test_without_stops_it_is_cppo():
    r = torch.tensor([1.0, 0, 0, 0, 0, 1, 1, 1])
    g = torch.tensor([0] * 4 + [1] * 4)
    res = early_stop_prune(r, torch.zeros(8, dtype=torch.bool), g, _cfg(), step=4)
    ref = prune(r, g, _cfg(), step=4)
    assert torch.equal(res.selection.kept, ref.selection.kept)
    assert res.advantages.tolist() == pytest.approx(ref.advantages.tolist())
    assert res.stopped.numel() == 0


def test_impute_needs_the_expectations_and_rewards_of_stopped_rows_are_ignored():
    r = torch.tensor([1.0, float("nan"), 0.0, 1.0])
    stop = torch.tensor([0, 1, 0, 0], dtype=torch.bool)
    g = torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="expected"):
        early_stop_prune(r, stop, g, _cfg())
    mu, sq = imputed_moments(torch.full((4,), 0.5), (0.0, 1.0))
    res = early_stop_prune(r, stop, g, _cfg(), expected=mu, expected_sq=sq)
    assert math.isfinite(float(res.stats.mean[0]))
    with pytest.raises(ValueError, match="rewards"):
        early_stop_prune(torch.tensor([1.0, 0.0]), stop, g, _cfg())


def test_fewer_finished_than_k_keeps_every_finished_row():
    r = torch.tensor([1.0, 0, 0, 0])
    stop = torch.tensor([0, 1, 1, 1], dtype=torch.bool)
    mu, sq = imputed_moments(torch.full((4,), 0.1), (0.0, 1.0))
    res = early_stop_prune(r, stop, torch.zeros(4, dtype=torch.long), _cfg(), expected=mu, expected_sq=sq)
    assert res.selection.kept.tolist() == [0]  # k = 2 but one finished


def test_importance_weights_come_back_on_the_kept_rows():
    cfg = CPPOConfig(pruning_rate=0.5, metric="importance", early_stop={"enabled": True, "estimator": "finished"})
    r = torch.tensor([1.0, 0, 0, 1, 0, 0])
    stop = torch.tensor([0, 0, 0, 0, 1, 1], dtype=torch.bool)
    res = early_stop_prune(r, stop, torch.zeros(6, dtype=torch.long), cfg)
    assert res.selection.num_kept == 3 and res.selection.weighted
    assert res.selection.weights is not None and bool((res.selection.weights >= 1).all())


# ---------------------------------------------------------------------------------- predictor
def test_predictor_learns_a_separable_signal_and_round_trips():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(300, 3, generator=gen)
    y = (x[:, 0] > 0).to(torch.float32)
    rewards = y * 1.1 + 0.1
    p = PrefixPredictor(l2=1.0).fit(x, y, rewards)
    assert p.fitted and p.version == 1 and p.examples == (int((y == 0).sum()), int(y.sum()))
    assert p.class_means == pytest.approx((0.1, 1.2))
    assert roc_auc(p.predict(x), y) > 0.99
    clone = PrefixPredictor()
    clone.load_state_dict(p.state_dict())
    assert torch.equal(clone.predict(x), p.predict(x)) and clone.version == 1


def test_predictor_refuses_what_it_cannot_fit():
    p = PrefixPredictor()
    with pytest.raises(RuntimeError, match="before fit"):
        p.predict(torch.zeros(1, 2))
    with pytest.raises(ValueError, match="both outcomes"):
        p.fit(torch.zeros(3, 2), torch.ones(3), torch.ones(3))
    with pytest.raises(ValueError, match="0/1"):
        p.fit(torch.zeros(2, 2), torch.tensor([0.0, 2.0]), torch.ones(2))
    with pytest.raises(ValueError, match="align"):
        p.fit(torch.zeros(3, 2), torch.tensor([0.0, 1.0]), torch.ones(2))
    p.fit(torch.tensor([[0.0], [1.0]]), torch.tensor([0.0, 1.0]), torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="predict"):
        p.predict(torch.zeros(1, 3))


def test_prefix_features_by_value():
    lp = torch.log(torch.tensor([[0.9, 0.4, 0.8, 0.2], [0.6, 0.6, 0.0, 0.0], [0.3, 0.9, 0.9, 0.9]]))
    lengths = torch.tensor([4, 2, 4])
    g = torch.tensor([0, 0, 1])
    finished = torch.tensor([False, True, False])
    f = prefix_features(lp, lengths, g, finished, segment_tokens=2, max_new_tokens=8)
    assert f.shape == (3, len(feature_names("logprob")))
    mean0 = float(lp[0].mean())
    assert f[0, 0].item() == pytest.approx(mean0)
    assert f[0, 1].item() == pytest.approx(math.log(0.2))
    assert f[0, 2].item() == pytest.approx((math.log(0.8) + math.log(0.2)) / 2)
    assert f[0, 3].item() == pytest.approx(math.log(0.2))
    assert f[0, 4].item() == pytest.approx(0.5)  # 0.4 and 0.2 are below one half
    assert f[1, 5].item() == pytest.approx(0.25) and f[1, 6].item() == 1.0
    gmean = (mean0 + math.log(0.6)) / 2
    assert f[0, 7].item() == pytest.approx(gmean) and f[0, 8].item() == pytest.approx(mean0 - gmean)
    assert f[2, 8].item() == pytest.approx(0.0) and f[2, 9].item() == pytest.approx(0.0)  # alone in its group
    ent = torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.5, 0.5, 9.0, 9.0], [0.0, 0.0, 0.0, 0.0]])
    fh = prefix_features(lp, lengths, g, finished, segment_tokens=2, max_new_tokens=8, entropies=ent,
                         hidden=torch.ones(3, 5))
    assert fh.shape == (3, len(feature_names("hidden", 5)))
    assert fh[0, 10:14].tolist() == pytest.approx([2.5, 4.0, 3.5, 1.0])  # mean, max, last mean, centred
    assert fh[1, 11].item() == 0.5  # padding beyond the prefix is never read
    with pytest.raises(ValueError, match="lengths"):
        prefix_features(lp, torch.tensor([5, 2, 4]), g, finished, segment_tokens=2, max_new_tokens=8)
    with pytest.raises(ValueError, match="hidden"):
        prefix_features(lp, lengths, g, finished, segment_tokens=2, max_new_tokens=8, hidden=torch.ones(2, 5))


# ---------------------------------------------------------------------------------- accounting, quality
def test_estimate_full_lengths():
    lengths = torch.tensor([10, 40, 16, 60, 16, 30])
    stop = torch.tensor([0, 0, 1, 0, 1, 0], dtype=torch.bool)
    g = torch.tensor([0, 0, 0, 1, 1, 2])
    est = estimate_full_lengths(lengths, stop, g)
    # row 2 (group 0, stopped at 16): its group's finished rows longer than 16 -> 40
    # row 4 (group 1, stopped at 16): group 1's finished longer than 16 -> 60
    assert est.tolist() == [10, 40, 40, 60, 60, 30]
    solo = estimate_full_lengths(torch.tensor([16, 8]), torch.tensor([True, False]), torch.tensor([0, 1]))
    assert solo.tolist() == [16, 8]  # nothing longer finished: no saving claimed


def test_stop_accounting_adds_up_or_raises():
    acc = StopAccounting(started=16, kept=2, pruned_after=6, stopped=8, tokens_generated=500, tokens_stopped=128,
                         tokens_budget=16 * 96, tokens_saved_estimate=250.0, extra={"predictor_auc": 0.7})
    m = acc.check().metrics()
    assert m["early_stop/stopped_share"] == 0.5 and m["early_stop/predictor_auc"] == 0.7
    assert m["early_stop/tokens_vs_full_estimate"] == pytest.approx(500 / 750)
    with pytest.raises(RuntimeError, match="started"):
        StopAccounting(started=16, kept=2, pruned_after=6, stopped=7).check()
    with pytest.raises(RuntimeError, match="nest"):
        StopAccounting(started=1, kept=1, tokens_generated=5, tokens_stopped=6, tokens_budget=10).check()


def test_roc_auc_and_calibration_by_value():
    assert roc_auc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1])) == 0.75
    assert roc_auc(torch.tensor([0.5, 0.5, 0.5]), torch.tensor([0, 1, 1])) == 0.5  # ties count one half
    assert math.isnan(roc_auc(torch.tensor([0.3, 0.4]), torch.tensor([1, 1])))
    brier, ece = calibration(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1]), bins=2)
    assert brier == pytest.approx((0.01 + 0.16 + 0.4225 + 0.04) / 4)
    # bin 0 (<0.5): mean 0.2833 vs 1/3 on 3 rows; bin 1: 0.8 vs 1 on 1 row
    assert ece == pytest.approx(3 / 4 * abs(0.85 / 3 - 1 / 3) + 1 / 4 * 0.2)
    assert all(math.isnan(v) for v in calibration(torch.zeros(0), torch.zeros(0)))


# ---------------------------------------------------------------------------------- settings
def test_settings_section_checks_and_refusals():
    cfg = CPPOConfig.from_dict({"pruning_rate": 0.875, "early_stop": {"enabled": True, "segment_tokens": 8}})
    assert isinstance(cfg.early_stop, EarlyStopConfig) and cfg.early_stop.segment_tokens == 8
    assert CPPOConfig.from_dict(cfg.to_dict()).early_stop == cfg.early_stop
    assert "early_stop(segment=8" in cfg.describe()
    assert cfg.early_stop.min_running_for(16, 2) == 4
    assert EarlyStopConfig(min_running=30).min_running_for(16, 2) == 16
    assert EarlyStopConfig(min_running=1).min_running_for(16, 2) == 2
    with pytest.raises(ValueError, match="unknown key"):
        CPPOConfig(early_stop={"segment": 8})
    for bad, match in [({"segment_tokens": 0}, "segment_tokens must be > 0"),
                       ({"estimator": "mean"}, "estimator must be one of"),
                       ({"min_confidence": 0.3}, "min_confidence"),
                       ({"explore_share": 1.5}, "explore_share"),
                       ({"min_running": 0}, "min_running"),
                       ({"enabled": "yes"}, "enabled must be true or false"),
                       ({"l2": -1.0}, "l2 must be >= 0"),
                       ({"timeout_s": float("inf")}, r"CPPOConfig.early_stop.timeout_s must be a finite number > 0, got inf")]:
        with pytest.raises(ValueError, match=match):
            EarlyStopConfig(**bad)
    with pytest.raises(ValueError, match="needs pruning"):
        CPPOConfig(pruning_rate=0.0, early_stop={"enabled": True})
    with pytest.raises(ValueError, match="group scope"):
        CPPOConfig(pruning_rate=0.5, scope="batch", early_stop={"enabled": True})
    with pytest.raises(ValueError, match="section"):
        c = CPPOConfig()
        c.early_stop = 3  # type: ignore[assignment]
        c.validate()
    with pytest.raises(ValueError, match=r"does not combine with cppo.selective.enabled"):
        CPPOConfig(pruning_rate=0.5, selective={"enabled": True}, early_stop={"enabled": True})
    with pytest.raises(ValueError, match=r"does not combine with cppo.dynamic_sampling"):
        CPPOConfig(pruning_rate=0.5, dynamic_sampling=True, early_stop={"enabled": True})
    CPPOConfig(pruning_rate=0.0, scope="batch")  # off: no constraint


def test_refusals_name_the_bad_value():
    with pytest.raises(ValueError, match=r"\[R, T\]"):
        prefix_features(torch.zeros(3), torch.zeros(3), torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.bool),
                        segment_tokens=2, max_new_tokens=4)
    with pytest.raises(ValueError, match="must be \\[2\\]"):
        prefix_features(torch.zeros(2, 3), torch.zeros(3, dtype=torch.long), torch.zeros(2, dtype=torch.long),
                        torch.zeros(2, dtype=torch.bool), segment_tokens=2, max_new_tokens=4)
    with pytest.raises(ValueError, match="must align"):
        roc_auc(torch.zeros(3), torch.zeros(2))
    # a group with no finished row cannot reach the finished-only estimator (min_running >= 1)
    with pytest.raises(ValueError, match="no finished completion"):
        early_stop_prune(torch.zeros(4), torch.tensor([True, True, False, False]), torch.tensor([0, 0, 1, 1]),
                         _cfg(estimator="finished"))


def test_history_keeps_its_steps_in_order_and_refits_only_when_ready():
    from cppo_megatron.core.early_stop import StopHistory

    h = StopHistory(keep_steps=2)
    x = torch.randn(6, 3)
    y = torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    h.add(1, x, y, y, (3, 3))
    with pytest.raises(ValueError, match="steps must increase"):
        h.add(1, x, y, y, (3, 3))
    with pytest.raises(ValueError, match="must align"):
        h.add(2, x, y[:3], y, (3, 3))
    with pytest.raises(ValueError, match="feature columns"):
        h.add(2, torch.randn(6, 4), y, y, (3, 3))
    h.add(2, torch.zeros(0, 0), torch.zeros(0), torch.zeros(0), (0, 0))  # a step without a boundary
    h.add(3, x, y, y, (3, 3))
    assert [s["step"] for s in h.steps] == [2, 3] and h.completions() == (3, 3)
    p = PrefixPredictor()
    assert not h.refit(p, min_examples=4) and not p.fitted  # 3 of each: not yet
    assert h.refit(p, min_examples=3) and p.fitted and p.examples == (3, 3)
    clone = StopHistory(1)
    clone.load_state_dict(h.state_dict())
    assert clone.keep_steps == 2 and clone.completions() == (3, 3)


def test_a_history_whose_completions_all_ended_before_a_boundary_fits_nothing():
    """Enough finished completions of each outcome, none of them long enough to reach the first boundary
    (no feature row): the predictor stays unfitted and not ready, where a fit on no rows used to raise."""
    from cppo_megatron.core.early_stop import StopHistory

    h = StopHistory(keep_steps=2)
    h.add(1, torch.zeros(0, 0), torch.zeros(0), torch.zeros(0), (4, 4))
    p = PrefixPredictor()
    assert h.completions() == (4, 4) and not h.refit(p, min_examples=2) and not p.fitted


def test_the_learner_state_round_trips_and_names_a_missing_key():
    from cppo_megatron.core.early_stop import RUN_TOTALS, StopHistory, learner_state, restore_learner_state

    h = StopHistory(keep_steps=2)
    x = torch.randn(6, 3, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    h.add(1, x, y, y, (3, 3))
    p = PrefixPredictor()
    assert h.refit(p, min_examples=3)
    totals = dict.fromkeys(RUN_TOTALS, 0.0) | {"stopped": 5.0}
    saved = learner_state(p, h, True, totals)
    p2, h2 = PrefixPredictor(), StopHistory(1)
    ready, back = restore_learner_state({**saved, "totals": {"stopped": 5.0}}, p2, h2, missing="{key}")
    assert ready is True and back == totals  # a total an older checkpoint lacks starts at 0
    assert torch.equal(p2.predict(x), p.predict(x)) and h2.completions() == (3, 3)
    with pytest.raises(ValueError, match="^host: 'ready' missing$"):
        restore_learner_state({k: v for k, v in saved.items() if k != "ready"}, p2, h2, missing="host: {key} missing")


def test_step_accounting_counts_every_row_and_refuses_a_kept_stopped_one():
    from cppo_megatron.core.early_stop import step_accounting

    lengths = torch.tensor([10, 40, 16, 60, 16, 30])
    stop = torch.tensor([0, 0, 1, 0, 1, 0], dtype=torch.bool)
    g = torch.tensor([0, 0, 0, 1, 1, 2])
    acc, kept_mask = step_accounting(lengths, stop, g, torch.tensor([1, 3]), 64)
    assert kept_mask.tolist() == [False, True, False, True, False, False]
    assert (acc.started, acc.kept, acc.pruned_after, acc.stopped) == (6, 2, 2, 2)
    assert (acc.tokens_generated, acc.tokens_stopped, acc.tokens_budget) == (172, 32, 6 * 64)
    assert acc.tokens_saved_estimate == (40 - 16) + (60 - 16)  # estimate_full_lengths over the stopped rows
    acc.check()
    with pytest.raises(RuntimeError, match=r"a stopped completion was kept for training \(rows \[2\]\)"):
        step_accounting(lengths, stop, g, torch.tensor([1, 2]), 64)
    with pytest.raises(ValueError, match="stopped has shape"):
        step_accounting(lengths, stop[:5], g, torch.tensor([1]), 64)
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1, got 0"):
        step_accounting(lengths, stop, g, torch.tensor([1]), 0)


def test_shadow_wrong_stop_share_is_the_kept_share_of_the_would_be_stops():
    from cppo_megatron.core.early_stop import shadow_wrong_stop_share

    shadow = torch.tensor([1, 1, 0, 1, 0], dtype=torch.bool)
    kept = torch.tensor([1, 0, 1, 0, 0], dtype=torch.bool)
    assert shadow_wrong_stop_share(shadow, kept) == pytest.approx(1 / 3)
    assert math.isnan(shadow_wrong_stop_share(torch.zeros(5, dtype=torch.bool), kept))
    with pytest.raises(ValueError, match="differ"):
        shadow_wrong_stop_share(shadow, kept[:4])


def test_the_stop_learner_adds_up_totals_and_round_trips_in_its_hosts_words():
    from cppo_megatron.core.early_stop import RUN_TOTALS, StopLearner

    learner = StopLearner(_cfg(), group_size=8, max_new_tokens=32)
    assert (learner.min_running, learner.ready) == (8, False)  # 2 k = 8 with k = 4 of G = 8
    acc = StopAccounting(started=8, kept=4, stopped=4, tokens_generated=100, tokens_saved_estimate=20.0)
    learner.add_totals(acc)
    m = learner.add_totals(acc)
    assert m == {f"early_stop/total_{k}": v for k, v in
                 zip(RUN_TOTALS, (16.0, 8.0, 8.0, 200.0, 40.0), strict=True)}
    back = StopLearner(_cfg(), group_size=8, max_new_tokens=32)
    back.load_state_dict(learner.state_dict())
    assert back.totals == learner.totals and not back.ready

    class Host(StopLearner):
        missing = "host: {key} is not in my file"

    with pytest.raises(ValueError, match="^host: 'ready' is not in my file$"):
        Host(_cfg(), group_size=8, max_new_tokens=32).load_state_dict({"predictor": {}, "history": {}})


def test_dr_grpo_advantages_are_not_divided_by_the_std():
    r = torch.tensor([1.0, 0, 0, 0, 1, 0])
    stop = torch.tensor([0, 0, 1, 1, 0, 0], dtype=torch.bool)
    cfg = CPPOConfig(pruning_rate=0.5, adv_norm="none", early_stop={"enabled": True, "estimator": "finished"})
    res = early_stop_prune(r, stop, torch.zeros(6, dtype=torch.long), cfg)
    # finished rewards 1, 0, 1, 0: mean 0.5, A = r - 0.5 (std sqrt(1/3) would give +-0.866)
    assert res.advantages.tolist() == pytest.approx([0.5, -0.5, 0.0, 0.0, 0.5, -0.5])
    assert res.selection.num_kept == 3  # k = floor(6 * 0.5) of the full group, among the 4 finished


def test_a_group_stopped_whole_under_impute_keeps_nothing_and_loses_nothing():
    q = torch.tensor([0.2, 0.4, 0.6, 0.8])
    mu, sq = imputed_moments(q, (0.0, 1.0))
    res = early_stop_prune(torch.zeros(4), torch.ones(4, dtype=torch.bool), torch.zeros(4, dtype=torch.long), _cfg(),
                           expected=mu, expected_sq=sq)
    assert res.stats.mean.tolist() == pytest.approx([0.5])  # the imputed expectations alone
    assert res.advantages.tolist() == [0.0] * 4
    assert res.selection.kept.tolist() == [] and res.selection.pruned.tolist() == [0, 1, 2, 3]
    assert res.selection.kept_per_group.tolist() == [0]
    assert res.stopped.tolist() == [0, 1, 2, 3] and res.pruned_after.tolist() == []


def test_the_predictor_stops_at_max_iter_with_the_newton_steps_it_took():
    x = torch.tensor([[0.0], [1.0], [2.0], [3.0], [1.5]], dtype=torch.float64)
    y = torch.tensor([0.0, 0.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    one = PrefixPredictor(l2=1.0, max_iter=1).fit(x, y, y)
    # one Newton step from w = (log(n1 / n0), 0) on the standardised column
    z = torch.cat([torch.ones(5, 1, dtype=torch.float64), (x - x.mean(0)) / x.std(0, unbiased=False)], 1)
    w = torch.tensor([math.log(2 / 3), 0.0], dtype=torch.float64)
    p = torch.sigmoid(z @ w)
    pen = torch.tensor([1e-8, 1.0], dtype=torch.float64)
    hess = (z * (p * (1 - p)).unsqueeze(1)).T @ z + torch.diag(pen)
    w1 = w - torch.linalg.solve(hess, z.T @ (p - y) + pen * w)
    assert one.weights.tolist() == pytest.approx(w1.tolist(), abs=1e-12)
    converged = PrefixPredictor(l2=1.0).fit(x, y, y)
    assert float((converged.weights - one.weights).abs().max()) > 1e-3  # one step is not the optimum
    assert one.version == 1 and one.examples == (3, 2)


def test_replay_stops_at_the_first_boundary_where_nothing_runs():
    # boundaries every 3 tokens up to 12: at 3 rows 1-3 still run; at 6 all have ended, so the
    # replay ends there (no features for boundaries 6 and 9)
    lengths = torch.tensor([2, 5, 4, 4])
    lp = torch.log(torch.full((4, 12), 0.5))
    rep = replay_early_stop(None, lp, lengths, torch.ones(4, dtype=torch.bool), torch.tensor([0, 0, 1, 1]),
                            cfg=EarlyStopConfig(enabled=True, segment_tokens=3), group_size=2, keep=1,
                            max_new_tokens=12)
    x, rows = rep.examples
    assert rows.tolist() == [0, 1, 2, 3] and x.shape[0] == 4
    assert rep.stopped.tolist() == [False] * 4 and rep.stopped_at.tolist() == [-1] * 4
    assert bool(rep.q_last.isnan().all())
