"""Every refusal of the core's public functions, by its message: the bad value named, and what to
do where the message says so. Branch coverage found these unreached by the behaviour tests
(scripts/coverage_floor.py); each case here is one input check."""

from __future__ import annotations

import re

import pytest
import torch

from cppo_megatron.core import (
    AllocationPlanner,
    CPPOConfig,
    ExplorationRates,
    OutcomeCounts,
    PromptSampler,
    Selection,
    SelectiveHistory,
    advantages_from_stats,
    balance_partitions,
    clipped_surrogate,
    decide_skips,
    fill_batch,
    group_advantages,
    group_outcomes,
    inclusion_probabilities,
    seeded_generator,
    select_completions,
    step_metrics,
    systematic_sample,
    token_logprobs,
)
from cppo_megatron.core.loss import aggregate_loss, kl_penalty
from cppo_megatron.core.selective import adapt_exploration, load_run_state


class NotATensor:
    """What torch.as_tensor cannot read."""


def _selection(n_kept: int = 2, weights=None) -> Selection:
    kept = torch.arange(n_kept)
    return Selection(kept=kept, pruned=torch.tensor([n_kept]), group_ids=torch.tensor([0]),
                     group_size=torch.tensor([n_kept + 1]), kept_per_group=torch.tensor([n_kept]),
                     advantages=torch.zeros(n_kept + 1), scope="group", metric="smallest", use_abs=True,
                     weights=weights)


def _planner(**kw) -> AllocationPlanner:
    return AllocationPlanner(16, 4, pruning_rate=0.5, **kw)


