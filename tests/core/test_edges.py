"""The core's edge values that the behaviour tests did not reach (scripts/coverage_floor.py found
them): empty inputs, unshuffled samplers, refinement that stops at its step budget or moves an
item, a micro-batch count raised until the budget holds, a candidate stream of tensors. Each
pins the value a caller gets."""

from __future__ import annotations

import pytest
import torch

from cppo_megatron.core import (
    AllocationPlanner,
    CPPOConfig,
    ExplorationRates,
    PromptSampler,
    SelectiveHistory,
    balance_partitions,
    fill_batch,
    group_advantages,
    lower_bound,
    pack_micro_batches,
    prune,
    select_completions,
)
from cppo_megatron.core.selective import load_run_state, run_state


def test_group_stats_count_their_groups():
    _, stats = group_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0]), torch.tensor([4, 4, 9, 9, 2]))
    assert stats.num_groups == 3 and stats.group_ids.tolist() == [2, 4, 9]


def test_prune_metrics_add_the_zero_variance_groups():
    out = prune(torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1]), CPPOConfig(pruning_rate=0.5))
    m = out.metrics("x/")
    assert m["x/zero_variance_groups"] == 1.0  # group 1: rewards 1, 1
    assert out.selection.kept_mask().tolist() == [True, False, False, True]  # group 1: the seeded tie-break
    assert out.kept_advantages.tolist() == pytest.approx([0.7071, 0.0], abs=1e-4)


def test_a_planner_without_dynamic_sampling_refills_nothing_and_reports_its_totals():
    planner = AllocationPlanner(8, 4, pruning_rate=0.5, dynamic_sampling=True)
    n = planner.begin_step()
    planner.record_round(n, n * 4)
    assert planner.next_refill(n) == 0  # every drawn prompt valid: nothing to refill
    sel = select_completions(torch.arange(16, dtype=torch.float32), torch.arange(16) // 4,
                             CPPOConfig(pruning_rate=0.5))
    planner.end_step(sel)
    totals = planner.metrics("t/")
    assert totals["t/prompts_drawn"] == 4.0 and totals["t/completions_kept"] == 8.0
    assert totals["t/completions_pruned"] == 8.0 and totals["t/steps"] == 1.0


def test_an_unshuffled_sampler_draws_in_order_and_counts_epochs():
    s = PromptSampler(4, shuffle=False)
    assert s.draw(6) == [0, 1, 2, 3, 0, 1]
    assert s.epoch == 1 and s.epochs_float == 1.5


def test_lower_bound_of_nothing_is_zero():
    assert lower_bound([], 3) == 0.0
    assert balance_partitions([], 3).num_parts == 3


def test_refinement_stops_at_its_step_budget():
    w = [float(100000 // (1 + i % 9973)) for i in range(8200)]  # LPT (N > 8192) + refinement
    loads = [sorted(balance_partitions(w, 3, max_refine_steps=s).loads.tolist()) for s in (0, 1, 2, 4, 9)]
    assert loads == [[317538.0, 318647.0, 318647.0],  # LPT's parts: no step allowed
                     [318092.0, 318093.0, 318647.0],  # each step lowers the largest part or its twin
                     [318093.0, 318369.0, 318370.0],
                     [318232.0, 318300.0, 318300.0],  # within 23 of the bound: no further change helps
                     [318232.0, 318300.0, 318300.0]]
    assert balance_partitions(w, 3, refine=False).method == "lpt"


def test_refinement_moves_an_item_when_a_move_beats_every_swap():
    # LPT's rounds leave parts of 2734 / 2733 / 2733 items; one move of a single item to the
    # lightest part (then swaps) reaches within 23 of the bound
    w = [float(100000 // (1 + i % 9973)) for i in range(8200)]
    part = balance_partitions(w, 3)
    assert part.max_load == 318300.0 and part.lower_bound == pytest.approx(318277.333, abs=1e-3)
    assert sorted(len(p) for p in part.parts) == [2733, 2733, 2734]
    assert sorted(part.loads.tolist()) == [318232.0, 318300.0, 318300.0]
    assert sorted(i for p in part.parts for i in p) == list(range(8200))


def test_micro_batches_are_added_until_each_fits_the_budget():
    # total 30 fits 3 batches of 10 only in sum: 7 + 7 + 7 + 9 cannot split into 3 parts <= 10
    assert pack_micro_batches([7, 7, 7, 9], 10) == [[3], [0], [1], [2]]


def test_a_stream_that_is_already_empty_fills_nothing():
    batch = fill_batch([], 2, SelectiveHistory(), seed=0, step=0, rates=ExplorationRates())
    assert batch.exhausted and batch.drawn.tolist() == [] and batch.kept.tolist() == []


def test_a_stream_of_one_element_tensors_is_read_as_ids():
    batch = fill_batch(iter([torch.tensor(5), torch.tensor(2)]), 2, SelectiveHistory(), seed=0, step=0,
                       rates=ExplorationRates())
    assert batch.kept.tolist() == [5, 2] and not batch.exhausted


def test_an_empty_history_round_trips_and_traces_nothing():
    h = SelectiveHistory()
    steps, outcomes = h.trace(3)
    assert steps.tolist() == [] and outcomes.tolist() == []
    state = run_state(h, ExplorationRates(p_easy=0.25, p_hard=0.5), {"skipped": 4})
    history, rates, totals = load_run_state(state, ["skipped", "drawn"])
    assert history.num_prompts == 0 and history.latest_step == -1
    assert (rates.p_easy, rates.p_hard) == (0.25, 0.5) and totals == {"skipped": 4.0, "drawn": 0.0}
