"""Rule-based reward for our tasks in OpenRLHF (``reward_func(queries, prompts, labels)``).

OpenRLHF's ``SingleTurnAgentExecutor`` (``utils/agent.py:198``) loads ``reward_func`` from the
``.py`` file named by ``--reward.remote_url`` (``recipes/openrlhf/reward_arithmetic.py``
imports ``reward_func``, ``reward_worked.py`` imports ``reward_func_worked``). It runs in the
rollout worker, so every sample carries its reward when ``make_experience_batch`` starts — where
the CPPO hook prunes.
"""

from __future__ import annotations

import torch

from ...tasks import Problem
from ...tasks.arithmetic import score_arithmetic
from ...tasks.worked import score_worked
from ...trainer.export import EXPORT_SPECIALS

__all__ = ["completion_text", "reward_func", "reward_func_worked"]


def completion_text(query: str, prompt: str) -> str:
    """The completion inside ``query`` (prompt + completion as OpenRLHF decodes it, special
    tokens kept): the part after ``prompt``, cut at the first end-of-sequence token."""
    if not query.startswith(prompt):
        raise ValueError(f"reward: the decoded query {query[:80]!r} does not start with its prompt {prompt[:80]!r}")
    text = query[len(prompt):]
    for special in EXPORT_SPECIALS:
        cut = text.find(special)
        if cut >= 0:
            text = text[:cut]
    return text


def reward_func(queries, prompts, labels):
    """1.0 for an exactly correct integer answer, else 0.0 (``rewards`` = ``scores``)."""
    if not len(queries) == len(prompts) == len(labels):
        raise ValueError(f"reward: {len(queries)} queries, {len(prompts)} prompts, {len(labels)} labels")
    correct = [score_arithmetic(completion_text(q, p), Problem(question="", answer=str(label))).correct
               for q, p, label in zip(queries, prompts, labels, strict=True)]
    r = torch.tensor(correct, dtype=torch.float32)
    return {"rewards": r, "scores": r, "extra_logs": {"accuracy": r}}


def reward_func_worked(queries, prompts, labels):
    """The worked-arithmetic task (``tasks.worked``): 1.0 when the tagged answer is right, else
    0.0 (``rewards`` = ``scores``, so greedy ``eval_*_pass1`` is held-out accuracy). Each step is
    graded against the question, read from the prompt (its last ``a+b-c=`` chain);
    ``extra_logs`` carry ``accuracy``, ``formatted`` and ``steps`` (share of the steps right
    before the first slip)."""
    if not len(queries) == len(prompts) == len(labels):
        raise ValueError(f"reward: {len(queries)} queries, {len(prompts)} prompts, {len(labels)} labels")
    scores = [score_worked(completion_text(q, p), Problem(question=p, answer=str(label)))
              for q, p, label in zip(queries, prompts, labels, strict=True)]
    r = torch.tensor([s.correct for s in scores], dtype=torch.float32)
    logs = {"accuracy": r, "formatted": torch.tensor([s.formatted for s in scores], dtype=torch.float32),
            "steps": torch.tensor([s.steps or 0.0 for s in scores], dtype=torch.float32)}
    return {"rewards": r, "scores": r, "extra_logs": logs}
