import argparse
import json

from cppo_megatron.bench import rollout as bench


def _args(*argv):
    parser = argparse.ArgumentParser()
    bench.configure(parser)
    return parser.parse_args(list(argv))


def test_hf_rollout_benchmark_reports_real_throughput(tmp_path, capsys):
    out = tmp_path / "rows.json"
    args = _args("--models", "tiny", "--engines", "hf", "--repeats", "1", "--prompts", "3", "--group", "2",
                 "--new-tokens", "3", "--json", str(out))
    assert bench.run(args) == 0
    assert "| tiny | 1.1M | hf | 3x2, <= 3 new" in capsys.readouterr().out
    (row,) = json.loads(out.read_text())["rows"]
    assert 6 <= row["tokens"] <= 18  # 6 completions of 1-3 tokens
    assert row["tokens_per_s"] == row["tokens"] / row["seconds"] > 0


def test_bad_arguments_are_named(capsys):
    assert bench.run(_args("--engines", "tgi")) == 2
    assert "--engines takes hf and/or vllm, got 'tgi'" in capsys.readouterr().err
    assert bench.run(_args("--models", "gpt5", "--engines", "hf")) == 2
    assert "unknown benchmark model 'gpt5'" in capsys.readouterr().err
