"""The run report from records the run tests did not produce (scripts/coverage_floor.py): a warm-up
with its time, a run with no evaluation and no allocation totals, a balance section asked for but
without steps. Each pins the lines report.md gets."""

from __future__ import annotations

import json

from cppo_megatron.trainer.report import write_report


def _write(tmp_path, records, balance=False):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = write_report(tmp_path, "t", plots=False, balance=balance)
    return summary, (tmp_path / "report.md").read_text().splitlines()


def test_a_warmup_with_its_time_and_no_rl_evaluation_or_allocation(tmp_path):
    summary, lines = _write(tmp_path, [{"kind": "warmup", "warmup/accuracy": 0.1},
                                       {"kind": "warmup", "warmup/accuracy": 0.4, "warmup/time": 12.4},
                                       {"kind": "step", "step": 1, "wall": 2.0, "time/step": 2.0}])
    assert lines[2] == "- warm-up (SFT): accuracy 0.100 -> 0.400 in 12 s"
    assert lines[3] == "- RL: 1 steps in 2.0 s"  # no held-out accuracy line, no prompts line
    assert not any(line.startswith(("- held-out", "- prompts drawn")) for line in lines)


def test_a_warmup_without_its_time_and_a_balance_report_with_no_steps(tmp_path):
    summary, lines = _write(tmp_path, [{"kind": "warmup", "warmup/accuracy": 0.2}], balance=True)
    assert lines[2] == "- warm-up (SFT): accuracy 0.200 -> 0.200" and summary["steps"] == 0
    assert "## Rank balance (means over RL steps)" not in lines and "balance/imbalance" not in summary
