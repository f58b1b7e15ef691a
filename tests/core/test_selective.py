"""Selective rollout (GRESO) core: which prompt ids are skipped, with what probability, and
how the exploration rates move. Values are computed by hand or pinned for a fixed seed."""

import io
import itertools

import pytest
import torch

from cppo_megatron.core import PromptSampler, seeded_generator
from cppo_megatron.core.selective import (
    DEFAULT_TARGET_EASY,
    DEFAULT_TARGET_HARD,
    EASY,
    HARD,
    INFORMATIVE,
    MIN_KEEP_PROB,
    SELECTIVE_STREAM,
    UNSEEN,
    ExplorationRates,
    FilledBatch,
    OutcomeCounts,
    RoundCounts,
    SelectiveHistory,
    SkipDecision,
    adapt_exploration,
    adapt_from_config,
    count_rounds,
    decide_skips,
    estimate_tokens_saved,
    fill_batch,
    group_outcomes,
    prompt_uniforms,
    step_metrics,
    target_shares,
)
from cppo_megatron.core.settings import CPPOConfig, SelectiveConfig

M64 = (1 << 64) - 1


def t(xs, dtype=torch.int64):
    return torch.tensor(xs, dtype=dtype)


def b(xs):
    return torch.tensor(xs, dtype=torch.bool)


