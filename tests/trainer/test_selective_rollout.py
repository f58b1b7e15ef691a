"""cppo.selective.enabled in the embedded trainer: real trainer, real micro model, 12 prompts
(so prompts come back within 3 steps and their history decides)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from cppo_megatron.core import (
    ExplorationRates,
    PromptSampler,
    SelectiveHistory,
    adapt_exploration,
    decide_skips,
)
from cppo_megatron.core.selective import EASY, HARD, prompt_uniforms
from cppo_megatron.trainer import Trainer
from cppo_megatron.trainer.checkpoint import load_checkpoint
from cppo_megatron.trainer.config import RecipeError, load_recipe
from cppo_megatron.trainer.logger import read_metrics
from tests.recipes import MICRO

# 12 prompts, 8 generated per step (capacity 16, k = 2 of G = 4): the second pass starts in step 2.
# p_hard / p_easy 0.3: a prompt after one zero-variance group is skipped with chance 0.7.
SELECTIVE = ["task.train_size=12", "cppo.selective.enabled=true", "cppo.selective.p_easy=0.3",
             "cppo.selective.p_hard=0.3"]


def _recipe(out_dir: Path, *overrides: str):
    return load_recipe(None, MICRO + [f"out_dir={out_dir}", *SELECTIVE, *overrides])


def _steps(out_dir: Path) -> list[dict]:
    return [r for r in read_metrics(out_dir / "metrics.jsonl") if r.get("kind") == "step"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One 3-step run with dynamic sampling (its dropped groups must be recorded too), every
    generation round observed as the rollout returned it."""
    out = tmp_path_factory.mktemp("selective") / "run"
    t = Trainer(_recipe(out, "train.steps=3", "cppo.dynamic_sampling=true", "cppo.max_refill_rounds=2"))
    real_round = t.rollout.round
    rounds: list[tuple[int, list[int], list[float], list[float]]] = []

    def observed(ids, *, step, round_, timer):
        part = real_round(ids, step=step, round_=round_, timer=timer)
        rounds.append((step, list(ids), list(part.rewards), list(part.correct)))
        return part

    t.rollout.round = observed
    t.run()
    return t, rounds, _steps(out)


def test_history_holds_every_generated_group_under_its_prompt_index(run):
    """Each generated group's outcome, computed here from the rewards the rollout returned,
    is in the history under the dataset index the rollout generated, in generation order."""
    t, rounds, steps = run
    G = t.r.rollout.group_size
    want_ids, want_steps, want_outcomes = [], [], []
    for step, ids, rewards, correct in rounds:
        for g, pid in enumerate(ids):
            r, c = rewards[g * G:(g + 1) * G], correct[g * G:(g + 1) * G]
            outcome = 0 if max(r) != min(r) else (EASY if min(c) == 1.0 else HARD)
            want_ids.append(pid)
            want_steps.append(step)
            want_outcomes.append(outcome)
    state = t.selective.history.state_dict()
    assert state["prompt_ids"].tolist() == want_ids
    assert state["steps"].tolist() == want_steps
    assert state["outcomes"].tolist() == want_outcomes
    assert sum(s["alloc/prompts_dropped"] for s in steps) > 0, "dynamic sampling dropped no group: not exercised"
    assert max(s["selective/prompts_skipped"] for s in steps) > 0, "nothing was skipped: decisions not exercised"


def test_every_drawn_prompt_is_generated_or_counted_as_skipped(run):
    t, rounds, steps = run
    total_drawn = total_skipped = total_generated = 0.0
    for i, s in enumerate(steps):
        generated = sum(len(ids) for step, ids, _, _ in rounds if step == i)
        assert s["selective/prompts_generated"] == generated == s["alloc/prompts_drawn"], i
        assert s["selective/prompts_drawn"] == s["selective/prompts_generated"] + s["selective/prompts_skipped"], i
        assert s["selective/prompts_skipped"] == s["selective/skipped_easy"] + s["selective/skipped_hard"], i
        total_drawn += s["selective/prompts_drawn"]
        total_skipped += s["selective/prompts_skipped"]
        total_generated += generated
        assert (s["selective/total_prompts_drawn"], s["selective/total_prompts_skipped"],
                s["selective/total_prompts_generated"]) == (total_drawn, total_skipped, total_generated), i
        mean_len = s["rollout/mean_length"]
        assert s["selective/tokens_saved_estimate"] == pytest.approx(s["selective/prompts_skipped"] * 4 * mean_len)
    # the sampler handed out every drawn prompt, skipped ones included (they use up the epoch)
    assert t.sampler.total_drawn == total_drawn


