"""A step's collection and selection where the run tests did not reach (scripts/coverage_floor.py):
rounds that give no prompt or the wrong number of rewards, every group dropped for zero variance,
and keep_mass with nothing to keep. The rollout is a stand-in at the trainer's own boundary
(``collect_groups`` takes any object with ``round``) that returns the rewards each test plants."""

from __future__ import annotations

import pytest
import torch

from cppo_megatron import CPPOConfig
from cppo_megatron.core import AllocationPlanner, PromptSampler
from cppo_megatron.trainer.step import PhaseTimer, RoundRows, collect_groups, score_completions, select_survivors

G = 4


class PlantedRollout:
    """Each prompt's G rewards from ``rewards(prompt_id)``; ``short`` drops the last reward."""

    def __init__(self, rewards, short=False):
        self.rewards, self.short = rewards, short

    def round(self, ids, *, step, round_, timer):
        r = [x for i in ids for x in self.rewards(i)]
        if self.short:
            r = r[:-1]
        n = len(ids) * G
        return RoundRows(rewards=r, correct=[float(x > 0) for x in r], formatted=[1.0] * len(r),
                         prompt_lengths=[3] * n, completion_lengths=[2] * n, truncated=[False] * n, owner=[0] * n,
                         local_start=0, prompts=[[1, 2, 3]] * n, completions=[[4, 5]] * n)


def _collect(rollout, planner, *, dynamic=False, draw=None, cfg=None):
    return collect_groups(rollout, planner, PromptSampler(32, shuffle=False), group_size=G, dynamic_sampling=dynamic,
                          step=3, timer=PhaseTimer(torch.device("cpu")), cppo_cfg=cfg, draw=draw)


def test_scores_need_one_completion_per_prompt_and_sample():
    with pytest.raises(ValueError, match=r"^3 completions for 1 prompts x G=4$"):
        score_completions(None, None, [object()], [[1]] * 3, G, None)


def test_a_round_with_no_prompt_to_generate_is_refused():
    with pytest.raises(RuntimeError, match=r"^round 0 of step 3: no prompt to generate \(asked for 4\)$"):
        _collect(PlantedRollout(lambda i: [0.0, 1.0, 0.0, 1.0]), AllocationPlanner(8, G, pruning_rate=0.5),
                 draw=lambda n: [])


def test_a_round_with_a_reward_missing_is_refused():
    with pytest.raises(RuntimeError, match=r"^rollout round 0: 15 rewards for 4 prompts x G=4$"):
        _collect(PlantedRollout(lambda i: [0.0, 1.0, 0.0, 1.0], short=True), AllocationPlanner(8, G, pruning_rate=0.5))


def test_every_group_dropped_for_zero_variance_says_what_to_raise():
    planner = AllocationPlanner(8, G, pruning_rate=0.5, dynamic_sampling=True, max_refill_rounds=0)
    batch = _collect(PlantedRollout(lambda i: [1.0] * G), planner, dynamic=True)
    assert batch.dropped_prompts == 4 and batch.valid_groups.numel() == 0
    with pytest.raises(RuntimeError, match=r"^every group was dropped for zero reward variance; raise "
                                           r"cppo.max_refill_rounds or disable cppo.dynamic_sampling$"):
        select_survivors(batch, CPPOConfig(pruning_rate=0.5, dynamic_sampling=True), planner, step=3)


def test_keep_mass_with_only_equal_rewards_keeps_nothing_and_says_so():
    cfg = CPPOConfig(keep_mass=0.9, allocation=False)
    planner = AllocationPlanner(8, G, keep_mass=0.9, allocation=False)
    batch = _collect(PlantedRollout(lambda i: [0.5] * G), planner, cfg=cfg)
    with pytest.raises(RuntimeError, match=r"^no completion survived \(every group had equal rewards under "
                                           r"cppo.keep_mass\); enable cppo.allocation"):
        select_survivors(batch, cfg, planner, step=3)