def reference_uniform(pid: int, seed: int, step: int) -> float:
    """SplitMix64 in Python big ints: the draw the module documents."""
    h0, h1 = torch.randint(0, 1 << 32, (2,), generator=seeded_generator(seed, step, stream=SELECTIVE_STREAM)).tolist()
    x = (((h0 << 32) | h1) + (pid + 1) * 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    x ^= x >> 31
    return (x >> 11) / 2.0**53


def pinned_history() -> SelectiveHistory:
    """Step 0: ids 10..17 all wrong (hard), 20..23 all right (easy), 30, 31 informative."""
    h = SelectiveHistory()
    h.update(
        t([10, 11, 12, 13, 14, 15, 16, 17, 20, 21, 22, 23, 30, 31]),
        b([True] * 12 + [False] * 2),
        b([False] * 8 + [True] * 4 + [False] * 2),
        step=0,
    )
    return h


PINNED_CANDIDATES = [10, 11, 12, 13, 14, 15, 16, 17, 20, 21, 22, 23, 30, 31, 40, 41]
PINNED_RATES = ExplorationRates(p_easy=0.2, p_hard=0.5)


# ---------------------------------------------------------------------- outcomes
def test_group_outcomes_classifies_each_prompt():
    rewards = torch.tensor([1.0, 1, 1, 1, 0, 0, 0, 0, 1, 0, 1, 0, 0.5, 0.5, 0.5, 0.5, 1.0])
    pids = t([7] * 4 + [3] * 4 + [9] * 4 + [12] * 4 + [5])
    o = group_outcomes(rewards, pids)
    assert o.prompt_ids.tolist() == [3, 5, 7, 9, 12]
    assert o.size.tolist() == [4, 1, 4, 4, 4]
    assert o.zero_variance.tolist() == [True, False, True, False, True]  # a singleton is never zero-variance
    assert o.easy.tolist() == [False, False, True, False, False]
    assert o.hard.tolist() == [True, False, False, False, True]  # all 0.5: not solved -> hard
    assert o.mean.tolist() == [0.0, 1.0, 1.0, 0.5, 0.5]
    assert (o.num_groups, o.num_zero_variance, o.num_easy, o.num_hard) == (5, 3, 1, 2)
    # another top reward
    o2 = group_outcomes(torch.tensor([3.0, 3.0, 2.0, 2.0]), t([0, 0, 1, 1]), easy_threshold=3.0)
    assert o2.easy.tolist() == [True, False] and o2.hard.tolist() == [False, True]


# ---------------------------------------------------------------------- history
def test_history_is_keyed_by_prompt_id_not_batch_position():
    h = SelectiveHistory()
    # round 1: prompt 40 at position 0 was informative, prompt 5 at position 1 all correct
    h.update(t([40, 5]), b([False, True]), b([False, True]), step=0)
    # round 2: the same prompts in the other order; 5 is all correct again, 40 all wrong
    h.update(t([5, 40]), b([True, True]), b([True, False]), step=1)
    v = h.lookup(t([40, 5, 0, 1]))
    assert v.seen.tolist() == [True, True, False, False]
    assert v.streak.tolist() == [1, 2, 0, 0]
    assert v.last_outcome.tolist() == [HARD, EASY, UNSEEN, UNSEEN]
    assert v.generations.tolist() == [2, 2, 0, 0]
    assert v.last_step.tolist() == [1, 1, -1, -1]
    assert h.num_prompts == 2 and h.num_events == 4
    steps, outcomes = h.trace(5)
    assert steps.tolist() == [0, 1] and outcomes.tolist() == [EASY, EASY]
    steps, outcomes = h.trace(40)
    assert steps.tolist() == [0, 1] and outcomes.tolist() == [INFORMATIVE, HARD]


def test_streak_counts_consecutive_zero_variance_of_one_kind_and_resets_on_variance():
    h = SelectiveHistory()
    # (zero_var, easy): hard, hard, easy, informative, easy, easy, hard
    seq = [(True, False), (True, False), (True, True), (False, False), (True, True), (True, True), (True, False)]
    streaks = []
    for step, (zv, ez) in enumerate(seq):
        h.update(t([3]), b([zv]), b([ez]), step=2 * step)
        h.update(t([8]), b([False]), b([False]), step=2 * step)  # a second round of the same step
        streaks.append(int(h.lookup(t([3])).streak[0]))
    assert streaks == [1, 2, 1, 0, 1, 2, 1]  # a change of kind starts a new streak (the authors' count)
    assert int(h.lookup(t([3])).last_outcome[0]) == HARD
    assert int(h.lookup(t([8])).streak[0]) == 0
    # steps in which the prompt was not generated record nothing
    assert h.trace(3)[0].tolist() == [0, 2, 4, 6, 8, 10, 12]
    # the summary rebuilt from the log (load_state_dict) counts the same way
    h2 = SelectiveHistory()
    h2.load_state_dict(h.state_dict())
    assert h2.lookup(t([3, 8])).streak.tolist() == [1, 0]


def test_a_prompt_generated_twice_in_one_update_is_recorded_twice_in_draw_order():
    # 5 hard, 8 informative, 5 hard again, 9 easy, 5 easy: as three updates (runs of distinct ids)
    one, three = SelectiveHistory(), SelectiveHistory()
    ids, zv, ez = t([5, 8, 5, 9, 5]), b([1, 0, 1, 1, 1]), b([0, 0, 0, 1, 1])
    one.update(ids, zv, ez, step=4)
    for a, z in ((0, 2), (2, 4), (4, 5)):
        three.update(ids[a:z], zv[a:z], ez[a:z], step=4)
    assert one.state_dict()["prompt_ids"].tolist() == [5, 8, 5, 9, 5]
    assert one.trace(5)[1].tolist() == [HARD, HARD, EASY]
    for key in ("prompt_ids", "steps", "outcomes"):
        assert torch.equal(one.state_dict()[key], three.state_dict()[key])
    view = one.lookup(t([5, 8, 9]))
    assert view.streak.tolist() == [1, 0, 1] and view.generations.tolist() == [3, 1, 1]
    assert view.last_outcome.tolist() == [EASY, INFORMATIVE, EASY]


# ---------------------------------------------------------------------- the decision
def test_skip_probabilities_match_hand_computation():
    h = SelectiveHistory()
    h.update(t([1, 2, 3, 4]), b([True, True, True, False]), b([True, False, True, False]), step=0)
    h.update(t([1, 2, 4]), b([True, True, False]), b([True, False, False]), step=1)
    h.update(t([2]), b([True]), b([False]), step=2)
    for step in range(3, 8):  # 5: hard x5, 0.3^5 = 0.00243 below the floor
        h.update(t([5]), b([True]), b([False]), step=step)
    # 1: easy x2 -> 1 - 0.3^2; 2: hard x3 -> 1 - 0.6^3; 3: easy x1 -> 1 - 0.3; 4: informative; 99: unseen;
    # 5: hard x5 at p_hard 0.3 -> kept with the floor's 0.01
    d = decide_skips(h, t([1, 2, 3, 4, 99]), seed=0, step=8, rates=ExplorationRates(p_easy=0.3, p_hard=0.6))
    assert d.streak.tolist() == [2, 3, 1, 0, 0]
    assert d.last_outcome.tolist() == [EASY, HARD, EASY, INFORMATIVE, UNSEEN]
    assert d.skip_prob.tolist() == pytest.approx([1 - 0.09, 1 - 0.216, 0.7, 0.0, 0.0], abs=1e-15)
    assert d.skip_prob[3] == 0.0 and d.skip_prob[4] == 0.0  # exactly
    d5 = decide_skips(h, t([5]), seed=0, step=8, rates=ExplorationRates(p_easy=0.3, p_hard=0.3))
    assert d5.streak.tolist() == [5] and d5.skip_prob.tolist() == pytest.approx([1 - MIN_KEEP_PROB], abs=1e-15)
    assert d.skip.tolist() == (d.draws < d.skip_prob).tolist()


def test_pinned_skips_for_seed_and_step():
    """Prompts 10..17 (hard, z=1, p_hard 0.5: p_skip 0.5), 20..23 (easy, z=1, p_easy 0.2:
    p_skip 0.8), 30, 31 (informative), 40, 41 (unseen): which ids are skipped at seed 1234."""
    h = pinned_history()
    d5 = decide_skips(h, t(PINNED_CANDIDATES), seed=1234, step=5, rates=PINNED_RATES)
    assert d5.skip_prob.tolist() == [0.5] * 8 + [0.8] * 4 + [0.0] * 4
    assert d5.skipped_ids().tolist() == [12, 13, 14, 15, 16, 20, 21, 22, 23]
    assert d5.kept_ids().tolist() == [10, 11, 17, 30, 31, 40, 41]
    assert (d5.num_skipped, d5.num_kept, d5.num_skipped_easy, d5.num_skipped_hard, d5.num_unseen) == (9, 7, 4, 5, 2)
    d6 = decide_skips(h, t(PINNED_CANDIDATES), seed=1234, step=6, rates=PINNED_RATES)
    assert d6.skipped_ids().tolist() == [10, 11, 13, 16, 20, 21, 22, 23]  # another step, other draws


def test_draws_are_splitmix64_of_the_prompt_id():
    ids = [0, 1, 5, 17, 2**40, 2**62]
    for seed, step in [(0, 0), (1234, 5), (-7, 99)]:
        got = prompt_uniforms(t(ids), seed=seed, step=step).tolist()
        assert got == [reference_uniform(i, seed, step) for i in ids]
        assert all(0.0 <= u < 1.0 for u in got)


def test_never_seen_or_last_informative_never_skipped():
    h = SelectiveHistory()
    for step in range(30):  # prompt 1: 30 zero-variance groups, then one with variance
        h.update(t([1, 2]), b([True, True]), b([False, True]), step=step)
    h.update(t([1]), b([False]), b([False]), step=30)
    rates = ExplorationRates(p_easy=0.05, p_hard=0.05)
    for step in range(31, 231):
        d = decide_skips(h, t([1, 2, 77]), seed=step * 7, step=step, rates=rates)
        assert d.skip.tolist()[0] is False and d.skip.tolist()[2] is False
        assert d.skip_prob[0] == 0.0 and d.skip_prob[2] == 0.0


def test_skip_frequency_follows_the_probability():
    """1 - p^z over 4000 steps: z=2 at p_hard 0.5 -> 0.75; z=1 at p_easy 0.9 -> 0.1."""
    h = SelectiveHistory()
    h.update(t([4, 6]), b([True, True]), b([False, True]), step=0)
    h.update(t([4]), b([True]), b([False]), step=1)
    rates = ExplorationRates(p_easy=0.9, p_hard=0.5)
    hits = torch.zeros(2)
    n = 4000
    for step in range(2, 2 + n):
        hits += decide_skips(h, t([4, 6]), seed=11, step=step, rates=rates).skip.to(torch.float32)
    freq = (hits / n).tolist()
    assert freq[0] == pytest.approx(0.75, abs=0.03)
    assert freq[1] == pytest.approx(0.10, abs=0.02)


def test_decision_is_independent_of_order_position_and_other_candidates():
    h = pinned_history()
    full = decide_skips(h, t(PINNED_CANDIDATES), seed=9, step=3, rates=PINNED_RATES)
    by_id = dict(zip(PINNED_CANDIDATES, full.skip.tolist(), strict=True))
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        perm = torch.randperm(len(PINNED_CANDIDATES), generator=gen)[: int(torch.randint(1, 17, (1,), generator=gen))]
        subset = [PINNED_CANDIDATES[i] for i in perm.tolist()]
        d = decide_skips(h, t(subset), seed=9, step=3, rates=PINNED_RATES)
        assert d.skip.tolist() == [by_id[i] for i in subset]
    # repeats get the same answer; one candidate alone gets the same answer
    d = decide_skips(h, t([12, 12, 30, 12]), seed=9, step=3, rates=PINNED_RATES)
    assert d.skip.tolist() == [by_id[12], by_id[12], False, by_id[12]]
    assert decide_skips(h, t([12]), seed=9, step=3, rates=PINNED_RATES).skip.tolist() == [by_id[12]]


def test_empty_candidates_and_empty_history():
    d = decide_skips(SelectiveHistory(), t([]), seed=0, step=0, rates=ExplorationRates())
    assert d.num_candidates == 0 and d.skip.dtype == torch.bool
    d = decide_skips(SelectiveHistory(), t([3, 1]), seed=0, step=0, rates=ExplorationRates())
    assert d.skip.tolist() == [False, False] and d.last_outcome.tolist() == [UNSEEN, UNSEEN]


# ---------------------------------------------------------------------- persistence
def _summary(h: SelectiveHistory, ids):
    v = h.lookup(t(ids))
    return [x.tolist() for x in (v.seen, v.streak, v.last_outcome, v.generations, v.last_step)]


def test_state_dict_round_trip_gives_identical_decisions():
    gen = torch.Generator().manual_seed(3)
    h = SelectiveHistory()
    for step in range(12):
        ids = torch.randperm(50, generator=gen)[:20]
        zv = torch.rand(20, generator=gen) < 0.6
        ez = zv & (torch.rand(20, generator=gen) < 0.5)
        h.update(ids, zv, ez, step=step)
    buf = io.BytesIO()
    torch.save(h.state_dict(), buf)  # plain tensors, ints and a string
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    assert set(state) == {"format", "latest_step", "prompt_ids", "steps", "outcomes"}
    h2 = SelectiveHistory()
    h2.load_state_dict(state)
    ids = list(range(60))
    assert _summary(h2, ids) == _summary(h, ids)  # the rebuilt summary equals the incremental one
    assert (h2.num_events, h2.num_prompts, h2.latest_step) == (h.num_events, h.num_prompts, 11)
    for step in (12, 13):
        rates = ExplorationRates(0.3, 0.7)
        a = decide_skips(h, t(ids), seed=5, step=step, rates=rates)
        c = decide_skips(h2, t(ids), seed=5, step=step, rates=rates)
        assert torch.equal(a.skip, c.skip) and torch.equal(a.skip_prob, c.skip_prob)
    # both continue identically
    for hh in (h, h2):
        hh.update(t([1, 2, 55]), b([True, False, True]), b([False, False, True]), step=12)
    assert _summary(h2, ids) == _summary(h, ids)
    for i in (1, 2, 55):
        assert all(torch.equal(x, y) for x, y in zip(h.trace(i), h2.trace(i), strict=True))


def test_load_state_dict_rejects_malformed_state():
    state = pinned_history().state_dict()
    with pytest.raises(ValueError, match="format 'nope'"):
        SelectiveHistory().load_state_dict({**state, "format": "nope"})
    with pytest.raises(ValueError, match=r"state\['outcomes'\]\[2\] = 7"):
        bad = state["outcomes"].clone()
        bad[2] = 7
        SelectiveHistory().load_state_dict({**state, "outcomes": bad})
    with pytest.raises(ValueError, match="must be 1-D of one length"):
        SelectiveHistory().load_state_dict({**state, "steps": state["steps"][:3]})
    with pytest.raises(ValueError, match=r"state\['steps'\]\[1\] = 0 is negative or earlier"):
        SelectiveHistory().load_state_dict({**state, "steps": t([3] + [0] * 13)})


# ---------------------------------------------------------------------- adaptive rates
def test_adapt_exploration_exact_next_values():
    r = ExplorationRates(0.5, 0.5)
    # shares 3/10 easy (>= 1/12) and 1/10 hard (< 1/6): easy down, hard up
    assert adapt_exploration(r, num_generated=10, num_easy=3, num_hard=1) == ExplorationRates(0.49, 0.51)
    # exactly at the targets (1/12 and 2/12) counts as reached: both down
    assert adapt_exploration(r, num_generated=12, num_easy=1, num_hard=2) == ExplorationRates(0.49, 0.49)
    # no zero-variance groups: both up
    assert adapt_exploration(r, num_generated=8, num_easy=0, num_hard=0) == ExplorationRates(0.51, 0.51)
    # clamped to the bounds
    lo_hi = ExplorationRates(0.05, 0.95)
    assert adapt_exploration(lo_hi, num_generated=4, num_easy=4, num_hard=0) == ExplorationRates(0.05, 0.95)
    assert adapt_exploration(ExplorationRates(1.0, 0.055), num_generated=4, num_easy=0, num_hard=4) == (
        ExplorationRates(0.95, 0.05))
    # nothing generated: unchanged
    assert adapt_exploration(ExplorationRates(0.37, 0.61), num_generated=0, num_easy=0, num_hard=0) == (
        ExplorationRates(0.37, 0.61))
    # other targets, step and bounds
    got = adapt_exploration(r, num_generated=10, num_easy=2, num_hard=2, target_easy=0.3, target_hard=0.1,
                            step_size=0.05, p_min=0.2, p_max=0.52)
    assert got == ExplorationRates(0.52, 0.45)
    assert (DEFAULT_TARGET_EASY, DEFAULT_TARGET_HARD) == (0.25 / 3, 0.25 * 2 / 3)


def test_adapt_exploration_has_no_drift_over_many_steps():
    r = ExplorationRates()
    for _ in range(20):
        r = adapt_exploration(r, num_generated=10, num_easy=5, num_hard=5)
    assert r == ExplorationRates(0.3, 0.3)  # exactly, not 0.30000000000000004
    for _ in range(100):
        r = adapt_exploration(r, num_generated=10, num_easy=5, num_hard=0)
    assert r == ExplorationRates(0.05, 0.95)


# ---------------------------------------------------------------------- filling a batch
def test_fill_batch_keeps_the_first_unskipped_and_accounts_for_every_draw():
    h = pinned_history()
    stream = iter([10, 11, 12, 13, 14, 15, 16, 17, 20, 21, 22, 23, 30, 31, 40, 41, 42])
    fb = fill_batch(stream, 4, h, seed=1234, step=5, rates=PINNED_RATES)
    assert isinstance(fb, FilledBatch)
    # step 5 keeps 10, 11, 17, 30, ... (test_pinned_skips_for_seed_and_step): the 4th keeper is 30
    assert fb.kept.tolist() == [10, 11, 17, 30]
    assert fb.skipped.tolist() == [12, 13, 14, 15, 16, 20, 21, 22, 23]
    assert fb.drawn.tolist() == [10, 11, 12, 13, 14, 15, 16, 17, 20, 21, 22, 23, 30]
    assert not fb.exhausted
    assert next(stream) == 31  # nothing was taken beyond the last decided candidate
    # the rest of the stream: 31, 40, 41, 42 all kept; asking for 6 exhausts it
    fb2 = fill_batch(stream, 6, h, seed=1234, step=5, rates=PINNED_RATES)
    assert fb2.kept.tolist() == [40, 41, 42] and fb2.skipped.tolist() == [] and fb2.exhausted


def test_fill_batch_equals_deciding_one_by_one():
    h = pinned_history()
    stream = [17, 12, 40, 13, 20, 14, 21, 15, 10, 22, 16, 11, 23, 30, 31, 41] * 3
    for wanted, seed, step in itertools.product([0, 1, 3, 7, 20], [0, 1234], [5, 6, 7]):
        fb = fill_batch(iter(stream), wanted, h, seed=seed, step=step, rates=PINNED_RATES)
        kept, skipped, drawn = [], [], []
        for pid in stream:
            if len(kept) == wanted:
                break
            drawn.append(pid)
            s = bool(decide_skips(h, t([pid]), seed=seed, step=step, rates=PINNED_RATES).skip[0])
            (skipped if s else kept).append(pid)
        assert fb.kept.tolist() == kept and fb.skipped.tolist() == skipped and fb.drawn.tolist() == drawn
        assert sorted(fb.kept.tolist() + fb.skipped.tolist()) == sorted(drawn)
        assert fb.exhausted == (len(kept) < wanted)


def test_fill_batch_with_a_sampler_and_a_draw_cap():
    h = pinned_history()
    sampler = PromptSampler(50, seed=2)
    fb = fill_batch(sampler.draw, 30, h, seed=0, step=1, rates=ExplorationRates(0.05, 0.05))
    assert fb.kept.numel() == 30 and not fb.exhausted
    assert sampler.total_drawn == fb.drawn.numel()  # the sampler advanced by exactly what was decided
    capped = fill_batch(iter(range(10, 24)), 10, h, seed=1234, step=5, rates=PINNED_RATES, max_draws=5)
    assert capped.drawn.tolist() == [10, 11, 12, 13, 14] and capped.kept.tolist() == [10, 11] and capped.exhausted
    whole = fill_batch(torch.arange(10, 18), 2, h, seed=1234, step=5, rates=PINNED_RATES)  # a tensor source
    assert whole.kept.tolist() == [10, 11] and whole.drawn.tolist() == [10, 11]


# ---------------------------------------------------------------------- metrics
def test_step_metrics_of_one_filled_round():
    h = pinned_history()
    fb = fill_batch(iter(PINNED_CANDIDATES), 7, h, seed=1234, step=5, rates=PINNED_RATES)
    o = group_outcomes(torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0]), t([10, 10, 11, 11, 17, 17, 30, 30]))
    m = step_metrics([fb], ExplorationRates(0.19, 0.51), o)
    assert m == {
        "selective/prompts_drawn": 16.0,
        "selective/prompts_skipped": 9.0,
        "selective/prompts_generated": 7.0,
        "selective/skipped_easy": 4.0,
        "selective/skipped_hard": 5.0,
        "selective/skip_ratio": 9 / 16,
        "selective/forced_keeps": 0.0,
        "selective/zero_variance_share": 0.5,
        "selective/easy_share": 0.25,
        "selective/hard_share": 0.25,
        "selective/p_easy": 0.19,
        "selective/p_hard": 0.51,
    }
    assert set(step_metrics([fb], PINNED_RATES, o, prefix="x/")) >= {"x/prompts_skipped", "x/p_easy"}


