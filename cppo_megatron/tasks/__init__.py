"""Verifiable tasks and their rewards.

``build_task(cfg)`` with ``cfg.name`` one of: ``arithmetic``, ``worked_arithmetic`` (built in), ``gsm8k`` /
``math`` (local jsonl/parquet files, ``cfg.path``), ``reasoning_gym:<dataset>``
(e.g. ``reasoning_gym:gsm_symbolic``, extra ``data``).
"""

from __future__ import annotations

from typing import Any

from .answers import answers_match, extract_answer, normalize_number
from .arithmetic import make_arithmetic_task, score_arithmetic
from .base import Problem, Score, Task, combine_reward
from .files import file_task, load_gsm8k, load_math, score_math
from .worked import check_worked, first_divergence, make_worked_task, score_worked, worked_solution

TASK_NAMES = ("arithmetic", "worked_arithmetic", "gsm8k", "math", "reasoning_gym:<dataset>")


def build_task(cfg: Any) -> Task:
    name = cfg.name
    if name == "arithmetic":
        a = cfg.arithmetic
        return make_arithmetic_task(
            train_size=cfg.train_size,
            test_size=cfg.test_size,
            min_operand=a.min_operand,
            max_operand=a.max_operand,
            ops=a.ops,
            terms=a.terms,
            seed=cfg.seed,
        )
    if name == "worked_arithmetic":
        w = cfg.worked
        return make_worked_task(train_size=cfg.train_size, test_size=cfg.test_size, min_terms=w.min_terms,
                                max_terms=w.max_terms, min_digits=w.min_digits, max_digits=w.max_digits,
                                seed=cfg.seed)
    if name in ("gsm8k", "math"):
        if not cfg.path:
            raise ValueError(f"task.name={name} needs task.path (a .jsonl or .parquet file)")
        return file_task(name, cfg.path, test_path=cfg.test_path, test_size=cfg.test_size, seed=cfg.seed)
    if name.startswith("reasoning_gym:"):
        from .gym import gym_task

        return gym_task(name.split(":", 1)[1], train_size=cfg.train_size, test_size=cfg.test_size, seed=cfg.seed)
    raise ValueError(f"unknown task.name {name!r}; choose from {', '.join(TASK_NAMES)}")


__all__ = [
    "Problem",
    "Score",
    "TASK_NAMES",
    "Task",
    "answers_match",
    "build_task",
    "check_worked",
    "combine_reward",
    "extract_answer",
    "file_task",
    "first_divergence",
    "load_gsm8k",
    "load_math",
    "make_arithmetic_task",
    "make_worked_task",
    "normalize_number",
    "score_arithmetic",
    "score_math",
    "score_worked",
    "worked_solution",
]
