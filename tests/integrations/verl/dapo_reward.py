"""A reward for the DAPO + CPPO CI run whose verdict the test knows in advance: every prompt of
an even dataset row scores 0.5 for every completion (a group with zero reward variance, which
veRL's filter must drop), every odd row scores a hash of the completion's text (8 sampled texts of
a random-init model differ, so the group's rewards vary and it must pass to CPPO). A random-init
model's arithmetic reward is 0 almost everywhere, which would make the filter refill forever.

Besides ``score`` it returns ``acc`` (the field veRL's DAPO scripts filter on,
``algorithm.filter_groups.metric=acc``): 0 for every completion of an even row, another hash of the
text for an odd row. With ``reward_kwargs.equal_scores_every_4th=true`` the rows 1 mod 4 score 0.5
for every completion too while their acc still varies: acc's filter passes them with all rewards
equal, the groups ``cppo/filter_passed_zero_variance`` counts.

veRL loads it by path: ``reward.custom_reward_function.path=<this file>`` (``name: compute_score``).
"""

from __future__ import annotations

import zlib


def compute_score(data_source, solution_str, ground_truth, extra_info=None, equal_scores_every_4th=False,
                  **kwargs):
    index = (extra_info or {}).get("index")
    if not isinstance(index, int):
        raise ValueError(f"dapo_reward: extra_info.index must be the dataset row (an int), got {index!r}")
    if index % 2 == 0:
        return {"score": 0.5, "signal": 0.0, "acc": 0.0}
    text = str(solution_str).encode()
    acc = (zlib.crc32(b"acc|" + text) % 991) / 990
    if equal_scores_every_4th and index % 4 == 1:
        return {"score": 0.5, "signal": 0.0, "acc": acc}
    return {"score": (zlib.crc32(text) % 997) / 996, "signal": 1.0, "acc": acc}