def decided(ids, skip, last, wanted):
    """A FilledBatch whose decisions are given (not drawn): the metrics only count them."""
    n = len(ids)
    return FilledBatch(
        decision=SkipDecision(prompt_ids=t(ids), skip=b(skip), skip_prob=torch.zeros(n, dtype=torch.float64),
                              draws=torch.zeros(n, dtype=torch.float64), streak=t([1] * n),
                              last_outcome=t(last, torch.int8), rates=ExplorationRates(), seed=0, step=3),
        wanted=wanted, exhausted=False)


# two rounds of one step, by hand: round 1 draws 10 (hard, skipped), 20 (easy, skipped), 30, 40 (unseen), 11
# and keeps 30, 40, 11; round 2 draws 21, 22 (easy, skipped), 12 (hard, skipped), 41 and keeps 41
TWO_ROUNDS = [
    decided([10, 20, 30, 40, 11], [1, 1, 0, 0, 0], [HARD, EASY, INFORMATIVE, UNSEEN, HARD], wanted=3),
    decided([21, 22, 12, 41], [1, 1, 1, 0], [EASY, EASY, HARD, UNSEEN], wanted=1),
]
# the 4 generated groups at G = 2: 30 all right (easy), 40 varied, 11 and 41 all wrong (hard)
TWO_ROUNDS_OUTCOMES = group_outcomes(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]),
                                     t([30, 30, 40, 40, 11, 11, 41, 41]))
