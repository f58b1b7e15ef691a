import json

import pytest

from cppo_megatron.tasks import (
    Problem,
    answers_match,
    extract_answer,
    load_gsm8k,
    load_math,
    make_arithmetic_task,
    score_arithmetic,
    score_math,
)
from cppo_megatron.trainer.config import load_recipe
from cppo_megatron.tasks import build_task


def test_arithmetic_is_seeded_disjoint_and_correct():
    a = make_arithmetic_task(train_size=500, test_size=100, seed=3)
    b = make_arithmetic_task(train_size=500, test_size=100, seed=3)
    assert [p.question for p in a.train] == [p.question for p in b.train]
    assert not {p.question for p in a.train} & {p.question for p in a.test}
    for p in a.train[:50]:
        assert int(p.answer) == eval(p.question[:-1])
    hard = make_arithmetic_task(train_size=200, test_size=50, min_operand=100, max_operand=999, ops="+-*", terms=3)
    assert all(len(p.question.split("=")[0]) >= 11 for p in hard.train)


def test_arithmetic_score():
    p = Problem("12+30=", "42")
    assert score_arithmetic("42", p).correct == 1.0
    assert score_arithmetic("41", p).correct == 0.0 and score_arithmetic("41", p).formatted == 1.0
    assert score_arithmetic("4+2", p).formatted == 0.0
    with pytest.raises(ValueError, match="ops"):
        make_arithmetic_task(ops="/")
    with pytest.raises(ValueError, match="distinct problems"):
        make_arithmetic_task(train_size=100, test_size=10, min_operand=1, max_operand=3)


def test_answer_extraction():
    assert extract_answer("so 3+4 = 7\n#### 7") == ("7", True)
    assert extract_answer("the answer is \\boxed{\\frac{1}{2}}") == ("\\frac{1}{2}", True)
    assert extract_answer("<answer> 1,234 </answer>") == ("1,234", True)
    assert extract_answer("I think 5 then 6") == ("6", False)
    assert answers_match("1,234", "1234") and answers_match("0.50", "0.5") and not answers_match("3", "4")


def test_gsm8k_file_and_malformed_line(tmp_path):
    good = tmp_path / "gsm.jsonl"
    good.write_text(
        json.dumps({"question": "2+2?", "answer": "2 plus 2 is 4\n#### 4"}) + "\n"
        + json.dumps({"question": "1,000+1?", "answer": "#### 1,001"}) + "\n"
    )
    probs = load_gsm8k(good)
    assert [p.answer for p in probs] == ["4", "1001"]
    assert score_math("reasoning... #### 4", probs[0]).correct == 1.0
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "#### 1"}) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        load_gsm8k(bad)
    nofinal = tmp_path / "nofinal.jsonl"
    nofinal.write_text(json.dumps({"question": "q", "answer": "no final"}) + "\n")
    with pytest.raises(ValueError, match=r"nofinal.jsonl:1: GSM8K answer has no '####"):
        load_gsm8k(nofinal)


def test_math_file_parquet_and_verify(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "math.parquet"
    pq.write_table(
        pa.table({"problem": ["half of 1?", "2^3?"], "solution": ["it is \\boxed{\\frac{1}{2}}", "\\boxed{8}"]}), path
    )
    probs = load_math(path)
    assert probs[0].answer == "\\frac{1}{2}"
    assert score_math("\\boxed{8}", probs[1]).correct == 1.0
    pytest.importorskip("math_verify")
    assert score_math("so \\boxed{0.5}", probs[0]).correct == 1.0  # math-verify equivalence
    missing = tmp_path / "m.jsonl"
    missing.write_text(json.dumps({"problem": "x", "solution": "no box"}) + "\n")
    with pytest.raises(ValueError, match=r"m.jsonl:1: no answer"):
        load_math(missing)


def test_reasoning_gym_task():
    pytest.importorskip("reasoning_gym")
    r = load_recipe(None, ["task.name=reasoning_gym:gsm_symbolic", "task.train_size=20", "task.test_size=5"])
    task = build_task(r.task)
    p = task.test[0]
    assert task.score(f"<answer>{p.answer}</answer>", p).correct == 1.0
    assert task.score("<answer>-99999</answer>", p).correct == 0.0
    with pytest.raises(ValueError, match="no usable dataset"):
        build_task(load_recipe(None, ["task.name=reasoning_gym:not_a_dataset"]).task)


def test_unknown_task():
    with pytest.raises(ValueError, match="unknown task.name 'sat'"):
        build_task(load_recipe(None, ["task.name=sat"]).task)


def test_draw_split_keeps_each_text_once_on_its_hash_side_and_gives_up_with_the_tasks_words():
    import random

    from cppo_megatron.tasks.base import draw_split, in_test_split

    def draw(rng: random.Random):
        n = rng.randint(0, 9)  # ten distinct texts: duplicates are certain
        return f"q{n}", n

    train, test = draw_split(3, 3, 4, 0.5, draw, exhausted="never")  # 3 of the ten texts fall on the train side
    assert (train, test) == draw_split(3, 3, 4, 0.5, draw, exhausted="never")  # seeded
    assert sorted(train) == [1, 2, 4] and len(test) == 4 and len(set(train + test)) == 7
    assert all(in_test_split(f"q{n}", 0.5) for n in test) and not any(in_test_split(f"q{n}", 0.5) for n in train)
    with pytest.raises(ValueError, match="^ten texts cannot fill 20$"):
        draw_split(0, 18, 2, 0.5, draw, exhausted="ten texts cannot fill 20")
    with pytest.raises(ValueError, match=r"test_fraction=1.5 is not in \[0, 1\]"):
        draw_split(0, 1, 1, 1.5, draw, exhausted="")