def test_rates_adapt_only_after_the_first_pass_over_the_prompts(run):
    """A step that starts before all 12 prompts were drawn keeps the rates; every later one
    moves them by adapt_exploration over the groups it generated."""
    t, rounds, steps = run
    rates, drawn_before = ExplorationRates(0.3, 0.3), 0.0
    for s in steps:
        adapts = drawn_before >= 12
        assert s["selective/adapted"] == float(adapts), s["step"]
        if adapts:
            n = s["selective/prompts_generated"]
            rates = adapt_exploration(rates, num_generated=int(n), num_easy=round(s["selective/easy_share"] * n),
                                      num_hard=round(s["selective/hard_share"] * n), target_easy=0.25 / 3,
                                      target_hard=0.5 / 3, step_size=0.01, p_min=0.05, p_max=0.95)
        assert (s["selective/p_easy"], s["selective/p_hard"]) == (rates.p_easy, rates.p_hard), s["step"]
        drawn_before = s["selective/total_prompts_drawn"]
    assert [s["selective/adapted"] for s in steps][0] == 0.0 and steps[-1]["selective/adapted"] == 1.0
    assert t.selective.rates == rates != ExplorationRates(0.3, 0.3)


def test_skipped_prompts_follow_the_planted_history(tmp_path):
    """The step's skipped prompt ids are exactly those decide_skips picks from the planted
    history, and match the rule 1 - max(p_e ** z, 0.01) computed here from the planted streaks."""
    recipe = _recipe(tmp_path / "run", "train.steps=1", "cppo.selective.p_easy=0.9", "cppo.selective.p_hard=0.2")
    t = Trainer(recipe)
    order = PromptSampler(12, seed=recipe.seed).draw(24)  # what the run's sampler will hand out
    planted = SelectiveHistory()
    # order[0:4]: z = 3 hard; order[4:8]: z = 1 easy; order[8:10]: informative last; the rest unseen
    z = {pid: 3 for pid in order[0:4]} | {pid: 1 for pid in order[4:8]} | {pid: 0 for pid in order[8:10]}
    kind = {pid: HARD for pid in order[0:4]} | {pid: EASY for pid in order[4:8]}
    for k in range(3):
        ids = [pid for pid in order[:10] if z[pid] > k or (z[pid] == 0 and k == 0)]
        zv = torch.tensor([z[pid] > k for pid in ids])
        planted.update(torch.tensor(ids), zv, zv & torch.tensor([kind.get(pid) == EASY for pid in ids]), step=0)
    t.selective.history.load_state_dict(planted.state_dict())
    t.run()

    fb = t.selective.rounds[0]
    drawn = fb.drawn
    assert drawn.tolist() == order[:drawn.numel()]
    d = decide_skips(planted, drawn, seed=recipe.cppo.seed, step=0, rates=ExplorationRates(0.9, 0.2))
    assert fb.skipped.tolist() == d.skipped_ids().tolist()
    assert fb.kept.tolist() == d.kept_ids().tolist()
    # the rule, from the planted streaks (not from decide_skips)
    u = prompt_uniforms(drawn, seed=recipe.cppo.seed, step=0)
    p_e = {EASY: 0.9, HARD: 0.2}
    rule = [pid for pid, x in zip(drawn.tolist(), u.tolist(), strict=True)
            if z.get(pid, 0) > 0 and x < 1 - max(p_e[kind[pid]] ** z[pid], 0.01)]  # 0.2^3 < 0.01: the floor
    assert fb.skipped.tolist() == rule
    # a prompt drawn again in the step (the draws cross into the next epoch) gets the same answer
    assert 0 < len(set(rule)) < 8, f"the planted history should skip some of the 8 zero-variance prompts: {rule}"
    # what was generated (recorded after the planted events) is exactly the kept prompts, in order
    recorded = t.selective.history.state_dict()["prompt_ids"][planted.num_events:]
    assert recorded.tolist() == d.kept_ids().tolist()
    assert len(recorded) == 8  # the step still generated its 8 prompts