TWO_ROUNDS_LENGTHS = t([3, 5, 2, 6, 4, 4, 1, 7])  # 32 tokens over 8 completions: mean 4


def test_step_metrics_sum_every_round_of_the_step():
    assert count_rounds(TWO_ROUNDS) == RoundCounts(drawn=9, skipped=5, generated=4, skipped_easy=3, skipped_hard=2)
    assert count_rounds([]) == RoundCounts(0, 0, 0, 0, 0)
    saved = estimate_tokens_saved(5, 2, TWO_ROUNDS_LENGTHS)
    assert saved == 40.0  # 5 skipped x G = 2 x 4 tokens
    m = step_metrics(TWO_ROUNDS, ExplorationRates(0.53, 0.47), TWO_ROUNDS_OUTCOMES, tokens_saved=saved)
    assert m == {
        "selective/prompts_drawn": 9.0,
        "selective/prompts_skipped": 5.0,
        "selective/prompts_generated": 4.0,
        "selective/skipped_easy": 3.0,
        "selective/skipped_hard": 2.0,
        "selective/skip_ratio": 5 / 9,
        "selective/forced_keeps": 0.0,
        "selective/zero_variance_share": 0.75,
        "selective/easy_share": 0.25,
        "selective/hard_share": 0.5,
        "selective/tokens_saved_estimate": 40.0,
        "selective/p_easy": 0.53,
        "selective/p_hard": 0.47,
    }
    # counts instead of the groups give the same shares
    counts = OutcomeCounts(num_groups=4, num_easy=1, num_hard=2)
    assert step_metrics(TWO_ROUNDS, ExplorationRates(0.53, 0.47), counts, tokens_saved=saved) == m
    assert OutcomeCounts.from_flags(TWO_ROUNDS_OUTCOMES.zero_variance, TWO_ROUNDS_OUTCOMES.easy) == counts
    # nothing drawn, nothing recorded: ratios 0, no division
    empty = step_metrics([], ExplorationRates(), OutcomeCounts(0, 0, 0))
    assert empty["selective/skip_ratio"] == empty["selective/zero_variance_share"] == 0.0
    assert "selective/tokens_saved_estimate" not in empty


