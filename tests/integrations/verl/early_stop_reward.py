"""A reward for the early-stopping CI run with both outcomes in every step of a random-init model:
a completion succeeds when the crc32 of its text is divisible by 3 (about one in three). The
predictor cannot learn it (nor needs to: the run checks which rows reach which pass, not learning).

veRL loads it by path: ``reward.custom_reward_function.path=<this file>`` (``name: compute_score``).
"""

from __future__ import annotations

import zlib


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return float(zlib.crc32(str(solution_str).encode()) % 3 == 0)