CASES = [
    # _checks: the shared tensor checks, reached through group_advantages
    ("rewards of an unreadable type", lambda: group_advantages(NotATensor(), [0]),
     ValueError, "rewards must be a 1-D tensor of numbers, got NotATensor"),
    ("bool rewards", lambda: group_advantages(torch.tensor([True, False]), [0, 0]),
     ValueError, "rewards must hold real numbers, got dtype torch.bool"),
    ("complex rewards", lambda: group_advantages(torch.tensor([1 + 1j, 2 + 0j]), [0, 0]),
     ValueError, "rewards must hold real numbers, got dtype torch.complex64"),
    ("group ids of an unreadable type", lambda: group_advantages(torch.zeros(2), NotATensor()),
     ValueError, "group_ids must be a 1-D tensor of integer ids, got NotATensor"),
    ("2-D group ids", lambda: group_advantages(torch.zeros(2), torch.zeros(1, 2, dtype=torch.int64)),
     ValueError, re.escape("group_ids must be 1-D [N], got shape (1, 2)")),
    # advantage
    ("statistics of other lengths", lambda: advantages_from_stats(torch.zeros(2), torch.zeros(2), torch.ones(3)),
     ValueError, re.escape("rewards (2), row_mean (2) and row_std (3) must have the same length")),
    ("an unknown adv_norm", lambda: advantages_from_stats(torch.zeros(1), torch.zeros(1), torch.ones(1),
                                                          adv_norm="mad"),
     ValueError, re.escape("adv_norm must be one of ['std', 'none'], got 'mad'")),
    ("a negative row std", lambda: advantages_from_stats(torch.zeros(2), torch.zeros(2), torch.tensor([1.0, -0.5])),
     ValueError, re.escape("row_std[1] = -0.5 is negative")),
    # allocation
    ("an unknown scope", lambda: AllocationPlanner(16, 4, scope="rank"),
     ValueError, "scope must be 'group' or 'batch', got 'rank'"),
    ("both pruning_rate and keep_per_group", lambda: AllocationPlanner(16, 4, pruning_rate=0.5, keep_per_group=2),
     ValueError, re.escape("set either pruning_rate (0.5) or keep_per_group (2), not both")),
    ("keep_mass out of range", lambda: AllocationPlanner(16, 4, keep_mass=1.5),
     ValueError, re.escape("keep_mass must be a number in (0, 1], got 1.5")),
    ("keep_mass as a bool", lambda: AllocationPlanner(16, 4, keep_mass=True),
     ValueError, re.escape("keep_mass must be a number in (0, 1], got True")),
    ("keep_mass with a pruning rate", lambda: AllocationPlanner(16, 4, keep_mass=0.8, pruning_rate=0.5),
     ValueError, re.escape("keep_mass=0.8 decides the counts itself: unset pruning_rate (0.5)")),
    ("allocation not a bool", lambda: AllocationPlanner(16, 4, allocation="yes"),
     ValueError, "allocation and dynamic_sampling must be booleans, got 'yes', False"),
    ("a capacity below one prompt", lambda: AllocationPlanner(2, 8, pruning_rate=0.0, allocation=False),
     ValueError, "capacity=2 is too small for group_size=8: fewer than one prompt per step"),
    ("a seed that is not an int", lambda: PromptSampler(10, seed="1"),
     ValueError, "seed must be an integer, got '1'"),
    ("a sampler checkpoint of another data set", lambda: PromptSampler(10, seed=1).load_state_dict(
        PromptSampler(12, seed=1).state_dict()),
     ValueError, "sampler checkpoint is for 12 prompts / seed 1, this sampler has 10 / seed 1"),
    # balance
    ("equal_size not a bool", lambda: balance_partitions([1.0, 2.0], 2, equal_size=1),
     ValueError, "equal_size must be true or false, got 1"),
    # loss
    ("a loss input that is not a tensor", lambda: kl_penalty([0.0], torch.zeros(1)),
     ValueError, "logprobs must be a tensor, got list"),
    ("a 1-D loss", lambda: aggregate_loss(torch.zeros(3), torch.ones(3)),
     ValueError, re.escape("loss must be [N, T], got shape (3,)")),
    ("[N] advantages of another N", lambda: clipped_surrogate(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3)),
     ValueError, "advantages has 3 entries for 2 sequences"),
    ("[N, T] advantages of another shape",
     lambda: clipped_surrogate(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 4)),
     ValueError, re.escape("advantages (2, 4) must be [N] or (2, 3)")),
    ("clip_low of 1", lambda: clipped_surrogate(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1), clip_low=1.0),
     ValueError, "clip range must satisfy 0 <= clip_low < 1, clip_high >= 0; got 1.0, 1.0"),
    ("a negative clip_high",
     lambda: clipped_surrogate(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1), clip_high=-0.1),
     ValueError, "clip range must satisfy 0 <= clip_low < 1, clip_high >= 0; got 0.2, -0.1"),
    ("logits and targets of other lengths", lambda: token_logprobs(torch.zeros(2, 3, 5), torch.zeros(2, 4)),
     ValueError, re.escape("got (2, 3, 5) and (2, 4)")),
    # sampling
    ("scores and valid of other shapes",
     lambda: inclusion_probabilities(torch.ones(2, 3), torch.ones(2, 2, dtype=torch.bool), torch.ones(2)),
     ValueError, re.escape("scores (2, 3), valid (2, 2) and k (2,) must be [M, W], [M, W] and [M]")),
    ("negative scores",
     lambda: inclusion_probabilities(torch.tensor([[1.0, -1.0]]), torch.ones(1, 2, dtype=torch.bool),
                                     torch.tensor([1])),
     ValueError, re.escape("scores must be >= 0 (use |A|)")),
    ("a sample too large for the int64 design",
     lambda: systematic_sample(torch.ones(1, 1), torch.ones(1, 1, dtype=torch.bool), torch.tensor([1 << 30]),
                               torch.Generator()),
     ValueError, "sample size k=1073741824 is too large for the int64 design"),
    # selection
    ("a seed that is a bool", lambda: seeded_generator(True),
     ValueError, "seed must be an integer, got True"),
    ("weights not aligned with the survivors", lambda: _selection(2, weights=torch.ones(3)),
     ValueError, re.escape("Selection.weights (3,) must align with kept (2,)")),
    ("statistics of another batch",
     lambda: select_completions(torch.zeros(4), torch.tensor([0, 0, 1, 1]), CPPOConfig(pruning_rate=0.5),
                                stats=group_advantages(torch.zeros(2), torch.tensor([0, 0]))[1]),
     ValueError, "stats describe 2 completions but the batch has 4"),
    ("keep_per_group above a group's size in batch scope",
     lambda: select_completions(torch.zeros(5), torch.tensor([0, 0, 0, 1, 1]),
                                CPPOConfig(keep_per_group=3, scope="batch")),
     ValueError, re.escape("keep_per_group=3 is larger than group 1 (2 completions)")),
    # selective
    ("prompt ids of an unreadable type", lambda: SelectiveHistory().lookup(NotATensor()),
     ValueError, "prompt_ids must be a 1-D tensor of int64 prompt ids"),
    ("flags of an unreadable type",
     lambda: SelectiveHistory().update(torch.tensor([1]), NotATensor(), torch.tensor([False]), step=0),
     ValueError, "zero_variance must be a 1-D bool tensor, got NotATensor"),
    ("2-D flags",
     lambda: SelectiveHistory().update(torch.tensor([1]), torch.tensor([[True]]), torch.tensor([False]), step=0),
     ValueError, re.escape("zero_variance must be 1-D [M] bool, got shape (1, 1)")),
    ("a run state without totals", lambda: load_run_state({"history": {}, "rates": {}}, ["a"]),
     ValueError, re.escape("selective rollout state must have history, rates and totals, got ['history', 'rates']")),
    ("a run state that is not a dict", lambda: load_run_state([1], ["a"]),
     ValueError, "selective rollout state must have history, rates and totals, got list"),
    ("a run state with an unknown counter",
     lambda: load_run_state({"history": SelectiveHistory().state_dict(), "rates": {"p_easy": 0.5, "p_hard": 0.5},
                             "totals": {"skipped": 3.0, "typo": 1.0}}, ["skipped"]),
     ValueError, re.escape("selective rollout state: unknown counter(s) ['typo']; known: ['skipped']")),
    ("adapt_exploration without rates", lambda: adapt_exploration((0.5, 0.5), num_generated=1, num_easy=0,
                                                                  num_hard=0),
     ValueError, "rates must be an ExplorationRates, got tuple"),
    ("decide_skips without a history", lambda: decide_skips({}, torch.tensor([1]), seed=0, step=0,
                                                            rates=ExplorationRates()),
     ValueError, "history must be a SelectiveHistory, got dict"),
    ("fill_batch without a history", lambda: fill_batch([1], 1, None, seed=0, step=0, rates=ExplorationRates()),
     ValueError, "history must be a SelectiveHistory, got NoneType"),
    ("fill_batch without rates", lambda: fill_batch([1], 1, SelectiveHistory(), seed=0, step=0, rates=None),
     ValueError, "rates must be an ExplorationRates, got NoneType"),
    ("a draw function that returns more than asked",
     lambda: fill_batch(lambda n: list(range(n + 1)), 2, SelectiveHistory(), seed=0, step=0,
                        rates=ExplorationRates()),
     ValueError, "the candidate source returned 3 ids when asked for 2"),
    ("outcome flags that are not bool", lambda: OutcomeCounts.from_flags(torch.tensor([1, 0]), torch.tensor([1, 0])),
     ValueError, re.escape("zero_variance must be a 1-D bool tensor [M], got shape (2,) dtype torch.int64")),
    ("outcome flags of other lengths",
     lambda: OutcomeCounts.from_flags(torch.tensor([True, False]), torch.tensor([True])),
     ValueError, "easy has 1 entries but zero_variance has 2: one per group"),
    ("step_metrics without rates", lambda: step_metrics([], {"p_easy": 1}, OutcomeCounts(0, 0, 0)),
     ValueError, "rates must be an ExplorationRates, got dict"),
    ("step_metrics with a prefix that is not a str",
     lambda: step_metrics([], ExplorationRates(), OutcomeCounts(0, 0, 0), prefix=1),
     ValueError, "prefix must be a str such as 'selective/', got int"),
]