def test_estimate_tokens_saved_values():
    assert estimate_tokens_saved(3, 16, t([10, 20])) == 720.0  # 3 x 16 x 15
    assert estimate_tokens_saved(0, 16, t([10, 20])) == 0.0
    assert estimate_tokens_saved(4, 8, t([], torch.int64)) == 0.0  # nothing generated: no length to go by
    assert estimate_tokens_saved(1, 3, torch.tensor([1.5, 2.0])) == 5.25


def test_adapt_from_config_uses_the_configs_targets_step_and_bounds():
    o = OutcomeCounts(num_groups=4, num_easy=1, num_hard=2)  # shares 0.25 easy, 0.5 hard
    # the defaults: targets 1/12 and 1/6, both exceeded: both rates down by 0.01
    assert adapt_from_config(ExplorationRates(), CPPOConfig(), o) == ExplorationRates(0.49, 0.49)
    assert adapt_from_config(ExplorationRates(), CPPOConfig(), TWO_ROUNDS_OUTCOMES) == ExplorationRates(0.49, 0.49)
    # alpha 0.9: targets 0.3 and 0.6, neither reached: both up by the step 0.05, easy capped at p_max 0.53
    cfg = CPPOConfig(selective=SelectiveConfig(target_zero_variance=0.9, step_size=0.05, p_max=0.53, p_easy=0.5,
                                               p_hard=0.45))
    assert adapt_from_config(ExplorationRates(0.5, 0.45), cfg, o) == ExplorationRates(0.53, 0.5)
    # what adapt_exploration gives with the same numbers spelled out
    assert adapt_from_config(ExplorationRates(0.5, 0.45), cfg, o) == adapt_exploration(
        ExplorationRates(0.5, 0.45), num_generated=4, num_easy=1, num_hard=2, target_easy=0.3, target_hard=0.6,
        step_size=0.05, p_min=0.05, p_max=0.53)
    # nothing recorded: unchanged
    assert adapt_from_config(ExplorationRates(0.3, 0.7), cfg, OutcomeCounts(0, 0, 0)) == ExplorationRates(0.3, 0.7)


