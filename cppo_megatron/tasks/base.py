"""What a verifiable task is: problems with reference answers, and a reward for a completion."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Problem:
    """One prompt with its reference answer. ``meta`` carries task-specific data (the
    reasoning-gym entry, the source line, ...)."""

    question: str
    answer: str
    meta: dict = field(default_factory=dict, compare=False, hash=False)


@dataclass(frozen=True)
class Score:
    """correct: 1.0 when the extracted answer matches; formatted: 1.0 when the completion
    has the expected answer format (whatever its value); steps: for tasks with worked
    solutions, the share of the reference's steps written correctly before the first slip
    (None where a task has no steps)."""

    correct: float
    formatted: float
    steps: float | None = None


@dataclass
class Task:
    """A named set of train/test problems plus the scorer for completions.

    ``scorer(completion_text, problem) -> Score``; the reward is
    ``w_correct * correct + w_format * formatted`` (weights from the recipe).
    ``alphabet``: the characters a from-scratch character tokenizer needs (None: bytes).
    ``sft_target(problem)``: the completion a supervised warm-up teaches.
    """

    name: str
    train: Sequence[Problem]
    test: Sequence[Problem]
    scorer: Callable[[str, Problem], Score]
    sft_target: Callable[[Problem], str]
    alphabet: str | None = None
    description: str = ""

    def __post_init__(self) -> None:
        if not self.train:
            raise ValueError(f"task {self.name!r} has no training problems")
        if not self.test:
            raise ValueError(f"task {self.name!r} has no test problems")

    def score(self, completion: str, problem: Problem) -> Score:
        return self.scorer(completion, problem)


def combine_reward(score: Score, w_correct: float, w_format: float, w_step: float = 0.0) -> float:
    """``w_correct * correct + w_format * formatted (+ w_step * steps``, for a task that grades
    steps; a ``w_step`` for a task without them is an error, not a silent zero)."""
    reward = w_correct * score.correct + w_format * score.formatted
    if w_step:
        if score.steps is None:
            raise ValueError(f"reward weight for steps is {w_step} but this task grades no steps; set it to 0")
        reward += w_step * score.steps
    return reward


def in_test_split(text: str, test_fraction: float) -> bool:
    """Whether ``text`` falls on the test side of a hash split that puts about ``test_fraction`` of all
    texts there: the same text always falls on the same side, whatever was drawn before it."""
    h = int(hashlib.sha1(text.encode()).hexdigest()[:8], 16)
    return h / 0xFFFFFFFF < test_fraction


def draw_split(seed: int, train_size: int, test_size: int, test_fraction: float,
               draw: Callable[[random.Random], tuple[str, T]], *, exhausted: str) -> tuple[list[T], list[T]]:
    """Draw until ``train_size`` train and ``test_size`` test items, each distinct by its text.

    ``draw(rng)`` -> ``(text, item)`` draws one candidate from the seeded ``random.Random(seed)``;
    a text drawn again is dropped, a new one goes to the side ``in_test_split`` names, or is dropped
    when that side is full. The same arguments give the same lists. After 50 x (train_size +
    test_size) draws it gives up with ``ValueError(exhausted)`` (the task's message and fix).
    """
    if not 0.0 <= test_fraction <= 1.0:
        raise ValueError(f"draw_split: test_fraction={test_fraction} is not in [0, 1]; compute it from the sizes")
    rng = random.Random(seed)
    train: list[T] = []
    test: list[T] = []
    seen: set[str] = set()
    attempts = 0
    while len(train) < train_size or len(test) < test_size:
        attempts += 1
        if attempts > 50 * (train_size + test_size):
            raise ValueError(exhausted)
        text, item = draw(rng)
        if text in seen:
            continue
        seen.add(text)
        side, cap = (test, test_size) if in_test_split(text, test_fraction) else (train, train_size)
        if len(side) < cap:
            side.append(item)
    return train, test
