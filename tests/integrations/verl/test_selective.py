"""Selective rollout (GRESO) in veRL 0.9.1's V1 sync trainer, driven in-process through veRL's real methods.

The steps use veRL's own ``PPOTrainer._fetch_one_gen_batch`` (wrapped by ``selective.py``) over a real
``StatefulDataLoader`` with veRL's ``collate_fn``, ``_next_train_batch`` / ``_add_prompts_to_generate`` /
``_submit_batch_to_rollout``, the sync ``ReplayBuffer.sample``, the plugin's ``prune_kv_batch`` (where
outcomes are recorded) and veRL's ``_save_checkpoint`` / ``_load_checkpoint`` with stand-in workers, over
the in-memory TransferQueue of test_dapo.py. No Ray.

The data set's prompt indices are not the row numbers (``index = 100 + 17 * row % 40``), so a history
keyed by anything but the index shows. Rewards (G = 8): index % 3 == 0 all correct (easy), index % 3 == 1
all wrong (hard), otherwise varied.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from cppo_megatron.core import ExplorationRates, SelectiveHistory, fill_batch
from cppo_megatron.core.selective import prompt_uniforms
from cppo_megatron.integrations.verl import selective
from cppo_megatron.integrations.verl.runconfig import check_compatible, prepare

from .test_dapo import FakeTQ

G = 8
ROWS = 40


def index_of_row(row: int) -> int:
    return 100 + (17 * row) % ROWS


def reward(index: int, s: int) -> float:
    return 1.0 if index % 3 == 0 else 0.0 if index % 3 == 1 else (s + 1) / G


class Prompts(torch.utils.data.Dataset):
    def __init__(self, indices):
        self.indices = list(indices)

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, row):
        return {"input_ids": torch.zeros(1, dtype=torch.long), "raw_prompt": f"row {row}", "index": self.indices[row]}


class Rollout:
    """Generates G completions per prompt at once and remembers which prompt indices it generated."""

    def __init__(self, tq, trainer):
        self.tq, self.trainer, self.generated = tq, trainer, []

    def generate_sequences(self, batch):
        for uid, index in zip(batch["uid"], batch["index"], strict=True):
            self.generated.append(int(index))
            for s in range(G):
                key = f"{uid}_{s}_0"
                self.tq.tags["train"][key] = {"global_steps": self.trainer.global_steps}
                self.tq.data["train"][key] = {"uid": uid, "rm_scores": torch.tensor([0.0, reward(int(index), s)])}
            self.tq.tags["train"][uid]["status"] = "finished"


class Worker:
    def __init__(self):
        self.saved, self.loaded = [], []

    def save_checkpoint(self, path, *args, **kwargs):
        self.saved.append(path)

    def load_checkpoint(self, local_path, **kwargs):
        self.loaded.append(local_path)


class Trainer:
    """The attributes veRL's V1 methods read, with the real (wrapped) methods bound."""

    def __init__(self, config, tq, indices):
        from torchdata.stateful_dataloader import StatefulDataLoader
        from verl.trainer.ppo.v1.trainer_base import PPOTrainer
        from verl.utils.dataset.rl_dataset import collate_fn

        self.config, self.trainer_mode, self.global_steps = config, "sync", 0
        self.agent_loop_manager = Rollout(tq, self)
        self.train_dataset = Prompts(indices)
        self.train_dataloader = StatefulDataLoader(self.train_dataset, batch_size=int(config.data.gen_batch_size),
                                                   drop_last=True, collate_fn=collate_fn)
        self.train_dataloader_it = None
        self.actor_rollout_wg, self.use_critic = Worker(), False
        self.checkpoint_callback = SimpleNamespace(on_save=lambda **kwargs: None)
        for name in ("_fetch_one_gen_batch", "_next_train_batch", "_submit_batch_to_rollout",
                     "_add_prompts_to_generate", "_resolve_filter_groups_metric", "_build_replay_buffer",
                     "_save_checkpoint", "_load_checkpoint"):
            setattr(self, name, getattr(PPOTrainer, name).__get__(self))
        self.buffer = self._build_replay_buffer()
        self.buffer.poll_interval = 0.0

    def step(self, tq) -> dict:
        """One V1 sync step: prepare_step's batch, the buffer's sample, the CPPO seam, fit's cleanup."""
        from cppo_megatron.integrations.verl.hook import prune_kv_batch

        b = int(self.config.data.train_batch_size)
        self._add_prompts_to_generate(b)
        batch, metrics = self.buffer.sample(global_steps=self.global_steps, partition_id="train", batch_size=b)
        metrics = dict(metrics)
        kept = prune_kv_batch(self, batch, metrics)
        tq.kv_clear(keys=kept.keys, partition_id="train")
        assert tq.tags["train"] == {}
        return metrics


