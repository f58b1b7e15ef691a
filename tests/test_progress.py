"""progress.py: on a non-terminal a bar writes plain lines at an interval, never redraws."""

import io

import pytest

from cppo_megatron.progress import progress


def test_a_log_gets_lines_not_redraws(monkeypatch):
    pytest.importorskip("tqdm")
    monkeypatch.setenv("CPPO_PROGRESS_INTERVAL_S", "3600")  # no interval passes during the test
    out = io.StringIO()
    bar = progress(1000, "RL", file=out)
    for _ in range(1000):
        bar.update(1)
        bar.set_postfix(reward="0.5")
    bar.close()
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert len(lines) == 2  # the start and the final state, not 1000 redraws
    assert lines[0].startswith("RL:") and "0/1000" in lines[0]
    assert "1000/1000" in lines[-1] and "reward=0.5" in lines[-1]


def test_interval_zero_gives_a_line_per_update(monkeypatch):
    pytest.importorskip("tqdm")
    monkeypatch.setenv("CPPO_PROGRESS_INTERVAL_S", "0")
    out = io.StringIO()
    bar = progress(5, "warm-up", file=out)
    for _ in range(5):
        bar.update(1)
    bar.close()
    counts = [ln.split("|")[-1] for ln in out.getvalue().splitlines()]
    assert len(counts) >= 6 and all("\r" not in c for c in counts)


def test_bad_values_are_named(monkeypatch):
    pytest.importorskip("tqdm")
    with pytest.raises(ValueError, match="initial=5, total=3"):
        progress(3, "x", initial=5, file=io.StringIO())
    monkeypatch.setenv("CPPO_PROGRESS_INTERVAL_S", "soon")
    with pytest.raises(ValueError, match="CPPO_PROGRESS_INTERVAL_S='soon'"):
        progress(3, "x", file=io.StringIO())