def test_resume_gives_the_history_rates_and_decisions_of_an_uninterrupted_run(tmp_path):
    adapt = ["train.steps=4", "cppo.selective.adapt_after_first_epoch=false"]
    full = Trainer(_recipe(tmp_path / "full", *adapt))
    full.run()
    part_recipe = _recipe(tmp_path / "part", *adapt, "log.checkpoint_every=2")
    part = Trainer(part_recipe)
    real_step = part._rl_step

    def crash_after_two():
        if part.step == 2:
            raise KeyboardInterrupt  # as Ctrl-C would
        return real_step()

    part._rl_step = crash_after_two
    assert part.run()["interrupted"]
    saved, _ = load_checkpoint(tmp_path / "part" / "checkpoints" / "step_000002", 0)
    assert saved["selective"]["history"]["prompt_ids"].numel() == 16  # two steps of 8 generated prompts
    resumed = Trainer(part_recipe, resume=True)
    resumed.run()
    a, b = full.selective.state_dict(), resumed.selective.state_dict()
    for key in ("prompt_ids", "steps", "outcomes"):
        assert torch.equal(a["history"][key], b["history"][key]), key
    assert a["rates"] == b["rates"] and a["totals"] == b["totals"]
    sa, sb = _steps(tmp_path / "full"), _steps(tmp_path / "part")
    assert [s["step"] for s in sb] == [1, 2, 3, 4]
    keys = [k for k in sa[0] if k.startswith("selective/")]
    assert [[s[k] for k in keys] for s in sa] == [[s[k] for k in keys] for s in sb]
    assert sum(s["selective/prompts_skipped"] for s in sa[2:]) > 0, "no skip after the resume: not exercised"


def test_a_checkpoint_without_selective_state_resumes_with_an_empty_history(tmp_path, capfd):
    out = tmp_path / "run"
    Trainer(load_recipe(None, MICRO + [f"out_dir={out}", "task.train_size=12", "train.steps=1",
                                       "log.checkpoint_every=1"])).run()
    capfd.readouterr()
    t = Trainer(_recipe(out, "train.steps=2"), resume=True)
    assert t.step == 1 and t.selective.history.num_events == 0 and t.selective.rates == ExplorationRates(0.3, 0.3)
    assert capfd.readouterr().err.strip().splitlines()[-1] == (
        "--resume: checkpoint step_000001 has no selective-rollout state (written without cppo.selective.enabled): "
        "starting with an empty prompt history and p_easy=0.3, p_hard=0.3")


@pytest.mark.parametrize("override, message", [
    ("cppo.selective.p_easy=0", "CPPOConfig.selective.p_easy must be in (0, 1], got 0.0; 0 would never explore a "
                                "zero-variance prompt again"),
    ("cppo.selective.p_hard=0.99", "CPPOConfig.selective.p_hard = 0.99 is outside [p_min, p_max] = [0.05, 0.95]; "
                                   "set it inside the bounds (or widen them)"),
    ("cppo.selective.p_min=0.9", "CPPOConfig.selective.p_easy = 0.5 is outside [p_min, p_max] = [0.9, 0.95]; set "
                                 "it inside the bounds (or widen them)"),
    ("cppo.selective.step_size=-0.1", "CPPOConfig.selective.step_size must be >= 0, got -0.1; 0 keeps p_easy / "
                                      "p_hard fixed, the authors use 0.01"),
    ("cppo.selective.target_zero_variance=1.5", "CPPOConfig.selective.target_zero_variance must be in [0, 1], got "
                                                "1.5; the authors use 0.25"),
])
def test_bad_selective_keys_are_named(override, message):
    with pytest.raises(ValueError) as err:
        load_recipe(None, [override])
    assert str(err.value).endswith(message)