def test_target_shares_split_alpha_a_third_easy_two_thirds_hard():
    assert target_shares(0.25) == (DEFAULT_TARGET_EASY, DEFAULT_TARGET_HARD)
    assert target_shares(0.6) == pytest.approx((0.2, 0.4), abs=1e-15)
    with pytest.raises(ValueError, match=r"alpha = 1.5 must be a share in \[0, 1\]"):
        target_shares(1.5)


# ---------------------------------------------------------------------- bad inputs
def _raises(fn, match):
    with pytest.raises(ValueError, match=match):
        fn()


def test_bad_inputs_raise_naming_the_value():
    h = pinned_history()
    r = ExplorationRates()
    cases = [
        (lambda: h.lookup(t([3, -4])), r"prompt_ids\[1\] = -4 is negative"),
        (lambda: h.lookup(torch.tensor([1.0, 2.0])), "integer tensor of prompt ids.*float32"),
        (lambda: h.lookup(t([[1, 2]])), r"1-D \[n\] prompt ids, got shape \(1, 2\)"),
        (lambda: SelectiveHistory().update(t([5, 8]), b([0, 1]), b([1, 0]), step=0),
         r"easy\[0\] is True for prompt id 5 but zero_variance\[0\] is False"),
        (lambda: SelectiveHistory().update(t([5, 8]), b([1]), b([0, 0]), step=0),
         "zero_variance has 1 entries but prompt_ids has 2"),
        (lambda: SelectiveHistory().update(t([5]), t([1]), b([0]), step=0), "zero_variance must have dtype torch.bool"),
        (lambda: h.update(t([5]), b([1]), b([0]), step=-1), "step must be an integer >= 0, got -1"),
        (lambda: ExplorationRates(p_easy=0.0), r"p_easy = 0.0 must be in \(0, 1\]"),
        (lambda: ExplorationRates(p_hard=1.5), r"p_hard = 1.5 must be in \(0, 1\]"),
        (lambda: ExplorationRates(p_easy=float("nan")), "p_easy must be a finite number, got nan"),
        (lambda: decide_skips(h, t([1]), seed=0, step=0, rates=(0.5, 0.5)), "rates must be an ExplorationRates"),
        (lambda: decide_skips(h, t([1]), seed=True, step=0, rates=r), "seed must be an integer, got True"),
        (lambda: decide_skips(h, t([1]), seed=0, step=1.5, rates=r), "step must be an integer >= 0, got 1.5"),
        (lambda: adapt_exploration(r, num_generated=3, num_easy=2, num_hard=2),
         r"num_easy \(2\) \+ num_hard \(2\) exceeds num_generated \(3\)"),
        (lambda: adapt_exploration(r, num_generated=3, num_easy=1, num_hard=0, p_min=0.6, p_max=0.4),
         "p_min = 0.6 is larger than p_max = 0.4"),
        (lambda: adapt_exploration(r, num_generated=3, num_easy=1, num_hard=0, target_hard=1.2),
         r"target_hard = 1.2 must be a share in \[0, 1\]"),
        (lambda: adapt_exploration(r, num_generated=-1, num_easy=0, num_hard=0),
         "num_generated must be an integer >= 0"),
        (lambda: fill_batch(iter([1, 2, -3]), 5, h, seed=0, step=0, rates=r), "candidate #2 from the stream is -3"),
        (lambda: fill_batch(iter([1]), -1, h, seed=0, step=0, rates=r), "wanted must be an integer >= 0, got -1"),
        (lambda: group_outcomes(torch.tensor([1.0, float("nan")]), t([0, 0])), r"rewards\[1\] = nan is not finite"),
        (lambda: group_outcomes(torch.tensor([1.0, 0.0]), t([0])), "prompt_ids has 1 entries but rewards has 2"),
        (lambda: step_metrics(TWO_ROUNDS[0], r, OutcomeCounts(0, 0, 0)),
         r"rounds is one FilledBatch; pass the step's rounds as a list \(\[fb\] for a single round\)"),
        (lambda: step_metrics("x", r, OutcomeCounts(0, 0, 0)), "rounds must be a sequence of FilledBatch"),
        (lambda: step_metrics([TWO_ROUNDS[0], 3], r, OutcomeCounts(0, 0, 0)), r"rounds\[1\] is a int, not a FilledBatch"),
        (lambda: step_metrics(TWO_ROUNDS, r, (4, 1, 2)), "outcomes must be a GroupOutcomes .* or an OutcomeCounts, got tuple"),
        (lambda: step_metrics(TWO_ROUNDS, r, OutcomeCounts(0, 0, 0), tokens_saved=-1.0),
         "tokens_saved must be >= 0.0, got -1.0"),
        (lambda: OutcomeCounts(num_groups=2, num_easy=2, num_hard=1), r"num_easy \(2\) \+ num_hard \(1\) exceeds num_groups \(2\)"),
        (lambda: OutcomeCounts(num_groups=-1, num_easy=0, num_hard=0), "num_groups must be an integer >= 0, got -1"),
        (lambda: OutcomeCounts.from_flags(b([0, 1]), b([1, 0])), r"easy\[0\] is True but zero_variance\[0\] is False"),
        (lambda: adapt_from_config(r, {"selective.step_size": 0.1}, OutcomeCounts(0, 0, 0)),
         "cfg must be a CPPOConfig .* got dict"),
        (lambda: estimate_tokens_saved(2, 0, t([1])), "group_size must be an integer >= 1, got 0"),
        (lambda: estimate_tokens_saved(2, 4, t([3, -1])), r"completion_lengths\[1\] = -1.0 is negative"),
    ]
    for fn, match in cases:
        _raises(fn, match)
    # the history is append-only in time
    h2 = pinned_history()
    h2.update(t([1]), b([1]), b([0]), step=4)
    _raises(lambda: h2.update(t([2]), b([1]), b([0]), step=3), "step=3 is before the last recorded step 4")


