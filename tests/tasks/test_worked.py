"""The worked-arithmetic task (cppo_megatron/tasks/worked.py): the generator, the reference
solution and the scorer, pinned by value."""

import random
import statistics

import pytest

from cppo_megatron.tasks import Problem, Score, build_task, combine_reward
from cppo_megatron.tasks.worked import (
    ALPHABET,
    check_worked,
    first_divergence,
    make_worked_task,
    parse_question,
    score_worked,
    worked_solution,
    worked_steps,
)
from cppo_megatron.trainer.config import load_recipe
from cppo_megatron.trainer.tokenizer import CharTokenizer

P = Problem("47+8-25+63=", "93")
REF = "47+8=55\n55-25=30\n30+63=93\n<answer>93</answer>"


def test_generator_is_pinned_by_seed():
    t = make_worked_task(train_size=40, test_size=10, seed=7)
    assert [p.question for p in t.train[:6]] == ['29+60+93-16=', '9+1=', '17+83+84-60-16+38=',
                                                 '36+73-97+78-64+50=', '3-1+9=', '67+46-87+19=']
    assert [p.answer for p in t.train[:6]] == ["166", "10", "146", "76", "11", "45"]
    assert [p.meta["level"] for p in t.train[:6]] == [(4, 2), (2, 1), (6, 2), (6, 2), (3, 1), (4, 2)]
    assert [p.question for p in t.test[:3]] == ['17+74+37+14+21-65=', '1+9-4+8+2+1=', '86+73+84-68=']
    assert t.train[0].meta["steps"] == [89, 182, 166] and t.train[0].meta["ops"] == ["+", "+", "-"]
    again = make_worked_task(train_size=40, test_size=10, seed=7)
    assert [p.question for p in again.train] == [p.question for p in t.train]
    other = make_worked_task(train_size=40, test_size=10, seed=8)
    assert [p.question for p in other.train] != [p.question for p in t.train]
    fixed = make_worked_task(train_size=40, test_size=10, seed=7, min_terms=3, max_terms=3, min_digits=2, max_digits=2)
    assert [p.question for p in fixed.train[:3]] == ['29+60+93=', '56+84+17=', '17+82+25=']


def test_generator_keeps_its_ranges_and_splits():
    t = make_worked_task(train_size=3000, test_size=300, seed=0)
    assert len(t.train) == 3000 and len(t.test) == 300
    assert not {p.question for p in t.train} & {p.question for p in t.test}
    assert len({p.question for p in t.train}) == 3000
    levels = {p.meta["level"] for p in t.train}
    assert levels == {(k, d) for k in range(2, 7) for d in (1, 2)}
    for p in list(t.train) + list(t.test):
        terms, ops = parse_question(p.question)
        k, d = p.meta["level"]
        assert len(terms) == k and p.meta["terms"] == terms and p.meta["ops"] == ops
        lo = 0 if d == 1 else 10 ** (d - 1)
        assert all(lo <= x < 10**d for x in terms)
        assert p.meta["steps"] == worked_steps(terms, ops) and min(p.meta["steps"]) >= 0  # never below 0
        assert int(p.answer) == eval(p.question[:-1])  # noqa: S307 - digits, + and - only
    lengths = [len(worked_solution(p)) + 1 for p in t.train]  # + EOS: the tokens a rollout writes
    assert statistics.median(lengths) >= 40 and max(lengths) <= 76
    assert t.alphabet == ALPHABET and t.name == "worked_arithmetic"
    CharTokenizer(ALPHABET).encode(worked_solution(t.train[0]))  # every character is in the alphabet


@pytest.mark.parametrize("kwargs, match", [
    (dict(min_terms=1), "2 <= min_terms <= max_terms"),
    (dict(min_terms=4, max_terms=3), "2 <= min_terms <= max_terms"),
    (dict(min_digits=0), "1 <= min_digits <= max_digits <= 6"),
    (dict(max_digits=7), "1 <= min_digits <= max_digits <= 6"),
    (dict(train_size=0), "train_size must be an integer >= 1, got 0"),
    (dict(test_size=2.5), "test_size must be an integer >= 1, got 2.5"),
    (dict(max_terms=2, max_digits=1, train_size=100), "about 200 distinct problems for train_size=100"),
])
def test_generator_refuses_bad_ranges(kwargs, match):
    args = dict(train_size=100, test_size=10) | kwargs
    with pytest.raises(ValueError, match=match):
        make_worked_task(**args)


def test_generator_gives_up_when_draws_repeat():
    # 2 terms of 1 digit: 155 distinct questions (a "-" larger than the total is drawn as "+"),
    # about half on the test side of the split: 99 test problems cannot be found
    with pytest.raises(ValueError, match="could not draw enough distinct problems"):
        make_worked_task(train_size=1, test_size=99, max_terms=2, max_digits=1)


def test_reference_solution_and_parse():
    assert worked_solution(P) == REF
    assert parse_question("Solve: 47+8-25+63=") == ([47, 8, 25, 63], ["+", "-", "+"])  # a template around it
    assert worked_steps([47, 8, 25, 63], ["+", "-", "+"]) == [55, 30, 93]
    with pytest.raises(ValueError, match="no question like"):
        parse_question("what is 7?")
    with pytest.raises(ValueError, match="3 terms need 2 operators"):
        worked_steps([1, 2, 3], ["+"])


