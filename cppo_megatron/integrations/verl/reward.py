"""Rewards for veRL runs of our tasks: ``reward.custom_reward_function.path=
pkg://cppo_megatron.integrations.verl.reward`` (``name: compute_score``).

veRL's reward loop calls ``compute_score(data_source, solution_str, ground_truth, extra_info)``
per completion with the decoded response. The score is the embedded trainer's reward for the
same completion: ``correct * w_correct + formatted * w_format`` (weights from
``reward.custom_reward_function.reward_kwargs`` or the task's defaults, 1.0 and 0.1).
"""

from __future__ import annotations

from typing import Any

from ...tasks import Problem, combine_reward
from ...tasks.arithmetic import score_arithmetic

__all__ = ["DATA_SOURCE", "SCORERS", "compute_score"]

DATA_SOURCE = "cppo_arithmetic"
SCORERS = {DATA_SOURCE: score_arithmetic}


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None,
                  w_correct: float = 1.0, w_format: float = 0.1, **kwargs) -> dict[str, float]:
    """Reward of one decoded completion ``solution_str`` against ``ground_truth``:
    ``{"score": reward, "acc": correct, "formatted": formatted}``. veRL trains on ``score``
    and logs the others per data source (validation: ``val-core/cppo_arithmetic/acc/mean@1``
    is held-out greedy accuracy, the embedded trainer's ``eval/accuracy``).

    Raises ValueError for a ``data_source`` this module does not score (naming it), so a
    data file from another task fails loudly instead of training on zeros.
    """
    scorer = SCORERS.get(str(data_source))
    if scorer is None:
        raise ValueError(
            f"cppo reward: data_source {data_source!r} is not one of {sorted(SCORERS)}; write the data with "
            "`cppo-megatron verl-data` or point reward.custom_reward_function at your own scorer"
        )
    score = scorer(str(solution_str), Problem(question="", answer=str(ground_truth)))
    return {"score": float(combine_reward(score, float(w_correct), float(w_format))),
            "acc": float(score.correct), "formatted": float(score.formatted)}
