"""Built-in worked-arithmetic task: multi-term sums solved one step per line.

A prompt is a chain of ``+``/``-`` terms; the completion writes every intermediate result on
its own line, then the final answer in ``<answer>`` tags::

    prompt      47+8-25+63=
    completion  47+8=55
                55-25=30
                30+63=93
                <answer>93</answer>

The worked solution is the warm-up's target and the only fully correct completion, so a slip
(a wrong intermediate, a miscopied running total or term) is visible in the prefix at the
character where it happens (``first_divergence``), and in the line where it happens
(``check_worked(...).first_slip``). Running totals never go below 0 (a ``-`` whose term
exceeds the running total is drawn as ``+``), so no line has a sign to learn.

Difficulty: each problem draws its number of terms from ``[min_terms, max_terms]`` and its
operand size (digits) from ``[min_digits, max_digits]``, uniformly per cell, so a run holds
problems a small model solves reliably (two 1-digit terms) and problems it cannot (six
2-digit terms: five carries in a row). ``Problem.meta`` carries ``terms``, ``ops``, ``steps``
(the intermediate results) and ``level`` = (terms, digits).

Reward parts (``Score``): ``correct`` (the answer in the tags is the reference),
``formatted`` (the completion is step lines ``a+b=c`` / ``a-b=c`` followed by one
``<answer>integer</answer>`` and nothing else) and ``steps`` (the share of the reference's
steps written correctly before the first slip: the per-step signal).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from .base import Problem, Score, Task, draw_split

__all__ = ["ALPHABET", "TASK_NAME", "WorkedCheck", "check_worked", "first_divergence", "make_worked_task",
           "parse_question", "score_worked", "worked_solution", "worked_steps"]

TASK_NAME = "worked_arithmetic"
ALPHABET = "0123456789+-=\n<>/answer"
OPEN, CLOSE = "<answer>", "</answer>"
_QUESTION = re.compile(r"(\d+(?:[+-]\d+)+)=")
_STEP = re.compile(r"(\d+)([+-])(\d+)=(\d+)")
_ANSWER = re.compile(re.escape(OPEN) + r"(-?\d+)" + re.escape(CLOSE))


def parse_question(question: str) -> tuple[list[int], list[str]]:
    """(terms, ops) of a question like ``'47+8-25+63='`` (the last such chain in the text, so a
    prompt template around it is fine). Raises ValueError naming the text when there is none."""
    found = _QUESTION.findall(question)
    if not found:
        raise ValueError(f"worked arithmetic: no question like '47+8-25=' in {question[-60:]!r}")
    chain = found[-1]
    terms = [int(t) for t in re.findall(r"\d+", chain)]
    ops = re.findall(r"[+-]", chain)
    return terms, ops


def worked_steps(terms: list[int], ops: list[str]) -> list[int]:
    """The running totals after each term from the second on: [k - 1] ints (left to right)."""
    if len(ops) != len(terms) - 1 or len(terms) < 2:
        raise ValueError(f"worked arithmetic: {len(terms)} terms need {len(terms) - 1} operators, got {ops}")
    out, total = [], terms[0]
    for op, t in zip(ops, terms[1:], strict=True):
        total = total + t if op == "+" else total - t
        out.append(total)
    return out


def _lines(terms: list[int], ops: list[str]) -> list[str]:
    steps = worked_steps(terms, ops)
    before = [terms[0], *steps[:-1]]
    return [f"{a}{op}{t}={s}" for a, op, t, s in zip(before, ops, terms[1:], steps, strict=True)]


def worked_solution(problem: Problem) -> str:
    """The reference completion (the warm-up's target): one line per step, then the answer."""
    terms, ops = parse_question(problem.question)
    return "\n".join(_lines(terms, ops)) + f"\n{OPEN}{worked_steps(terms, ops)[-1]}{CLOSE}"


@dataclass(frozen=True)
class WorkedCheck:
    """What a completion got right.

    steps: the reference's number of steps (terms - 1). steps_correct: leading step lines equal
    to the reference's before the first slip. first_slip: index of the first step line (among
    the complete lines before the answer) that differs from the reference's, or None.
    answer: the integer in the answer tags (None without one). formatted / correct: as
    ``Score``.
    """

    steps: int
    steps_correct: int
    first_slip: int | None
    answer: int | None
    formatted: bool
    correct: bool


def check_worked(completion: str, problem: Problem) -> WorkedCheck:
    """Grade ``completion`` against ``problem`` (its question decides the reference)."""
    terms, ops = parse_question(problem.question)
    ref = _lines(terms, ops)
    final = worked_steps(terms, ops)[-1]
    text = completion.lstrip()
    cut = text.find(OPEN)
    lines = (text if cut < 0 else text[:cut]).split("\n")
    # without the answer tag the text after the last newline may be an unfinished line
    complete = [ln.strip() for ln in (lines[:-1] if cut < 0 else lines) if ln.strip()]
    matched = 0
    while matched < len(complete) and matched < len(ref) and complete[matched] == ref[matched]:
        matched += 1
    slip = matched if matched < len(complete) else None
    tail = text[cut:].rstrip() if cut >= 0 else ""
    m = _ANSWER.fullmatch(tail)
    answer = int(m.group(1)) if m else None
    formatted = m is not None and bool(complete) and all(_STEP.fullmatch(ln) for ln in complete)
    return WorkedCheck(steps=len(ref), steps_correct=matched, first_slip=slip, answer=answer,
                       formatted=formatted, correct=answer is not None and answer == final)


def score_worked(completion: str, problem: Problem) -> Score:
    """correct: the tagged answer is the reference's final result; formatted: step lines and
    one answer tag, nothing else; steps: share of the steps right before the first slip."""
    c = check_worked(completion, problem)
    return Score(correct=1.0 if c.correct else 0.0, formatted=1.0 if c.formatted else 0.0,
                 steps=c.steps_correct / c.steps)


def first_divergence(prefix: str, problem: Problem) -> int | None:
    """Character offset in ``prefix`` (a partial or whole completion) of the first character
    that differs from the reference completion, or None while ``prefix`` is still a prefix of
    it. A fully correct completion equals the reference exactly, so a completion that has
    diverged can no longer be fully correct (its answer can still be right by luck)."""
    ref = worked_solution(problem)
    for i, ch in enumerate(prefix):
        if i >= len(ref) or ch != ref[i]:
            return i
    return None


def _draw(rng: random.Random, k: int, d: int) -> tuple[list[int], list[str]]:
    lo, hi = (0 if d == 1 else 10 ** (d - 1)), 10**d - 1
    terms = [rng.randint(lo, hi) for _ in range(k)]
    ops, total = [], terms[0]
    for t in terms[1:]:
        op = rng.choice("+-")
        if op == "-" and t > total:
            op = "+"
        total = total + t if op == "+" else total - t
        ops.append(op)
    return terms, ops


def _check_args(train_size: int, test_size: int, min_terms: int, max_terms: int, min_digits: int,
                max_digits: int) -> None:
    for key, value in (("train_size", train_size), ("test_size", test_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"worked arithmetic: {key} must be an integer >= 1, got {value!r}")
    if not 2 <= min_terms <= max_terms:
        raise ValueError(f"worked arithmetic: need 2 <= min_terms <= max_terms, got {min_terms}, {max_terms}")
    if not 1 <= min_digits <= max_digits <= 6:
        raise ValueError(f"worked arithmetic: need 1 <= min_digits <= max_digits <= 6, got {min_digits}, {max_digits}")


def make_worked_task(*, train_size: int = 20000, test_size: int = 1000, min_terms: int = 2, max_terms: int = 6,
                     min_digits: int = 1, max_digits: int = 2, seed: int = 0) -> Task:
    """Seeded train/test problems over every (terms, digits) cell, disjoint by question text.

    Each problem draws its cell uniformly, then its terms and operators; a question drawn twice
    is kept once. Raises ValueError naming the argument when the cells hold too few distinct
    problems (e.g. only two 1-digit terms) for ``train_size + test_size``."""
    _check_args(train_size, test_size, min_terms, max_terms, min_digits, max_digits)
    cells = [(k, d) for k in range(min_terms, max_terms + 1) for d in range(min_digits, max_digits + 1)]
    # an upper bound on the distinct questions (operand values ^ terms x operator choices)
    space = sum((10**d - (0 if d == 1 else 10 ** (d - 1))) ** k * 2 ** (k - 1) for k, d in cells)
    if space < 2 * (train_size + test_size):
        raise ValueError(f"worked arithmetic: about {space} distinct problems for train_size={train_size} + "
                         f"test_size={test_size}; raise max_terms or max_digits, or lower the sizes")
    test_fraction = min(0.5, 1.5 * test_size / (train_size + test_size))

    def draw(rng: random.Random) -> tuple[str, Problem]:
        k, d = rng.choice(cells)
        terms, ops = _draw(rng, k, d)
        text = str(terms[0]) + "".join(f"{o}{t}" for o, t in zip(ops, terms[1:], strict=True)) + "="
        steps = worked_steps(terms, ops)
        return text, Problem(text, str(steps[-1]), {"terms": terms, "ops": ops, "steps": steps, "level": (k, d)})

    train, test = draw_split(seed, train_size, test_size, test_fraction, draw,
                             exhausted="worked arithmetic: could not draw enough distinct problems; raise max_terms "
                                       "or max_digits, or lower the sizes")
    return Task(
        name=TASK_NAME,
        train=train,
        test=test,
        scorer=score_worked,
        sft_target=worked_solution,
        alphabet=ALPHABET,
        description=f"worked +/- chains: {min_terms}-{max_terms} terms of {min_digits}-{max_digits} digits",
    )