def test_an_abandoned_step_puts_the_recorded_history_back(tmp_path):
    """Ctrl-C in the reference pass: the step's groups were already recorded, and abandoning
    the step (its prompts go back to the sampler) must take them out of the history too."""
    t = Trainer(_recipe(tmp_path / "run", "train.steps=3", "train.beta=0.04"))
    real_logprobs = t.backend.logprobs
    after_first: dict = {}

    def interrupted_in_step_two(rows, **kw):
        if t.step == 1:
            assert t.selective.history.num_events == 16  # step 2's groups are in by now
            raise KeyboardInterrupt
        out = real_logprobs(rows, **kw)
        after_first.update(t.selective.state_dict())
        return out

    t.backend.logprobs = interrupted_in_step_two
    assert t.run()["interrupted"]
    now = t.selective.state_dict()
    assert now["history"]["prompt_ids"].tolist() == after_first["history"]["prompt_ids"].tolist()
    assert now["history"]["prompt_ids"].numel() == 8 and now["totals"] == after_first["totals"]
    assert t.sampler.total_drawn == now["totals"]["prompts_drawn"]


def _two_ranks(rank, world, root):
    """One gloo rank of a 2-rank megatron job (dp 2): a 3-step selective run, then a run whose rank 1
    reports a history digest of its own."""
    from megatron.core import parallel_state as ps

    def recipe(out, *extra):
        return _recipe(out, "backend=megatron", "megatron.tp=1", "megatron.pp=1", *extra)

    t = Trainer(recipe(root / "agree", "train.steps=3", "log.progress=true"))  # rank 0: the bar with its imbalance
    t.run()
    t.close()
    ps.destroy_model_parallel()
    t = Trainer(recipe(root / "differ", "train.steps=2"))
    digest = t.selective.fingerprint()
    if rank == 1:  # what a rank-dependent draw or reward would give: a history of its own
        t.selective.fingerprint = lambda: "rank 1's own"
    try:
        t.run()
        error = None
    except RuntimeError as exc:
        error = str(exc)
    finally:
        t.close()
        ps.destroy_model_parallel()
    return digest, t.step, error


def test_two_ranks_decide_alike(tmp_path):
    """backend megatron on 2 gloo processes (dp 2, forked by run_local so the measurement follows them):
    each step the trainer compares the ranks' history digests; the run completes and skips prompts. A
    rank whose digest differs stops both ranks inside step 1, with the digests by rank."""
    pytest.importorskip("megatron.core")
    from cppo_megatron.distributed import run_local

    (digest0, step0, err0), (digest1, step1, err1) = run_local(_two_ranks, 2, tmp_path, timeout=300)
    steps = _steps(tmp_path / "agree")
    assert [s["step"] for s in steps] == [1, 2, 3]
    for s in steps:
        assert s["selective/prompts_drawn"] == s["selective/prompts_generated"] + s["selective/prompts_skipped"]
    assert sum(s["selective/prompts_skipped"] for s in steps) > 0
    assert digest0 == digest1 and (step0, step1) == (0, 0)  # alike at the start; stopped inside step 1
    assert err0 == err1 and re.fullmatch(r"step 1: the selective-rollout history differs between ranks \(digests by "
                                         r"rank: \['[0-9a-f]{16}', \"rank 1's own\"\]\); the ranks drew or recorded "
                                         r"different prompts", err0), err0
    assert _steps(tmp_path / "differ") == []


