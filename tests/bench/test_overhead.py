import json

import pytest

from cppo_megatron.bench.overhead import PHASES, OverheadSettings, load_step_seconds, run_overhead


def test_overhead_rows_on_tiny_sizes():
    rep = run_overhead(OverheadSettings(sizes=[64, 320], repeats=2, threads=[1], step_seconds=2.0), log=lambda *_: None)
    assert [r["completions"] for r in rep.rows] == [64, 320]
    for r in rep.rows:
        assert r["threads"] == 1
        # G=16, P=0.875, group scope: 2 of every 16 survive
        assert r["kept"] == r["completions"] // 8
        assert all(r[f"{ph}_ms"] >= 0 for ph in PHASES)
        assert r["total_ms"] >= max(r[f"{ph}_ms"] for ph in PHASES)
        assert r["share_of_step"] == pytest.approx(r["total_ms"] / 1e3 / 2.0)
        assert r["balance_imbalance"] >= 1.0
    json.dumps(rep.to_json())  # serialisable


def test_overhead_without_step_time_says_what_is_needed():
    rep = run_overhead(OverheadSettings(sizes=[32], repeats=1, threads=[0]), log=lambda *_: None)
    assert rep.rows[0]["share_of_step"] is None
    assert any("--step-seconds" in n for n in rep.notes)


def test_load_step_seconds(tmp_path):
    assert load_step_seconds("1.25") == 1.25
    f = tmp_path / "run.json"
    f.write_text(json.dumps({"step_seconds": 0.5, "other": 1}))
    assert load_step_seconds(str(f)) == 0.5
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="no top-level 'step_seconds'"):
        load_step_seconds(str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match="must be a number or a JSON file"):
        load_step_seconds("nope")
    with pytest.raises(ValueError, match="must be > 0"):
        load_step_seconds("0")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"sizes": [0]}, "sizes must be positive integers"),
        ({"sizes": [8]}, "at least one group of 16"),
        ({"repeats": 0}, "repeats must be an integer >= 1"),
        ({"threads": [-1]}, "threads must be integers >= 0"),
        ({"pruning_rate": 1.5}, "pruning_rate"),
    ],
)
def test_overhead_settings_validate(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OverheadSettings(**kwargs).validate()
