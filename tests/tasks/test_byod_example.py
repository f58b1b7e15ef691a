"""The bring-your-own-data example (docs/trainer.md): `cppo-megatron example-data DIR` writes
GSM8K-format rows that the gsm8k loader reads, and recipes/byod_gsm8k_cpu.yaml passes the
pre-flight data/model fit check with them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cppo_megatron import cli
from cppo_megatron.tasks import load_gsm8k
from cppo_megatron.tasks.word_problems import word_problem_rows
from cppo_megatron.trainer.config import load_recipe
from cppo_megatron.trainer.preflight import check_inputs

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "recipes" / "byod_gsm8k_cpu.yaml")
ROW = re.compile(r"(\d+)([+-])(\d+)=(-?\d+)\n#### (-?\d+)")


def test_rows_are_worked_gsm8k_answers_seeded_and_disjoint():
    train, test = word_problem_rows(train_size=300, test_size=60, seed=5)
    assert len(train) == 300 and len(test) == 60
    assert (train, test) == word_problem_rows(train_size=300, test_size=60, seed=5)
    assert train != word_problem_rows(train_size=300, test_size=60, seed=6)[0]
    questions = [r["question"] for r in train + test]
    assert len(set(questions)) == len(questions)  # no repeats, so none shared by train and test
    for row in train + test:
        assert set(row) == {"question", "answer"}
        a, op, b, result, final = ROW.fullmatch(row["answer"]).groups()
        assert f" {a} " in row["question"] and f" {b}" in row["question"]
        assert int(result) == (int(a) + int(b) if op == "+" else int(a) - int(b)) == int(final) >= 0


def test_command_writes_files_the_gsm8k_loader_reads(tmp_path, capsys):
    out = tmp_path / "data"
    assert cli.main(["example-data", str(out), "--train-size", "200", "--test-size", "40"]) == 0
    assert "wrote 200 rows" in capsys.readouterr().out
    rows = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    problems = load_gsm8k(out / "train.jsonl")
    assert len(problems) == 200 and len(load_gsm8k(out / "test.jsonl")) == 40
    for row, p in zip(rows, problems, strict=True):
        reasoning, final = row["answer"].split("\n#### ")
        assert (p.question, p.answer, p.meta["reasoning"]) == (row["question"], final, reasoning)


def test_a_file_as_out_dir_is_one_line_and_exit_2(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    assert cli.main(["example-data", str(tmp_path / "f")]) == 2
    assert "is a file" in capsys.readouterr().err


def test_the_recipe_fits_the_example_data(tmp_path):
    train, test = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    assert cli.main(["example-data", str(tmp_path)]) == 0  # the documented sizes
    overrides = [f"task.path={train}", f"task.test_path={test}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "cppo_megatron.cli", "train", RECIPE, *overrides, "--print-recipe"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["task"]["path"] == str(train)
    inputs = check_inputs(load_recipe(RECIPE, overrides))
    assert inputs.warnings == ()
    assert (len(inputs.task.train), len(inputs.task.test)) == (4000, 500)
    fit = inputs.fit
    assert (fit.too_long_for_positions, fit.too_long_for_rollout) == (0, 0)
    # the recipe's limits hold the longest row with little to spare (byte tokens: BOS + question
    # + answer + EOS); a larger model.max_position would only slow the CPU run
    assert fit.longest_sequence <= fit.max_position < fit.longest_sequence + 24
    assert fit.longest_answer <= fit.max_new_tokens < fit.longest_answer + 6
    # the default recipe cannot hold these rows: that is why this recipe exists
    with pytest.raises(Exception, match="does not fit the model"):
        check_inputs(load_recipe(str(ROOT / "recipes" / "tiny_cpu.yaml"), ["task.name=gsm8k", *overrides]))
