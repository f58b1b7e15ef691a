"""Rewards for veRL runs of our tasks: ``reward.custom_reward_function.path=
pkg://cppo_megatron.integrations.verl.reward`` (``name: compute_score``).

veRL's reward loop calls ``compute_score(data_source, solution_str, ground_truth, extra_info)``
per completion with the decoded response. The score is the embedded trainer's reward for the
same completion: ``correct * w_correct + formatted * w_format`` (+ ``steps * w_step`` for the
worked-arithmetic task; weights from ``reward.custom_reward_function.reward_kwargs`` or the
task's defaults, 1.0, 0.1 and 0.0). The data source names the task (``DATA_SOURCES``); the
worked task grades each step against the question, which its rows carry in
``extra_info.question`` (``data.task_rows``).
"""

from __future__ import annotations

from typing import Any

from ...tasks import Problem, combine_reward
from ...tasks.arithmetic import score_arithmetic
from ...tasks.worked import score_worked

__all__ = ["DATA_SOURCE", "DATA_SOURCES", "SCORERS", "WORKED_DATA_SOURCE", "compute_score", "data_source_for"]

DATA_SOURCE = "cppo_arithmetic"
WORKED_DATA_SOURCE = "cppo_worked_arithmetic"
# task name (tasks.build_task) -> the data_source its veRL rows carry
DATA_SOURCES = {"arithmetic": DATA_SOURCE, "worked_arithmetic": WORKED_DATA_SOURCE}
SCORERS = {DATA_SOURCE: score_arithmetic, WORKED_DATA_SOURCE: score_worked}
NEEDS_QUESTION = {WORKED_DATA_SOURCE}


def data_source_for(task_name: str) -> str:
    """The ``data_source`` of ``task_name``'s veRL rows; ValueError naming the tasks veRL can score."""
    if task_name not in DATA_SOURCES:
        raise ValueError(f"task {task_name!r} has no veRL scorer yet (supported: {', '.join(DATA_SOURCES)})")
    return DATA_SOURCES[task_name]


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None,
                  w_correct: float = 1.0, w_format: float = 0.1, w_step: float = 0.0, **kwargs) -> dict[str, float]:
    """Reward of one decoded completion ``solution_str`` against ``ground_truth``:
    ``{"score": reward, "acc": correct, "formatted": formatted}`` (and ``"steps"`` for the
    worked task). veRL trains on ``score`` and logs the others per data source (validation:
    ``val-core/cppo_arithmetic/acc/mean@1`` is held-out greedy accuracy, the embedded
    trainer's ``eval/accuracy``).

    Raises ValueError for a ``data_source`` this module does not score (naming it), so a
    data file from another task fails loudly instead of training on zeros, and for a worked
    row without ``extra_info.question``.
    """
    scorer = SCORERS.get(str(data_source))
    if scorer is None:
        raise ValueError(
            f"cppo reward: data_source {data_source!r} is not one of {sorted(SCORERS)}; write the data with "
            "`cppo-megatron verl-data` or point reward.custom_reward_function at your own scorer"
        )
    question = str((extra_info or {}).get("question", ""))
    if data_source in NEEDS_QUESTION and not question:
        raise ValueError(f"cppo reward: a {data_source} row needs extra_info.question (its steps are graded against "
                         "it); rewrite the data (delete cppo_cpu.data_dir: the CPU mode writes it again)")
    score = scorer(str(solution_str), Problem(question=question, answer=str(ground_truth)))
    out = {"score": float(combine_reward(score, float(w_correct), float(w_format), float(w_step))),
           "acc": float(score.correct), "formatted": float(score.formatted)}
    if score.steps is not None:
        out["steps"] = float(score.steps)
    return out
