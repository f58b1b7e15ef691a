import json

import pytest

from cppo_megatron.cli import main
from tests.recipes import REPO


def test_hf_rollout_benchmark_reports_real_throughput(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)  # the workload names recipes/tiny_cpu.yaml relative to a checkout
    assert main(["bench", "rollout", "--models", "tiny", "--engines", "hf", "--repeats", "1", "--prompts", "3",
                 "--group", "2", "--new-tokens", "3", "--out", str(tmp_path), "--no-plot"]) == 0
    assert "| tiny |" in capsys.readouterr().out
    (row,) = json.loads((tmp_path / "rollout.json").read_text())["rows"]
    assert row["engine"] == "hf" and row["workload"].startswith("3x2")
    assert 6 <= row["tokens"] <= 18  # 6 completions of 1-3 tokens
    assert row["tokens_per_s"] == pytest.approx(row["tokens"] / row["seconds"]) and row["tokens_per_s"] > 0


def test_bad_arguments_are_named(capsys):
    assert main(["bench", "rollout", "--engines", "tgi"]) == 2
    assert "--engines takes hf and/or vllm, got 'tgi'" in capsys.readouterr().err
    assert main(["bench", "rollout", "--models", "gpt5", "--engines", "hf"]) == 2
    assert "unknown benchmark model 'gpt5'" in capsys.readouterr().err
