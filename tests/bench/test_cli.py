import json

from cppo_megatron.cli import main


def test_bench_overhead_command_writes_outputs(tmp_path, capsys):
    rc = main(["bench", "overhead", "--sizes", "64,128", "--repeats", "1", "--threads", "1",
               "--step-seconds", "1.5", "--out", str(tmp_path), "--no-plot"])
    assert rc == 0
    data = json.loads((tmp_path / "overhead.json").read_text())
    assert data["benchmark"] == "overhead" and len(data["rows"]) == 2
    assert data["params"]["step_seconds"] == 1.5
    assert (tmp_path / "overhead.md").read_text().startswith("### Overhead")
    assert "wrote" in capsys.readouterr().out


def test_bench_balance_command(tmp_path):
    rc = main(["bench", "balance", "--ranks", "2", "--items-per-rank", "4", "--repeats", "1", "--no-verl",
               "--distributions", "lognormal,equal", "--equal-size", "on", "--out", str(tmp_path), "--no-plot"])
    assert rc == 0
    rows = json.loads((tmp_path / "balance.json").read_text())["rows"]
    assert [(r["distribution"], r["equal_size"]) for r in rows] == [("lognormal", True), ("equal", True)]


def test_simulate_command(tmp_path):
    rc = main(["simulate", "--model", "1.5B", "--dp", "2", "--capacity", "64", "--samples", "1",
               "--rates", "0.5", "--allocation", "false", "--out", str(tmp_path), "--no-plot"])
    assert rc == 0
    data = json.loads((tmp_path / "simulate.json").read_text())
    assert [r["P"] for r in data["rows"]] == [0.0, 0.5]
    assert data["params"]["allocation"] is False and data["params"]["dp"] == 2


def test_bad_arguments_exit_with_a_message(tmp_path, capsys):
    assert main(["bench"]) == 2
    assert "choose a benchmark" in capsys.readouterr().err
    assert main(["simulate", "--model", "3B", "--out", str(tmp_path)]) == 2
    assert "model must be one of" in capsys.readouterr().err
    assert main(["bench", "overhead", "--sizes", "8", "--out", str(tmp_path)]) == 2
    assert "at least one group of 16" in capsys.readouterr().err
