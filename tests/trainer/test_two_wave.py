"""Two waves in the embedded trainer (``cppo.two_wave``, trainer/two_wave.py): planted rewards make
known groups finish and the others not; the engine generates k per prompt then G - k for the
finished groups only; unfinished groups are never trained and always counted; P = 0 is GRPO + two
waves; dynamic sampling refills; resume restores the totals and samples as the straight run; the
refusals launch nothing."""

from __future__ import annotations

import dataclasses
import json
import types
import zlib

import pytest
import torch

from cppo_megatron.tasks import Score, build_task
from cppo_megatron.trainer import Trainer
from cppo_megatron.trainer.config import RecipeError, load_recipe
from tests.recipes import MICRO

TW = ["cppo.two_wave.enabled=true"]  # MICRO: G = 4, P = 0.5 (k = 2 kept), capacity 16 -> 8 prompts, first wave 2


def _recipe(tmp_path, *overrides):
    return load_recipe(None, MICRO + [f"out_dir={tmp_path / 'run'}", *TW, *overrides])


def varied(question: str) -> bool:
    """The planted rule: a prompt whose question hashes even gets alternating outcomes (1, 0, 1, 0,
    ...: any two completions differ), any other prompt is always correct (its first wave agrees)."""
    return zlib.crc32(question.encode()) % 2 == 0


class PlantedTask:
    """The micro task with the planted scorer; records every completion it scored."""

    def __init__(self, recipe) -> None:
        self.base = build_task(recipe.task)
        self.calls: dict[str, int] = {}
        self.scored: list[str] = []
        self.task = dataclasses.replace(self.base, scorer=self._score)

    def _score(self, text: str, problem) -> Score:
        self.scored.append(problem.question)
        n = self.calls.get(problem.question, 0)
        self.calls[problem.question] = n + 1
        ok = n % 2 == 0 if varied(problem.question) else True
        return Score(correct=float(ok), formatted=1.0)


def _trainer(tmp_path, *overrides, resume=False):
    recipe = _recipe(tmp_path, *overrides)
    planted = PlantedTask(recipe)
    t = Trainer(recipe, task=planted.task, resume=resume)
    t.prepare(initial_eval=False)
    return t, planted


def _step(t):
    """One step; what the engine was asked (prompts, n per call), the batch, the trained rows."""
    cap: dict = {"calls": []}
    gen, update, end = t.rollout.generate, t.backend.update, t.two_wave.end_step

    def generate(problems, seed, timer, monitor=None, n=None):
        cap["calls"].append((len(problems), n))
        return gen(problems, seed, timer, monitor, n)

    def upd(rows, *a, **k):
        cap["trained"] = rows.rows.clone()
        return update(rows, *a, **k)

    def end_step(batch, kept):
        cap["batch"], cap["kept"] = batch, kept
        return end(batch, kept)

    t.rollout.generate, t.backend.update, t.two_wave.end_step = generate, upd, end_step
    try:
        cap["rec"] = t.step_once()
    finally:
        t.rollout.generate, t.backend.update, t.two_wave.end_step = gen, update, end
    return cap


def _expected_finish(t, batch) -> list[bool]:
    return [varied(t.task.train[int(i)].question) for i in batch.prompt_ids]


