import math
from fractions import Fraction

import pytest
import torch

from cppo_megatron import CPPOConfig
from cppo_megatron.core import AllocationPlanner, PromptSampler, prune

planner_rate = 0.6  # 1/(1-P) = 2.5 and G(1-P) = 6.4: neither is an integer


def _run(planner, sampler, steps, G, seed, seen):
    """Simulate steps: draw, reward, prune, record. Returns per-step drawn counts."""
    counts = []
    for _ in range(steps):
        n = planner.begin_step()
        ids = sampler.draw(n)
        planner.record_round(n, n * G)
        gen = torch.Generator().manual_seed(seed + planner.totals.steps)
        rewards = (torch.rand(n * G, generator=gen) < 0.3).float()
        # groups are numbered by position in the draw: a prompt may recur in a later epoch
        local = torch.arange(n).repeat_interleave(G)
        res = prune(rewards, local, CPPOConfig(pruning_rate=planner_rate))
        planner.end_step(res.selection)
        seen.extend(ids)
        counts.append(n)
    return counts


def test_accounting_over_1000_steps_with_non_integer_ratio():
    G, capacity = 16, 64
    planner = AllocationPlanner(capacity, G, pruning_rate=planner_rate)
    k = planner.keep  # floor(16 * 0.4) = 6
    assert k == 6
    sampler = PromptSampler(1000, seed=5)
    seen = []
    counts = _run(planner, sampler, 1000, G, 0, seen)
    t = planner.totals
    expected = math.floor(Fraction(1000 * capacity, k))
    assert t.prompts_drawn == expected == sum(counts) == len(seen)
    assert set(counts) == {10, 11}  # 64/6 = 10.67 per step, carried exactly
    assert t.prompts_drawn == t.prompts_trained + t.prompts_fully_pruned + t.prompts_dropped
    assert t.completions_generated == t.completions_kept + t.completions_pruned + t.completions_dropped
    assert t.completions_generated == G * t.prompts_drawn
    # no prompt lost or duplicated: each epoch is a permutation
    for e in range(len(seen) // 1000):
        assert sorted(seen[e * 1000 : (e + 1) * 1000]) == list(range(1000))


def test_resume_from_state_dict_matches_uninterrupted_run():
    G, capacity = 16, 64
    full_p, full_s, full_seen = AllocationPlanner(capacity, G, pruning_rate=planner_rate), PromptSampler(333, seed=1), []
    _run(full_p, full_s, 200, G, 0, full_seen)

    p1, s1, seen = AllocationPlanner(capacity, G, pruning_rate=planner_rate), PromptSampler(333, seed=1), []
    _run(p1, s1, 77, G, 0, seen)
    state = {"planner": p1.state_dict(), "sampler": s1.state_dict()}
    p2, s2 = AllocationPlanner(capacity, G, pruning_rate=planner_rate), PromptSampler(333, seed=1)
    p2.load_state_dict(state["planner"])
    s2.load_state_dict(state["sampler"])
    _run(p2, s2, 123, G, 0, seen)
    assert seen == full_seen
    assert p2.totals == full_p.totals


def test_without_allocation_draws_capacity_over_g():
    p = AllocationPlanner(64, 16, pruning_rate=0.875, allocation=False)
    assert p.begin_step() == 4
    p2 = AllocationPlanner(64, 16, pruning_rate=0.875, allocation=True)
    assert p2.begin_step() == 32  # 64 / 2 survivors per prompt


def test_batch_scope_survivors_per_prompt_is_fractional():
    p = AllocationPlanner(100, 16, pruning_rate=0.6, scope="batch")
    assert p.survivors_per_prompt == Fraction(32, 5)
    draws = []
    for _ in range(5):
        draws.append(p.begin_step())
        p._open = None  # simulate without selections
    assert sum(draws) == math.floor(5 * 100 / 6.4)


def test_dynamic_sampling_refill_rounds_and_dropped_accounting():
    G = 4
    p = AllocationPlanner(8, G, keep_per_group=2, dynamic_sampling=True, max_refill_rounds=2)
    target = p.begin_step()
    assert target == 4
    p.record_round(4, 16)
    assert p.next_refill(valid_prompts=1) == 3
    p.record_round(3, 12)
    assert p.next_refill(valid_prompts=3) == 1
    p.record_round(1, 4)
    assert p.next_refill(valid_prompts=3) == 0  # max rounds reached
    # 8 prompts drawn, 3 valid, 5 dropped
    r = torch.tensor([1.0, 0, 0, 1] * 3)
    res = prune(r, torch.arange(3).repeat_interleave(4), CPPOConfig(keep_per_group=2))
    stats = p.end_step(res.selection, dropped_prompts=5, dropped_completions=20)
    assert p.totals.prompts_dropped == 5 and p.totals.prompts_trained == 3
    assert stats["alloc/refill_rounds"] == 2.0


def test_accounting_mismatch_is_an_error():
    p = AllocationPlanner(8, 4, keep_per_group=2)
    n = p.begin_step()
    p.record_round(n, n * 4)
    res = prune(torch.rand(8), torch.arange(2).repeat_interleave(4), CPPOConfig(keep_per_group=2))
    with pytest.raises(ValueError, match="prompt accounting"):
        p.end_step(res.selection)


def test_bad_planner_arguments():
    with pytest.raises(ValueError, match="capacity"):
        AllocationPlanner(0, 16)
    with pytest.raises(ValueError, match="keep_per_group=20 is larger"):
        AllocationPlanner(64, 16, keep_per_group=20)
    with pytest.raises(ValueError, match="pruning_rate"):
        AllocationPlanner(64, 16, pruning_rate=1.0)
    p = AllocationPlanner(64, 16)
    with pytest.raises(RuntimeError, match="begin_step"):
        p.record_round(1, 1)
    q = AllocationPlanner(64, 8, pruning_rate=0.5)
    with pytest.raises(ValueError, match="pruning rate changed"):
        q.load_state_dict(p.state_dict())


def test_from_config():
    p = AllocationPlanner.from_config(CPPOConfig(pruning_rate=0.875), capacity=16 * 16, group_size=16)
    assert p.begin_step() == 128