def test_a_round_that_runs_out_of_candidates_is_counted_and_warned_once():
    """8 training prompts, all easy last time (streak 1) and p_easy at 0.2: most candidates are
    skipped, and a round takes at most n + 8 of them, so it comes up short. The metric counts
    each short round of the step; the warning comes once a run, and never on other ranks."""
    from cppo_megatron.config import CPPOConfig, SelectiveConfig
    from cppo_megatron.core import fill_batch
    from cppo_megatron.trainer.selective import SelectiveRollout

    cfg = CPPOConfig(seed=7, selective=SelectiveConfig(enabled=True, p_easy=0.2))
    lines: list[str] = []
    for warn in (lines.append, None):
        sel = SelectiveRollout(cfg, group_size=4, num_prompts=8, warn=warn)
        sel.history.update(torch.arange(8), torch.ones(8, dtype=torch.bool), torch.ones(8, dtype=torch.bool), step=0)
        sampler = PromptSampler(8, seed=0)
        sel.begin_step(1, sampler)
        generated = []
        for _ in range(2):  # two rounds of one step (as dynamic sampling's refills)
            twin = PromptSampler(8, seed=0)
            twin.load_state_dict(sampler.state_dict())
            want = fill_batch(twin.draw, 4, sel.history, seed=7, step=1, rates=sel.rates, max_draws=4 + 8)
            kept = sel.draw(sampler, 4)
            assert kept == want.kept.tolist() and 0 < len(kept) < 4, kept  # short, not empty
            generated += kept
        n = len(generated)
        m = sel.end_step(torch.tensor(generated), torch.arange(n * 4, dtype=torch.float32), torch.zeros(n * 4),
                         torch.full((n * 4,), 3))
        assert m["selective/short_rounds"] == 2.0 and m["selective/prompts_drawn"] == 24.0
    assert len(lines) == 1 and "generated 2 of the 4 prompts asked in step 1" in lines[0]
    assert "use more training prompts, raise cppo.selective.p_min (now 0.05)" in lines[0]


def test_the_flat_keys_of_earlier_versions_are_read_with_a_warning_naming_the_new_key(tmp_path):
    nested = load_recipe(None, ["cppo.selective.enabled=true", "cppo.selective.p_easy=0.3"])
    with pytest.warns(FutureWarning, match=r"recipe key cppo.selective_p_easy is deprecated: write "
                                           r"cppo.selective.p_easy=0.3"):
        flat = load_recipe(None, ["cppo.selective_rollout=true", "cppo.selective_p_easy=0.3"])
    assert flat.cppo == nested.cppo
    recipe = tmp_path / "r.yaml"
    recipe.write_text("cppo:\n  selective_rollout: true\n  selective_p_easy: 0.3\n")
    with pytest.warns(FutureWarning, match=r"cppo.selective_rollout is deprecated: write cppo.selective.enabled"):
        assert load_recipe(recipe).cppo == nested.cppo
    with pytest.raises(RecipeError, match="unknown recipe key 'cppo.selective.p_eazy'"):
        load_recipe(None, ["cppo.selective.p_eazy=0.3"])


def test_a_round_that_skips_every_candidate_generates_the_last_one_drawn_instead_of_stopping():
    """8 prompts, each all-correct in its last 10 groups (keep probability 0.01): a round of 4 takes
    4 + 8 candidates, skips them all, and generates the 12th anyway (selective/forced_keeps); the
    trainer used to stop the run here."""
    from cppo_megatron.config import CPPOConfig, SelectiveConfig
    from cppo_megatron.trainer.selective import SelectiveRollout

    lines: list[str] = []
    sel = SelectiveRollout(CPPOConfig(selective=SelectiveConfig(enabled=True)), group_size=2, num_prompts=8,
                           warn=lines.append)
    for s in range(10):
        sel.history.update(torch.arange(8), torch.ones(8, dtype=torch.bool), torch.ones(8, dtype=torch.bool), step=s)
    sampler = PromptSampler(8, seed=0)
    sel.begin_step(10, sampler)
    twin = PromptSampler(8, seed=0)
    drawn = twin.draw(12)
    assert sel.draw(sampler, 4) == [drawn[-1]] and sampler.total_drawn == 12
    m = sel.end_step(torch.tensor([drawn[-1]]), torch.ones(2), torch.ones(2), torch.full((2,), 3))
    assert m["selective/forced_keeps"] == 1.0 and m["selective/short_rounds"] == 1.0
    assert m["selective/prompts_skipped"] == 11.0 and m["selective/prompts_generated"] == 1.0
    assert [line.split(":")[1].strip()[:31] for line in lines] == ["selective rollout skipped all 1",
                                                                   "selective rollout generated 1 o"]
    with pytest.raises(ValueError, match="2 rewards and 2 correctness flags for 2 groups x G=2"):
        sel.end_step(torch.tensor([1, 2]), torch.ones(2), torch.ones(2), torch.full((2,), 3))