def selective_on(config, tmp_path, **keys):
    OmegaConf.update(config, "cppo.selective_rollout", True, force_add=True)
    OmegaConf.update(config, "trainer.default_local_dir", str(tmp_path / "ckpt"), force_add=True)
    for key, value in keys.items():
        OmegaConf.update(config, key.replace("__", "."), value, force_add=True)
    prepare(config)  # G = 8, P = 0.75: 4 -> 16 prompts a step; data.gen_batch_size -> 1
    return config


@pytest.fixture
def tq(monkeypatch):
    import transfer_queue

    fake = FakeTQ()
    for name in ("kv_list", "kv_batch_put", "kv_batch_get", "kv_clear"):
        monkeypatch.setattr(transfer_queue, name, getattr(fake, name))
    return fake


def run(trainer, tq, steps) -> dict[int, dict]:
    out = {}
    for step in steps:
        trainer.global_steps = step
        before = len(trainer.agent_loop_manager.generated)
        out[step] = {"metrics": trainer.step(tq), "generated": trainer.agent_loop_manager.generated[before:]}
    return out


ORDER = [index_of_row(r) for r in range(ROWS)]  # the dataloader's order (sequential sampler)


# ------------------------------------------------------------------------------------------- the seam
def test_the_seams_are_installed_and_inert_without_selective_rollout(config, tq, tmp_path):
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    from cppo_megatron.integrations.wrap import is_wrapped

    for name in selective.SEAMS:
        assert is_wrapped(PPOTrainer.__dict__[name], selective.WRAP_TAG), name
    prepare(config)
    OmegaConf.update(config, "data.gen_batch_size", 1, force_add=True)
    trainer = Trainer(config, tq, ORDER)
    trainer.global_steps = 1
    trainer.step(tq)
    assert trainer.agent_loop_manager.generated == ORDER[:16]  # veRL's order, nothing skipped
    assert not selective.has_state(trainer)


def planted_history() -> SelectiveHistory:
    """The first 20 prompts of the order, each generated once at step 0: easy (index % 3 == 0), hard
    (% 3 == 1) or varied, as the rollout would score them."""
    history = SelectiveHistory()
    ids = torch.tensor(ORDER[:20])
    zv = torch.tensor([i % 3 != 2 for i in ORDER[:20]])
    easy = torch.tensor([i % 3 == 0 for i in ORDER[:20]])
    history.update(ids, zv, easy, step=0)
    return history


@pytest.mark.parametrize("p_easy,p_hard", [(0.5, 0.5), (0.05, 0.95)])
def test_a_planted_history_skips_exactly_the_cores_ids_and_replaces_them(config, tq, tmp_path, p_easy, p_hard):
    selective_on(config, tmp_path)
    trainer = Trainer(config, tq, ORDER)
    state = selective.state_of(trainer)
    state.history = planted_history()
    state.rates = ExplorationRates(p_easy=p_easy, p_hard=p_hard)  # the rates as adaptation left them
    trainer.global_steps = 1
    (step,) = run(trainer, tq, [1]).values()
    expected = fill_batch(iter(ORDER), 16, planted_history(), seed=0, step=1,
                          rates=ExplorationRates(p_easy=p_easy, p_hard=p_hard))
    assert step["generated"] == expected.kept.tolist()  # the batch stays full: 16 generated
    assert len(step["generated"]) == 16
    m = step["metrics"]
    assert m["selective/prompts_drawn"] == expected.drawn.numel()
    assert m["selective/prompts_skipped"] == expected.skipped.numel() > 0
    # independently of decide_skips: z = 1 for every planted zero-variance prompt, so it is skipped
    # when its uniform falls below 1 - p of its kind (easy: index % 3 == 0; hard: index % 3 == 1)
    drawn = expected.drawn
    assert torch.equal(drawn, torch.tensor(ORDER[:drawn.numel()]))
    u = prompt_uniforms(drawn, seed=0, step=1)
    planted = torch.tensor([i < 20 and ORDER[i] % 3 != 2 for i in range(drawn.numel())])
    p = torch.tensor([p_easy if int(i) % 3 == 0 else p_hard for i in drawn], dtype=torch.float64)
    should_skip = planted & (u < 1 - p)
    assert drawn[should_skip].tolist() == expected.skipped.tolist() == [
        i for i in drawn.tolist() if i not in step["generated"]]
    # exploration: some planted zero-variance prompts were generated all the same
    assert set(step["generated"]) & {i for i in ORDER[:20] if i % 3 != 2}


