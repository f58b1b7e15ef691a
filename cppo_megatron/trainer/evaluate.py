"""Greedy accuracy on held-out problems."""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..rollout import RolloutEngine, SamplingParams
from ..tasks import Problem, Task


def evaluate(engine: RolloutEngine, tok, task: Task, problems: Sequence[Problem], max_new_tokens: int,
             prompt_template: str = "{question}") -> dict[str, float]:
    """accuracy, format rate and the binomial standard error of the accuracy (evaluation
    noise, to compare against the spread between seeds)."""
    if not problems:
        raise ValueError("evaluate: no problems")
    prompts = [tok.prompt_ids(prompt_template.format(question=p.question)) for p in problems]
    out = engine.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens))
    correct = formatted = 0.0
    for toks, p in zip(out.tokens, problems, strict=True):
        s = task.score(tok.decode(toks), p)
        correct += s.correct
        formatted += s.formatted
    n = len(problems)
    acc = correct / n
    return {
        "eval/accuracy": acc,
        "eval/format_rate": formatted / n,
        "eval/stderr": math.sqrt(max(acc * (1 - acc), 1e-12) / n),
        "eval/problems": float(n),
        "eval/seconds": out.seconds,
    }