def test_planted_rewards_finish_exactly_the_varied_groups_and_every_completion_is_counted(tmp_path):
    t, planted = _trainer(tmp_path)
    for step in range(2):
        before = len(planted.scored)
        cap = _step(t)
        batch, rec = cap["batch"], cap["rec"]
        finish = _expected_finish(t, batch)
        n, f = len(finish), sum(finish)
        assert 0 < f < n, "the planted rule leaves both kinds of group in the step"
        # the engine: k = 2 per prompt, then G - k = 2 for the f finished prompts only
        assert cap["calls"] == [(n, 2), (f, 2)]
        generated = 2 * n + 2 * f
        assert len(planted.scored) - before == generated  # every generated completion scored, nothing else
        assert rec["two_wave/completions_generated"] == generated == rec["alloc/completions_generated"]
        assert rec["rollout/completions"] == generated and rec["two_wave/completions_full"] == 4 * n
        assert rec["two_wave/groups_finished"] == f and rec["two_wave/groups_unfinished"] == n - f
        assert rec["two_wave/finished_share"] == pytest.approx(f / n)
        assert rec["two_wave/completions_unfinished"] == 2 * (n - f) == rec["alloc/prompts_dropped"] * 2
        # the batch: finished groups whole, unfinished ones with their last G - k rows absent
        absent = batch.absent.reshape(n, 4)
        assert absent[:, :2].sum() == 0
        assert absent[:, 2:].all(1).tolist() == [not x for x in finish]
        assert batch.valid_groups.tolist() == [g for g in range(n) if finish[g]]
        assert rec["rollout/tokens"] == rec["two_wave/tokens_generated"] == float(batch.completion_lengths.sum())
        # trained: only rows of finished groups; kept + pruned + unfinished = generated
        groups_trained = set((cap["trained"] // 4).tolist())
        assert groups_trained <= {g for g in range(n) if finish[g]}
        assert rec["cppo/num_kept"] + rec["cppo/num_pruned"] + rec["two_wave/completions_unfinished"] == generated
        assert rec["two_wave/completions_trained"] == rec["cppo/num_kept"] == 2 * f  # k = 2 of each finished group
        assert rec["two_wave/total_completions_generated"] > 0 and rec["two_wave/total_steps"] == step + 1
    # the audit: one line per step, what was decided and why
    lines = [json.loads(x) for x in (t.out / "two_wave.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2]
    last = lines[-1]
    assert last["finished"] == _expected_finish(t, cap["batch"]) and last["first_wave"] == 2
    assert len(last["first_wave_rewards"]) == 2 * len(last["finished"])
    assert last["kept"] == cap["kept"].tolist()


def test_grpo_with_two_waves_trains_every_completion_of_the_finished_groups(tmp_path):
    t, _ = _trainer(tmp_path, "cppo.pruning_rate=0.0")
    cap = _step(t)
    batch = cap["batch"]
    finish = _expected_finish(t, batch)
    rows = [g * 4 + j for g in range(len(finish)) if finish[g] for j in range(4)]
    assert sorted(cap["trained"].tolist()) == rows
    assert cap["rec"]["cppo/num_pruned"] == 0.0


def test_keep_mass_fill_rounds_select_among_the_finished_groups_only(tmp_path):
    """keep_mass with allocation: fill rounds draw prompts until the survivors fill the capacity; every
    survivor is a row of a finished group, and the accounting still closes."""
    t, _ = _trainer(tmp_path, "cppo.pruning_rate=null", "cppo.keep_mass=0.9")
    cap = _step(t)
    rec, batch = cap["rec"], cap["batch"]
    finish = _expected_finish(t, batch)
    assert set((cap["kept"] // 4).tolist()) <= {g for g in range(len(finish)) if finish[g]}
    assert rec["cppo/num_kept"] + rec["cppo/num_pruned"] + rec["two_wave/completions_unfinished"] == \
        rec["two_wave/completions_generated"] == rec["alloc/completions_generated"]


def test_dynamic_sampling_refills_the_unfinished_groups(tmp_path):
    t, _ = _trainer(tmp_path, "cppo.dynamic_sampling=true", "cppo.max_refill_rounds=3")
    cap = _step(t)
    rec, batch = cap["rec"], cap["batch"]
    assert rec["alloc/refill_rounds"] >= 1 and batch.rounds == 1 + rec["alloc/refill_rounds"]
    # each round runs its own two waves: k per prompt of the round, then G - k for its varied ones
    assert len(cap["calls"]) == 2 * batch.rounds
    finish = _expected_finish(t, batch)
    assert rec["two_wave/groups"] == len(finish) and rec["two_wave/groups_finished"] == sum(finish)
    assert rec["two_wave/completions_generated"] == rec["alloc/completions_generated"] == 2 * len(finish) + 2 * sum(finish)


def test_resume_restores_the_totals_and_samples_what_the_straight_run_did(tmp_path):
    straight, _ = _trainer(tmp_path / "a")
    recs = [_step(straight)["rec"] for _ in range(2)]
    first, _ = _trainer(tmp_path / "b")
    _step(first)
    first._checkpoint()
    resumed, _ = _trainer(tmp_path / "b", resume=True)
    assert resumed.two_wave.totals == first.two_wave.totals
    rec = _step(resumed)["rec"]
    for key in ("two_wave/groups_finished", "two_wave/tokens_generated", "two_wave/total_completions_generated",
                "two_wave/total_tokens_generated"):
        assert rec[key] == recs[1][key], key


def test_resume_from_a_checkpoint_without_two_wave_state_says_so(tmp_path, capsys):
    t, _ = _trainer(tmp_path)
    _step(t)
    t._checkpoint()
    state_file = next((tmp_path / "run" / "checkpoints").glob("step_*")) / "trainer.pt"
    state = torch.load(state_file, weights_only=False)
    state.pop("two_wave")
    torch.save(state, state_file)
    resumed, _ = _trainer(tmp_path, resume=True)
    assert resumed.two_wave.totals.steps == 0
    assert "no two-wave state" in capsys.readouterr().err


def test_refusals_name_the_key_and_launch_nothing(tmp_path):
    with pytest.raises(RecipeError, match=r"cppo.two_wave.enabled needs backend=hf .* set backend=hf or "
                                          r"cppo.two_wave.enabled=false"):
        _recipe(tmp_path, "backend=megatron")
    with pytest.raises(RecipeError, match="cppo.two_wave.first_wave=4 must be smaller than rollout.group_size=4"):
        _recipe(tmp_path, "cppo.two_wave.first_wave=4")
    with pytest.raises(RecipeError, match="cppo.two_wave does not combine with cppo.early_stop.enabled"):
        _recipe(tmp_path, "cppo.early_stop.enabled=true")
    # the loop's own guard (a recipe object built past the check): refused before any engine is built
    stub = types.SimpleNamespace(r=_recipe(tmp_path), distributed=True, early_stop=None, two_wave=object())
    with pytest.raises(ValueError, match="cppo.two_wave runs with backend=hf"):
        Trainer._build_rollout(stub)


def test_two_waves_refuse_what_they_cannot_account_for(tmp_path):
    from cppo_megatron.config import CPPOConfig
    from cppo_megatron.trainer.two_wave import TwoWaves

    with pytest.raises(ValueError, match="enabled=true"):
        TwoWaves(CPPOConfig(pruning_rate=0.5), group_size=4)
    tw = TwoWaves(CPPOConfig(pruning_rate=0.5, two_wave={"enabled": True}), group_size=4)
    tw.begin_step(0)
    tw.finish.append(torch.tensor([True, False]))
    batch = types.SimpleNamespace(num_rows=12)
    with pytest.raises(RuntimeError, match="the step's rounds cover 2 groups, the batch has 3"):
        tw.end_step(batch, torch.tensor([0]))
    batch = types.SimpleNamespace(num_rows=8)
    with pytest.raises(RuntimeError, match=r"rows \[4\] of unfinished groups were kept"):
        tw.end_step(batch, torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="first_wave=2 of G=4, this run with 2 of 8"):
        TwoWaves(CPPOConfig(two_wave={"enabled": True, "first_wave": 2}), group_size=8).load_state_dict(
            tw.state_dict())


def test_a_step_where_no_group_finishes_names_the_keys(tmp_path, monkeypatch):
    """Every first wave agrees: the second wave generates nothing, and the step stops with a message
    naming what to change (as a step the DAPO filter empties does)."""
    import tests.trainer.test_two_wave as me

    monkeypatch.setattr(me, "varied", lambda question: False)
    t, planted = _trainer(tmp_path)
    with pytest.raises(RuntimeError, match=r"every group's first wave had equal rewards .* raise "
                                           r"cppo.two_wave.first_wave, lower cppo.two_wave.min_spread, or enable "
                                           r"cppo.dynamic_sampling"):
        _step(t)
    assert len(planted.scored) == 8 * 2  # the first waves alone: 8 prompts x k = 2


class _StubRollout:
    """Our own boundary, ``LocalRollout.generate`` / ``seed``, answering by value: completion j of a
    call is [call, j], its reward from ``rewards`` in call order, with sampler log-probs (vLLM's)."""

    def __init__(self, rewards):
        self.rewards, self.calls = list(rewards), []

    def seed(self, step, round_, wave=0):
        return 100 * step + 10 * round_ + wave

    def generate(self, problems, seed, timer, monitor=None, n=None):
        self.calls.append((len(problems), n, seed))
        c = len(self.calls)
        rows = len(problems) * n
        rewards = [self.rewards.pop(0) for _ in range(rows)]
        return {"prompts": [[c, j // n] for j in range(rows)], "completions": [[c, j] for j in range(rows)],
                "rewards": rewards, "correct": rewards, "formatted": [1.0] * rows, "truncated": [False] * rows,
                "logprobs": [torch.full((2,), float(c)) for _ in range(rows)], "seconds": 0.5, "stopped": None}


def test_waves_are_merged_into_the_group_layout_by_value():
    """G = 4, k = 2, three prompts; first waves [1, 0] (finish), [1, 1] (not), [0, 1] (finish)."""
    from cppo_megatron.config import CPPOConfig
    from cppo_megatron.trainer.two_wave import TwoWaves

    tw = TwoWaves(CPPOConfig(pruning_rate=0.0, two_wave={"enabled": True}), group_size=4)  # no audit file
    tw.begin_step(3)
    stub = _StubRollout([1.0, 0.0, 1.0, 1.0, 0.0, 1.0] + [0.0, 0.0, 1.0, 1.0])
    out = tw.generate(stub, ["a", "b", "c"], step=3, round_=1, timer=None)
    assert stub.calls == [(3, 2, 310), (2, 2, 311)]  # wave 2: its own seed, the 2 varied prompts only
    assert out["completions"] == [[1, 0], [1, 1], [2, 0], [2, 1], [1, 2], [1, 3], [], [], [1, 4], [1, 5],
                                  [2, 2], [2, 3]]
    assert out["rewards"] == [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    assert out["absent"] == [False] * 6 + [True, True] + [False] * 4
    assert out["prompts"][6] == out["prompts"][4] == [1, 1]  # an absent row keeps its group's prompt
    assert [lp.tolist() for lp in out["logprobs"]][:3] == [[1.0, 1.0], [1.0, 1.0], [2.0, 2.0]]
    assert out["logprobs"][6].numel() == 0 and out["seconds"] == 1.0
    lengths = torch.tensor([2] * 6 + [0, 0] + [2] * 4)
    batch = types.SimpleNamespace(num_rows=12, completion_lengths=lengths, absent=torch.tensor(out["absent"]),
                                  prompt_ids=torch.tensor([7, 8, 9]))
    m = tw.end_step(batch, torch.tensor([0, 1, 2, 3, 8, 9, 10, 11]))
    assert (m["two_wave/groups_finished"], m["two_wave/completions_generated"], m["two_wave/tokens_generated"]) == \
        (2.0, 10.0, 20.0)


def test_vllm_seeds_each_wave_from_the_run_seed_step_and_round():
    """Wave 1 keeps the seed a one-wave round had (mix_seed(seed, step, round)); wave 2 its own; HF: the
    checkpointed global RNG (None)."""
    from cppo_megatron.rollout import mix_seed
    from cppo_megatron.trainer.distribution import LocalRollout

    stub = types.SimpleNamespace(r=types.SimpleNamespace(seed=5, rollout=types.SimpleNamespace(engine="vllm")))
    assert LocalRollout.seed(stub, 2, 1) == mix_seed(5, 2, 1) == LocalRollout.seed(stub, 2, 1, wave=0)
    assert LocalRollout.seed(stub, 2, 1, wave=1) == mix_seed(5, 2, 1, 1) != mix_seed(5, 2, 1)
    stub.r.rollout.engine = "hf"
    assert LocalRollout.seed(stub, 2, 1, wave=1) is None