def test_every_prompt_drawn_is_generated_or_skipped_and_outcomes_are_keyed_by_prompt_index(config, tq, tmp_path):
    selective_on(config, tmp_path)
    trainer = Trainer(config, tq, ORDER)
    state = selective.state_of(trainer)
    steps, position = {}, 0
    for s in range(1, 7):
        # each step takes the core's decisions over the dataloader's order, with the history and the
        # (adapted) rates as the previous step left them
        history = SelectiveHistory()
        history.load_state_dict(state.history.state_dict())
        endless = (ORDER[(position + j) % ROWS] for j in range(10 * ROWS))
        expected = fill_batch(endless, 16, history, seed=0, step=s, rates=state.rates)
        steps.update(run(trainer, tq, [s]))
        assert steps[s]["generated"] == expected.kept.tolist(), s
        assert steps[s]["metrics"]["selective/prompts_drawn"] == expected.drawn.numel()
        position += expected.drawn.numel()
    drawn_total = 0
    for s, step in steps.items():
        m = step["metrics"]
        assert m["selective/prompts_generated"] == len(step["generated"]) == 16
        assert m["selective/prompts_drawn"] == m["selective/prompts_generated"] + m["selective/prompts_skipped"]
        assert m["selective/groups_recorded"] == 16 and m["selective/groups_unrecorded"] == 0
        assert m["selective/skipped_easy"] + m["selective/skipped_hard"] == m["selective/prompts_skipped"]
        drawn_total += int(m["selective/prompts_drawn"])
        for index in step["generated"]:  # filed under its prompt index, with the outcome its rewards had
            steps_of, outcomes = state.history.trace(index)
            assert s in steps_of.tolist()
            outcome = int(outcomes[steps_of.tolist().index(s)])
            assert outcome == (1 if index % 3 == 0 else 2 if index % 3 == 1 else 0), (s, index, outcome)
    assert sum(int(steps[s]["metrics"]["selective/prompts_skipped"]) for s in steps) > 0
    assert state.totals["prompts_drawn"] == drawn_total
    # the dataloader moved past every drawn prompt: the next one it hands is the one after
    assert next(trainer.train_dataloader_it)["index"][0] == ORDER[drawn_total % ROWS]
    logged = set(state.history.state_dict()["prompt_ids"].tolist())
    assert logged == {i for step in steps.values() for i in step["generated"]}  # prompt indices, not positions
    # the rates moved once the first pass had ended (step 1-2 drew fewer than 40 prompts)
    adapted = [steps[s]["metrics"]["selective/adapted"] for s in steps]
    assert adapted[0] == 0.0 and adapted[-1] == 1.0
    assert state.rates != ExplorationRates(p_easy=0.5, p_hard=0.5)


def test_a_resumed_run_takes_the_decisions_of_an_uninterrupted_one(config, tq, tmp_path):
    selective_on(config, tmp_path)
    straight = Trainer(config, tq, ORDER)
    whole = run(straight, tq, range(1, 7))

    first = Trainer(config, tq, ORDER)
    part = run(first, tq, range(1, 4))
    first._save_checkpoint()  # at global_steps 3, veRL's own method (fit calls it after the step)
    folder = tmp_path / "ckpt" / "global_step_3"
    assert (folder / selective.STATE_FILE).is_file() and (folder / "data.pt").is_file()
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "3"

    resumed = Trainer(config, tq, ORDER)
    resumed._load_checkpoint()  # resume_mode auto: veRL finds global_step_3
    assert resumed.global_steps == 3 and resumed.actor_rollout_wg.loaded
    rest = run(resumed, tq, range(4, 7))
    assert [part[s]["generated"] for s in (1, 2, 3)] + [rest[s]["generated"] for s in (4, 5, 6)] == [
        whole[s]["generated"] for s in range(1, 7)]
    assert [rest[s]["metrics"] for s in (4, 5, 6)] == [whole[s]["metrics"] for s in (4, 5, 6)]
    a, b = selective.state_of(straight), selective.state_of(resumed)
    assert a.rates == b.rates and a.totals == b.totals
    sa, sb = a.history.state_dict(), b.history.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in ("prompt_ids", "steps", "outcomes"))


