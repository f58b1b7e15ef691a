"""The host-neutral driver of selective rollout (core/selective_run.py) and the forced keep of
``fill_batch(min_keep=...)``: by value, on histories planted at the 1% keep floor."""

from __future__ import annotations

import itertools

import pytest
import torch

from cppo_megatron.config import CPPOConfig, SelectiveConfig
from cppo_megatron.core import ExplorationRates, SelectiveHistory, count_rounds, fill_batch, step_metrics
from cppo_megatron.core.selective import OutcomeCounts, decide_skips
from cppo_megatron.core.selective_run import TOTALS, SelectiveRun, classify_groups

CFG = CPPOConfig(seed=3, selective=SelectiveConfig(enabled=True))


def floor_history(ids, steps: int = 10) -> SelectiveHistory:
    """``ids`` all correct in their last ``steps`` groups: keep probability max(0.5 ** steps, 0.01)."""
    h = SelectiveHistory()
    n = len(ids)
    for s in range(steps):
        h.update(torch.tensor(ids), torch.ones(n, dtype=torch.bool), torch.ones(n, dtype=torch.bool), step=s)
    return h


def test_a_capped_fill_with_too_few_kept_forces_the_last_drawn():
    h = floor_history(range(8))
    assert bool(decide_skips(h, torch.arange(8), seed=3, step=10, rates=ExplorationRates()).skip.all())
    fb = fill_batch(iter(range(8)), 3, h, seed=3, step=10, rates=ExplorationRates(), max_draws=6, min_keep=1)
    assert fb.capped and fb.exhausted and fb.drawn.tolist() == [0, 1, 2, 3, 4, 5]
    assert fb.kept.tolist() == [5] and fb.skipped.tolist() == [0, 1, 2, 3, 4] and fb.num_forced == 1
    assert bool(fb.decision.skip.all())  # the rule's verdicts stay as they were: forced is apart
    two = fill_batch(iter(range(8)), 3, h, seed=3, step=10, rates=ExplorationRates(), max_draws=6, min_keep=2)
    assert two.kept.tolist() == [4, 5] and two.forced_mask.tolist() == [False] * 4 + [True, True]
    c = count_rounds([fb, two])
    assert (c.drawn, c.skipped, c.generated, c.forced, c.skipped_easy) == (12, 9, 3, 3, 9)
    m = step_metrics([fb, two], ExplorationRates(), OutcomeCounts(3, 0, 0))
    assert m["selective/forced_keeps"] == 3.0 and m["selective/prompts_skipped"] == 9.0
    # the end of the stream forces nothing (the host's data ended), nor does min_keep=0
    ended = fill_batch(iter(range(4)), 3, h, seed=3, step=10, rates=ExplorationRates(), max_draws=6, min_keep=1)
    assert ended.exhausted and not ended.capped and ended.kept.tolist() == [] and ended.num_forced == 0
    none = fill_batch(iter(range(8)), 3, h, seed=3, step=10, rates=ExplorationRates(), max_draws=6)
    assert none.kept.tolist() == [] and none.capped
    with pytest.raises(ValueError, match="min_keep=4 is more than wanted=3"):
        fill_batch(iter(range(8)), 3, h, seed=3, step=10, rates=ExplorationRates(), min_keep=4)


def test_forced_keeps_only_fill_up_to_min_keep():
    """A capped fill that kept one by the rule forces none with min_keep=1 (a short round, not forced)."""
    h = floor_history(range(1, 8))  # prompt 0 never seen: always kept
    fb = fill_batch(iter(range(8)), 3, h, seed=3, step=10, rates=ExplorationRates(), max_draws=6, min_keep=1)
    assert fb.kept.tolist() == [0] and fb.num_forced == 0 and fb.capped


def run(num_prompts=8, warn=None, **kw) -> SelectiveRun:
    return SelectiveRun(CFG, num_prompts=num_prompts, group_size=2, warn=warn, **kw)


def test_the_driver_never_returns_an_empty_fill_and_warns_each_kind_once():
    lines: list[str] = []
    r = run(warn=lines.append)
    r.history = floor_history(range(8))
    r.start_step(10)
    stream = itertools.cycle(range(8))
    fills = [r.fill(stream, 4) for _ in range(3)]
    # each fill: 4 + 8 candidates, all skipped; the 12th kept anyway
    assert [fb.kept.tolist() for fb in fills] == [[3], [7], [3]]
    assert r.short_rounds == 3
    assert len(lines) == 2 and lines[0].startswith("warning: selective rollout skipped all 12 candidates drawn for 4 "
                                                    "prompt(s) in step 10 (a pass over all 8 training prompts and 4 more)")
    assert "generates the last one(s) drawn, [3], anyway and counts them in selective/forced_keeps" in lines[0]
    assert lines[0].endswith("raise cppo.selective.p_min (now 0.05) or turn selective rollout off "
                             "(cppo.selective.enabled=false)")
    assert lines[1].startswith("warning: selective rollout generated 1 of the 4 prompts asked in step 10")
    ids = torch.tensor([3, 7, 3])
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 1.0])
    m = r.file_groups(ids, rewards, torch.arange(3).repeat_interleave(2), completion_lengths=torch.full((6,), 5))
    assert m["selective/forced_keeps"] == 3.0 and m["selective/short_rounds"] == 3.0
    assert m["selective/total_forced_keeps"] == 3.0 and m["selective/prompts_generated"] == 3.0
    assert m["selective/tokens_saved_estimate"] == 33 * 2 * 5.0  # skipped x G x the mean generated length
    assert r.history.trace(3)[1].tolist()[-2:] == [1, 1] and r.history.trace(7)[1].tolist()[-1] == 0


