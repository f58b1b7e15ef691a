"""Built-in arithmetic task: seeded problems like ``47+85=`` with an exact answer.

Difficulty knobs: operand range, operators, number of terms. Train and test sets are
disjoint (a problem's text decides its split), so held-out accuracy measures
generalisation, not memorisation.
"""

from __future__ import annotations

import random
import re

from .base import Problem, Score, Task, draw_split

ALPHABET = "0123456789+-*="


def _evaluate(terms: list[int], ops: list[str]) -> int:
    # left to right with * binding tighter, as Python does
    expr = str(terms[0]) + "".join(f"{o}{t}" for o, t in zip(ops, terms[1:], strict=True))
    return int(eval(expr, {"__builtins__": {}}, {}))  # noqa: S307 - digits and + - * only


def make_arithmetic_task(
    *,
    train_size: int = 20000,
    test_size: int = 1000,
    min_operand: int = 10,
    max_operand: int = 99,
    ops: str = "+-",
    terms: int = 2,
    seed: int = 0,
) -> Task:
    if not (0 <= min_operand <= max_operand):
        raise ValueError(f"arithmetic: need 0 <= min_operand <= max_operand, got {min_operand}, {max_operand}")
    if not ops or set(ops) - set("+-*"):
        raise ValueError(f"arithmetic: ops must be a non-empty subset of '+-*', got {ops!r}")
    if terms < 2:
        raise ValueError(f"arithmetic: terms must be >= 2, got {terms}")
    span = max_operand - min_operand + 1
    space = span**terms * len(ops) ** (terms - 1)
    # hash split sized so that the problems we will draw hold ~1.5x test_size test-side ones
    test_fraction = min(0.5, 1.5 * test_size / min(space, train_size + test_size))
    if space < train_size + test_size:
        raise ValueError(
            f"arithmetic: only {space} distinct problems for train_size={train_size} + test_size={test_size}; "
            "widen the operand range or lower the sizes"
        )

    def draw(rng: random.Random) -> tuple[str, Problem]:
        t = [rng.randint(min_operand, max_operand) for _ in range(terms)]
        o = [rng.choice(ops) for _ in range(terms - 1)]
        text = str(t[0]) + "".join(f"{a}{b}" for a, b in zip(o, t[1:], strict=True)) + "="
        return text, Problem(text, str(_evaluate(t, o)))

    train, test = draw_split(seed, train_size, test_size, test_fraction, draw,
                             exhausted="arithmetic: could not draw enough distinct problems; widen the ranges")
    return Task(
        name="arithmetic",
        train=train,
        test=test,
        scorer=score_arithmetic,
        sft_target=lambda p: p.answer,
        alphabet=ALPHABET,
        description=f"{terms} terms in [{min_operand}, {max_operand}], ops {ops!r}",
    )


_WELL_FORMED = re.compile(r"-?\d+")


def score_arithmetic(completion: str, problem: Problem) -> Score:
    """Exact integer answer; formatted when the completion is just an integer."""
    text = completion.strip()
    formatted = 1.0 if _WELL_FORMED.fullmatch(text) else 0.0
    return Score(correct=1.0 if formatted and int(text) == int(problem.answer) else 0.0, formatted=formatted)
