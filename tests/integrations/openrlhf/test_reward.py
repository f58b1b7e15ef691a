"""The recipes' rule-based reward, with OpenRLHF's own answer grading."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.openrlhf
REWARD = Path(__file__).resolve().parents[3] / "recipes" / "openrlhf" / "reward_math.py"


def test_reward_func_grades_gsm8k_and_math_answers(gpu_only_stubs):
    spec = importlib.util.spec_from_file_location("reward_math", REWARD)  # as OpenRLHF loads it
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    prompts = ["Q1: 3 apples + 4 apples?", "Q2: half of 1/2?", "Q3", "Q4"]
    queries = [
        prompts[0] + " 3 + 4 = 7, so the answer is 7.",
        prompts[1] + " It is \\boxed{\\frac{1}{4}}.",
        prompts[2] + " I think 1,234 but maybe 12",
        prompts[3] + " no number here",
    ]
    labels = ["3 + 4 = 7\n#### 7", "Half of a half is $\\boxed{\\frac14}$.", "#### 1,234", "#### 5"]
    out = module.reward_func(queries, prompts, labels)
    assert out["rewards"].tolist() == [1.0, 1.0, 0.0, 0.0]  # Q3: the last number (12) is the answer
    assert out["scores"].tolist() == out["rewards"].tolist()
