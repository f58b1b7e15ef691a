import json

import numpy as np
import pytest

from cppo_megatron.bench.balancing import DISTRIBUTIONS, BalanceSettings, run_balance, sample_lengths, verl_partitioner


def test_sample_lengths_shapes_and_errors():
    for name in DISTRIBUTIONS:
        x = sample_lengths(name, 100, 0)
        assert x.shape == (100,) and x.dtype == np.int64 and x.min() >= 1
        assert np.array_equal(x, sample_lengths(name, 100, 0))  # seeded
    assert set(sample_lengths("equal", 10, 3).tolist()) == {1024}
    with pytest.raises(ValueError, match="distribution must be one of"):
        sample_lengths("zipf", 10, 0)


def test_balance_bench_rows_without_verl():
    rep = run_balance(BalanceSettings(ranks=[2, 4], items_per_rank=4, repeats=1, compare_verl=False), log=lambda *_: None)
    assert len(rep.rows) == len(DISTRIBUTIONS) * 2 * 2
    for r in rep.rows:
        assert r["items"] == 4 * r["ranks"]
        assert r["verl_imbalance"] is None
        assert 1.0 <= r["lower_bound_imbalance"] <= r["ours_imbalance"] * (1 + 1e-12)
        assert r["ours_imbalance"] <= r["naive_imbalance"] * (1 + 1e-12)
        assert r["ours_gap"] >= -1e-12
    assert any("no comparison" in n for n in rep.notes)
    json.dumps(rep.to_json())


@pytest.mark.verl
def test_balance_bench_against_verl_on_small_inputs():
    if verl_partitioner() is None:
        pytest.skip("veRL not installed")
    rep = run_balance(BalanceSettings(ranks=[2, 8], items_per_rank=8, repeats=1), log=lambda *_: None)
    for r in rep.rows:
        assert r["verl_imbalance"] is not None and r["verl_ms"] > 0
        # the target of the benchmark, on inputs small enough to check in CI
        assert r["ours_imbalance"] <= r["verl_imbalance"] * (1 + 1e-12), r
    assert any("ours at or below veRL's imbalance on 16/16" in n for n in rep.notes)


def test_balance_settings_validate():
    with pytest.raises(ValueError, match="distribution must be one of"):
        BalanceSettings(distributions=["x"]).validate()
    with pytest.raises(ValueError, match="ranks must be integers >= 1"):
        BalanceSettings(ranks=[0]).validate()


def test_balance_plot_draws_gaps_and_times_per_input_on_log_axes():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rep = run_balance(BalanceSettings(distributions=["uniform"], ranks=[2], items_per_rank=4, repeats=1,
                                      compare_verl=False), log=lambda *_: None)
    fig = plt.figure()
    rep.plot(fig)
    gaps, times = fig.axes
    assert gaps.get_yscale() == times.get_yscale() == "log"
    assert [t.get_text() for t in gaps.get_legend().get_texts()] == ["ours", "naive"]  # no veRL: not drawn
    assert [t.get_text() for t in times.get_legend().get_texts()] == ["ours"]
    assert [t.get_text() for t in gaps.get_xticklabels()] == ["unif k2", "unif k2="]
    assert gaps.get_ylabel() == "gap to lower bound (max/bound - 1)" and times.get_title() == "time"
    plt.close(fig)