@pytest.mark.parametrize("completion, want", [
    # completion -> (steps_correct, first_slip, answer, formatted, correct)
    (REF, (3, None, 93, True, True)),
    (REF + "\n", (3, None, 93, True, True)),  # surrounding whitespace is not a format error
    # an off-by-one in the first intermediate, carried through: every later line differs too
    ("47+8=56\n56-25=31\n31+63=94\n<answer>94</answer>", (0, 0, 94, True, False)),
    # the slip in the middle step only
    ("47+8=55\n55-25=31\n31+63=94\n<answer>94</answer>", (1, 1, 94, True, False)),
    # the last step wrong, but the answer tag right (copied from nowhere): correct, one slip
    ("47+8=55\n55-25=30\n30+63=92\n<answer>93</answer>", (2, 2, 93, True, True)),
    # a miscopied running total is a slip even when that line's sum is right
    ("47+8=55\n54-25=29\n29+63=92\n<answer>92</answer>", (1, 1, 92, True, False)),
    # a wrong term copied from the question
    ("47+8=55\n55-26=29\n29+63=92\n<answer>92</answer>", (1, 1, 92, True, False)),
    # skipping the steps: right answer, not the format (no step line)
    ("<answer>93</answer>", (0, None, 93, False, True)),
    # no answer tag: the last line may be unfinished, so it is not graded
    ("47+8=55\n55-25=30\n30+6", (2, None, None, False, False)),
    ("47+8=55\n55-25=30\n30+63=93\n", (3, None, None, False, False)),
    # text after the answer tag, or a broken tag: not formatted, not correct
    ("47+8=55\n55-25=30\n30+63=93\n<answer>93</answer>7", (3, None, None, False, False)),
    ("47+8=55\n55-25=30\n30+63=93\n<answer>93</answ", (3, None, None, False, False)),
    # a line that is not a step: formatted fails, the slip is that line
    ("47+8=55\nhmm\n30+63=93\n<answer>93</answer>", (1, 1, 93, False, True)),
    # more lines than steps: the extra one is a slip
    ("47+8=55\n55-25=30\n30+63=93\n93+0=93\n<answer>93</answer>", (3, 3, 93, True, True)),
    ("", (0, None, None, False, False)),
])
def test_check_worked_by_value(completion, want):
    c = check_worked(completion, P)
    assert (c.steps_correct, c.first_slip, c.answer, c.formatted, c.correct) == want
    assert c.steps == 3


def test_score_worked_and_reward():
    assert score_worked(REF, P) == Score(1.0, 1.0, 1.0)
    s = score_worked("47+8=55\n55-25=31\n31+63=94\n<answer>94</answer>", P)
    assert s == Score(correct=0.0, formatted=1.0, steps=1 / 3)
    assert combine_reward(s, 1.0, 0.1) == pytest.approx(0.1)
    assert combine_reward(s, 1.0, 0.1, 0.3) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="this task grades no steps"):
        combine_reward(Score(1.0, 1.0), 1.0, 0.1, 0.5)
    assert combine_reward(Score(1.0, 1.0), 1.0, 0.1) == pytest.approx(1.1)  # no steps, no weight: as before


def test_first_divergence_finds_the_slip_in_a_prefix():
    assert first_divergence("", P) is None
    assert first_divergence("47+8=5", P) is None
    assert first_divergence(REF, P) is None
    assert first_divergence("47+8=56", P) == 6  # the wrong digit itself
    assert first_divergence("47+8=55\n55-25=3", P) is None
    assert first_divergence("47+8=55\n55-25=31\n31+63=94", P) == 15  # "1" of 31
    assert first_divergence(REF + "\n", P) == len(REF)  # anything past the reference


def test_every_single_character_slip_is_caught():
    """Change any one digit of any step line of a reference solution: the check names that
    line as the first slip and the prefix check the changed character."""
    task = make_worked_task(train_size=200, test_size=20, seed=1)
    rng = random.Random(0)
    for p in task.train[:60]:
        ref = worked_solution(p)
        lines = ref.split("\n")[:-1]
        i = rng.randrange(len(lines))
        pos = rng.choice([j for j, ch in enumerate(lines[i]) if ch.isdigit()])
        bad = lines[i][:pos] + str((int(lines[i][pos]) + 1) % 10) + lines[i][pos + 1:]
        text = "\n".join(lines[:i] + [bad] + lines[i + 1:]) + "\n" + ref.split("\n")[-1]
        c = check_worked(text, p)
        assert c.first_slip == i and c.steps_correct == i, (p.question, text)
        assert first_divergence(text, p) == sum(len(x) + 1 for x in lines[:i]) + pos
        assert check_worked(ref, p).correct and score_worked(ref, p) == Score(1.0, 1.0, 1.0)


def test_build_task_from_a_recipe():
    r = load_recipe(None, ["task.name=worked_arithmetic", "task.train_size=300", "task.test_size=30",
                           "task.worked.min_terms=3", "task.worked.max_terms=4", "task.worked.max_digits=1"])
    t = build_task(r.task)
    assert t.name == "worked_arithmetic" and len(t.train) == 300
    assert {p.meta["level"] for p in t.train} == {(3, 1), (4, 1)}
    assert t.sft_target(P) == REF and t.score(REF, P).steps == 1.0
