import pytest

from cppo_megatron.bench import fraction_of_bound, speedup, speedup_bound


@pytest.mark.parametrize(
    "p, t_gen, t_rest, expected",
    [
        (0.0, 1.0, 3.0, 1.0),  # no pruning, no speedup
        (0.5, 1.0, 3.0, 4.0 / 2.5),  # (1 + 3) / (1 + 0.5 * 3)
        (0.875, 1.0, 3.0, 4.0 / 1.375),
        (0.75, 0.0, 2.0, 4.0),  # nothing but prunable work: 1 / (1 - P)
        (0.9375, 5.0, 0.0, 1.0),  # nothing prunable: no speedup at any rate
        (0.875, 0.15, 0.35, 0.5 / (0.15 + 0.125 * 0.35)),  # 0.5 / 0.19375 = 2.58x
    ],
)
def test_speedup_bound_hand_computed(p, t_gen, t_rest, expected):
    assert speedup_bound(p, t_gen, t_rest) == pytest.approx(expected, rel=1e-12)


def test_bound_grows_with_rate_and_prunable_share():
    rates = [0.0, 0.5, 0.75, 0.875, 0.9375]
    values = [speedup_bound(p, 1.0, 1.0) for p in rates]
    assert values == sorted(values) and values[-1] < 2.0  # capped by (g + r) / g = 2
    assert speedup_bound(0.5, 1.0, 9.0) > speedup_bound(0.5, 1.0, 1.0)


def test_speedup_and_fraction():
    assert speedup(10.0, 4.0) == 2.5
    assert fraction_of_bound(2.0, 2.5) == pytest.approx(0.8)


@pytest.mark.parametrize(
    "args, message",
    [
        ((1.0, 1.0, 1.0), r"pruning_rate must be in \[0, 1\), got 1.0"),
        ((-0.1, 1.0, 1.0), "pruning_rate must be >= 0.0, got -0.1"),
        ((0.5, -1.0, 1.0), "t_gen must be >= 0.0, got -1.0"),
        ((0.5, 1.0, float("nan")), "t_rest must be a finite number, got nan"),
        ((0.5, 0.0, 0.0), "t_gen \\+ t_rest must be > 0"),
    ],
)
def test_bound_rejects_bad_inputs(args, message):
    with pytest.raises(ValueError, match=message):
        speedup_bound(*args)


def test_speedup_rejects_zero_time_and_fraction_rejects_bound_below_one():
    with pytest.raises(ValueError, match="seconds must be > 0, got 0.0"):
        speedup(1.0, 0.0)
    with pytest.raises(ValueError, match="bound must be >= 1.0, got 0.5"):
        fraction_of_bound(1.0, 0.5)