@pytest.mark.parametrize("call,error,message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_refused_with_a_message_naming_the_value(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_the_planner_refuses_calls_out_of_order_and_accounting_that_does_not_add_up():
    planner = _planner()
    n = planner.begin_step()
    assert n == 8  # 16 slots / 2 survivors per prompt
    with pytest.raises(RuntimeError, match="begin_step called twice without end_step"):
        planner.begin_step()
    with pytest.raises(RuntimeError, match="state_dict during an open step: checkpoint between steps"):
        planner.state_dict()
    planner.record_round(n, n * 4)
    with pytest.raises(ValueError, match="valid_prompts=9 exceeds the 8 prompts drawn this step"):
        planner.next_refill(9)
    # 8 groups, the last of 3 completions where 4 were generated (it keeps floor(3 * 0.5) = 1)
    short = select_completions(torch.arange(31, dtype=torch.float32), torch.arange(31) // 4,
                               CPPOConfig(pruning_rate=0.5))
    with pytest.raises(ValueError, match=re.escape("completion accounting: 32 generated this step but 15 kept + 16 "
                                                   "pruned + 0 dropped")):
        planner.end_step(short)


def test_a_selective_history_update_with_no_prompts_moves_the_clock_only():
    h = SelectiveHistory()
    h.update(torch.tensor([3]), torch.tensor([True]), torch.tensor([True]), step=1)
    h.update(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.bool), torch.zeros(0, dtype=torch.bool),
             step=4)
    assert h.latest_step == 4 and h.num_events == 1
    with pytest.raises(ValueError, match="step=2 is before the last recorded step 4"):
        h.update(torch.tensor([3]), torch.tensor([False]), torch.tensor([False]), step=2)


def test_group_outcomes_takes_lists():
    out = group_outcomes(torch.tensor([1.0, 1.0, 0.0, 1.0]), [7, 7, 9, 9])
    assert out.prompt_ids.tolist() == [7, 9] and out.zero_variance.tolist() == [True, False]