def test_a_checkpoint_without_selective_state_resumes_empty_and_says_so(config, tq, tmp_path):
    selective_on(config, tmp_path)
    trainer = Trainer(config, tq, ORDER)
    run(trainer, tq, [1])
    trainer._save_checkpoint()
    (tmp_path / "ckpt" / "global_step_1" / selective.STATE_FILE).unlink()
    resumed = Trainer(config, tq, ORDER)
    with pytest.warns(UserWarning, match="has no selective-rollout state"):
        resumed._load_checkpoint()
    assert selective.state_of(resumed).history.num_prompts == 0


# ------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    "key,value,message",
    [
        ("trainer.use_v1", False, "cppo.selective_rollout=true with trainer.use_v1=false: the hook sits in the V1 "
         "trainer's dataloader seam (PPOTrainer._fetch_one_gen_batch); the legacy loop (RayPPOTrainer.fit) is not "
         "hooked. Set trainer.use_v1=true or cppo.selective_rollout=false"),
        ("trainer.v1.trainer_mode", "colocate_async", "set trainer.v1.trainer_mode=sync"),
        ("trainer.v1.trainer_mode", "separate_async", "trainer.v1.trainer_mode=separate_async: the asynchronous"),
        ("algorithm.filter_groups.enable", True, "with algorithm.filter_groups.enable=true: DAPO's filter evicts"),
        ("trainer.v1.sampler.custom_sampler", {"path": "my.py", "name": "Mine"},
         "trainer.v1.sampler.custom_sampler.name=Mine: a custom replay buffer"),
        ("data.gen_batch_size", 4, "data.gen_batch_size=4: the hook replaces each skipped prompt"),
    ],
)
def test_what_the_hook_does_not_honour_is_refused(config, key, value, message):
    OmegaConf.update(config, "cppo.selective_rollout", True, force_add=True)
    OmegaConf.update(config, key, value, force_add=True, merge=False)
    with pytest.raises(ValueError) as err:
        check_compatible(config)
    assert message in str(err.value)


def test_prepare_sets_one_prompt_per_fetch_and_warns_only_when_off(config):
    OmegaConf.update(config, "cppo.selective_rollout", True, force_add=True)
    OmegaConf.update(config, "cppo.selective_p_hard", 0.2, force_add=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        prepare(config)
    assert config.data.gen_batch_size == 1


@pytest.mark.parametrize("indices,match", [
    ([0] * ROWS, "prompt index 0 was drawn twice in step 1 within 2 draws from a data set of 40 prompts: the index "
                 "is the key of each prompt's history and must be unique. veRL sets index 0 when a row has no "
                 "extra_info.index"),
    ([5, 6, 5] + list(range(7, 7 + ROWS - 3)), "prompt index 5 was drawn twice in step 1 within 3 draws"),
])
def test_indices_that_are_not_unique_are_refused_naming_the_fix(config, tq, tmp_path, indices, match):
    selective_on(config, tmp_path)
    trainer = Trainer(config, tq, indices)
    trainer.global_steps = 1
    with pytest.raises(ValueError, match=match):
        trainer._add_prompts_to_generate(16)


def test_a_fetch_of_several_prompts_is_refused(config, tq, tmp_path):
    selective_on(config, tmp_path)
    OmegaConf.update(config, "data.gen_batch_size", 2)
    trainer = Trainer(config, tq, ORDER)
    trainer.global_steps = 1
    with pytest.raises(ValueError, match="handed 2 prompts in one fetch; .* set data.gen_batch_size=1"):
        trainer._add_prompts_to_generate(16)


def test_state_round_trip_and_bad_state(config):
    state = selective.VerlSelective(selective.cppo_config_from(config), num_prompts=4)
    state.history = planted_history()
    state.rates = ExplorationRates(p_easy=0.3, p_hard=0.7)
    other = selective.VerlSelective(selective.cppo_config_from(config), num_prompts=4)
    other.load_state_dict(state.state_dict())
    assert other.rates == state.rates and other.history.num_events == state.history.num_events
    with pytest.raises(ValueError, match="must have history, rates and totals, got"):
        other.load_state_dict({"history": {}})
    bad = state.state_dict()
    bad["totals"]["tokens"] = 1.0
    with pytest.raises(ValueError, match=r"unknown counter\(s\) \['tokens'\]"):
        other.load_state_dict(bad)
    assert np.isfinite(other.totals["prompts_drawn"])
