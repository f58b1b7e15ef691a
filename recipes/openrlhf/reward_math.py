"""Rule-based reward for GSM8K / MATH, loaded by OpenRLHF from ``--reward.remote_url reward_math.py``.

OpenRLHF calls ``reward_func(queries, prompts, labels)`` inside its rollout workers, so the
reward is on every sample before ``make_experience_batch`` (where CPPO prunes).
Answer: the last ``\\boxed{...}`` in the response, else the last number. Label: a GSM8K
solution (``... #### 72``), a MATH solution (``\\boxed{...}``) or a bare answer. Reward 1.0
when OpenRLHF's ``grade_answer`` accepts it, else 0.0.
"""

import re

import torch
from openrlhf.utils.math_utils import extract_boxed_answer, grade_answer

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _answer(text: str):
    boxed = extract_boxed_answer(text)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def _truth(label: str) -> str:
    if "####" in label:
        return label.split("####")[-1].strip().replace(",", "")
    boxed = extract_boxed_answer(label)
    return boxed if boxed is not None else label.strip()


def reward_func(queries, prompts, labels):
    rewards = []
    for query, prompt, label in zip(queries, prompts, labels):
        response = query[len(prompt):] if query.startswith(prompt) else query
        given = _answer(response)
        rewards.append(1.0 if given is not None and grade_answer(given, _truth(str(label))) else 0.0)
    r = torch.tensor(rewards, dtype=torch.float32)
    return {"rewards": r, "scores": r, "extra_logs": {"accuracy": r}}