def test_core_exports_the_selective_api():
    import cppo_megatron.core as core

    for name in ("SelectiveHistory", "ExplorationRates", "decide_skips", "adapt_exploration", "fill_batch",
                 "group_outcomes", "step_metrics", "count_rounds", "adapt_from_config", "estimate_tokens_saved",
                 "OutcomeCounts", "RoundCounts"):
        assert getattr(core, name) is getattr(__import__("cppo_megatron.core.selective", fromlist=[name]), name)


def test_a_filled_batch_refuses_a_forced_mask_that_is_not_one_of_its_skips():
    fb = TWO_ROUNDS[0]  # candidates 10, 20 skipped; 30, 40, 11 kept by the rule
    forced = FilledBatch(decision=fb.decision, wanted=4, exhausted=False, forced=b([0, 1, 0, 0, 0]))
    assert forced.kept.tolist() == [20, 30, 40, 11]  # the forced skip is generated, in draw order
    _raises(lambda: FilledBatch(decision=fb.decision, wanted=3, exhausted=False, forced=b([0, 0, 1, 0, 0])),
            r"FilledBatch.forced\[2\] is True but the rule kept candidate 2 \(prompt id 30\): only skipped")
    _raises(lambda: FilledBatch(decision=fb.decision, wanted=3, exhausted=False, forced=b([1, 0])),
            r"forced must be a \[d\] = \[5\] bool mask aligned with decision, got torch.bool of shape \(2,\)")
    _raises(lambda: FilledBatch(decision=fb.decision, wanted=3, exhausted=False, forced=t([1, 0, 0, 0, 0])),
            r"got torch.int64 of shape \(5,\)")