def test_the_rates_adapt_from_the_step_after_one_pass_over_the_prompts():
    r = run()
    r.start_step(0)
    assert not r.adapt
    r.start_step(1, drawn_before=8)  # a host may count its draws itself (the trainer: its sampler)
    assert r.adapt
    r.totals["prompts_drawn"] = 7.0
    r.start_step(2)
    assert not r.adapt
    always = SelectiveRun(CPPOConfig(selective=SelectiveConfig(adapt_after_first_epoch=False)), num_prompts=8,
                          group_size=2)
    always.start_step(0)
    assert always.adapt


def test_filing_classifies_counts_and_files_each_round_once():
    r = run(counters=("groups_recorded",))
    r.start_step(0)
    fb = r.fill(iter([5, 6]), 2)
    assert fb.kept.tolist() == [5, 6]
    with pytest.raises(ValueError, match="1 groups were generated but the draws kept 2 prompts"):
        r.file_groups(torch.tensor([5]), torch.tensor([1.0, 1.0]), torch.tensor([0, 0]),
                      completion_lengths=torch.ones(2))
    # group 5: equal rewards 0.5, all correct -> easy by the correctness, not the reward
    m = r.file_groups(torch.tensor([5, 6]), torch.tensor([0.5, 0.5, 0.0, 1.0]), torch.tensor([0, 0, 1, 1]),
                      easy_values=torch.tensor([1.0, 1.0, 0.0, 1.0]), completion_lengths=torch.ones(4),
                      counts={"groups_recorded": 2})
    assert m["selective/easy_share"] == 0.5 and m["selective/total_groups_recorded"] == 2.0
    assert r.last_filed[1].tolist() == [True, False] and r.last_filed[2].tolist() == [True, False]
    # a second filing in the same step counts only what was drawn since
    again = r.file_groups(torch.zeros(0, dtype=torch.int64), torch.zeros(0), torch.zeros(0, dtype=torch.int64),
                          completion_lengths=torch.zeros(0))
    assert again["selective/prompts_drawn"] == 0.0 and again["selective/total_prompts_drawn"] == 2.0
    with pytest.raises(KeyError):
        r.file_groups(torch.zeros(0, dtype=torch.int64), torch.zeros(0), torch.zeros(0, dtype=torch.int64),
                      completion_lengths=torch.zeros(0), counts={"undeclared": 1})
    with pytest.raises(RuntimeError, match="fill before start_step"):
        run().fill(iter([1]), 1)
    with pytest.raises(RuntimeError, match="file_groups before start_step"):
        run().file_groups(torch.zeros(0, dtype=torch.int64), torch.zeros(0), torch.zeros(0, dtype=torch.int64),
                          completion_lengths=torch.zeros(0))
    with pytest.raises(ValueError, match="cfg must be a CPPOConfig, got dict"):
        SelectiveRun({"selective.enabled": True}, num_prompts=8, group_size=2)  # type: ignore[arg-type]


def test_classify_groups_needs_every_position():
    zv, easy = classify_groups(torch.tensor([1.0, 1.0, 0.0, 0.0]), torch.tensor([1, 1, 0, 0]), 2)
    assert zv.tolist() == [True, True] and easy.tolist() == [False, True]
    # all correct but rewards that differ (a format bonus): not zero variance, so not easy either
    zv, easy = classify_groups(torch.tensor([1.1, 1.0]), torch.tensor([0, 0]), 1, easy_values=torch.ones(2))
    assert zv.tolist() == [False] and easy.tolist() == [False]
    with pytest.raises(ValueError, match=r"group must hold every position 0..2"):
        classify_groups(torch.tensor([1.0, 1.0]), torch.tensor([0, 2]), 3)


def test_state_round_trip_keeps_the_host_counters_and_reads_older_states():
    r = run(counters=("groups_recorded",))
    r.history = floor_history(range(4), steps=2)
    r.rates = ExplorationRates(0.3, 0.6)
    r.totals.update(prompts_drawn=9.0, groups_recorded=4.0)
    other = run(counters=("groups_recorded",))
    other.load_state_dict(r.state_dict())
    assert other.rates == r.rates and other.totals == r.totals and other.fingerprint() == r.fingerprint()
    old = r.state_dict()
    del old["totals"]["forced_keeps"]  # a checkpoint from before forced keeps were counted
    other.load_state_dict(old)
    assert other.totals["forced_keeps"] == 0.0 and set(other.totals) == {*TOTALS, "groups_recorded"}
    other.rates = ExplorationRates(0.3, 0.61)
    assert other.fingerprint() != r.fingerprint()
