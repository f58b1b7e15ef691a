"""DAPO's filter (algorithm.filter_groups) with CPPO in veRL 0.9.1: the guards, and the accounting of
every prompt drawn, driven through veRL's real sync ReplayBuffer and trainer methods in-process.

The in-process steps use veRL's own ``ReplayBuffer.sample`` (filter, 2-credit refill, drain,
surplus discard), ``PPOTrainer._build_replay_buffer`` / ``_submit_batch_to_rollout`` /
``_add_prompts_to_generate`` and the plugin's V1 ``prune_kv_batch``, over an in-memory stand-in of
TransferQueue's four calls and a rollout that "generates" G completions per prompt at once (by
dataset row mod 4: 0 equal rewards and equal acc; 1 equal rewards, varied acc; 2 varied rewards,
equal acc; 3 both varied), with the audit recorders of ``dapo.py`` wrapped in, under ``metric=reward``
and ``metric=acc`` (veRL's DAPO scripts' choice: a reward_extra_info field).
"""

from __future__ import annotations

import uuid
from collections import Counter, defaultdict

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from cppo_megatron.integrations.verl.dapo import StepAccount, account_step, check_filter_groups
from cppo_megatron.integrations.verl.runconfig import check_compatible, host_warnings, prepare

G = 8


def dapo(config, **keys):
    OmegaConf.update(config, "algorithm.filter_groups.enable", True, force_add=True)
    for key, value in keys.items():
        OmegaConf.update(config, key.replace("__", "."), value, force_add=True)
    return config


# ------------------------------------------------------------------------------------------ guards
@pytest.mark.parametrize(
    "key,value,message",
    [
        ("trainer.use_v1", False,
         "algorithm.filter_groups.enable=True with trainer.use_v1=False: veRL 0.9.1's legacy loop "
         "(RayPPOTrainer.fit) never reads algorithm.filter_groups, so every group would train unfiltered; set "
         "trainer.use_v1=true (its sync replay buffer filters and refills) or algorithm.filter_groups.enable=false"),
        ("trainer.v1.trainer_mode", "colocate_async", "trainer.v1.trainer_mode=colocate_async: the asynchronous "),
        ("trainer.v1.trainer_mode", "separate_async", "set trainer.v1.trainer_mode=sync"),
        ("algorithm.filter_groups.metric", None,
         "algorithm.filter_groups.enable=True without algorithm.filter_groups.metric: veRL stops in the TaskRunner "
         "(trainer_base.py:196); set algorithm.filter_groups.metric=reward"),
        ("algorithm.filter_groups.metric", "", "without algorithm.filter_groups.metric"),
        ("trainer.v1.sampler.custom_sampler", {"path": "my.py", "name": "Mine"},
         "trainer.v1.sampler.custom_sampler.name=Mine: veRL hands algorithm.filter_groups to its built-in"),
        ("reward.reward_model.enable", True,
         "reward.reward_model.enable=True and reward.reward_model.enable_resource_pool=False: a colocated"),
    ],
)
def test_what_veRL_cannot_honour_is_refused_naming_key_value_and_fix(config, key, value, message):
    OmegaConf.update(dapo(config), key, value, force_add=True, merge=False)
    with pytest.raises(ValueError) as err:
        check_compatible(config)
    assert message in str(err.value)
    assert config.data.train_batch_size == 4  # refused before allocation changed anything


def test_the_filter_off_is_never_refused_and_on_v1_sync_it_passes(config):
    OmegaConf.update(config, "trainer.use_v1", False)
    check_filter_groups(config)  # filter off: the legacy loop is fine
    with pytest.raises(TypeError, match="expected a veRL config mapping, got int"):
        check_filter_groups(3)
    OmegaConf.update(dapo(config), "trainer.use_v1", True)
    check_compatible(config)


@pytest.mark.parametrize("metric", ["reward", "acc", "score", "seq_reward"])
def test_every_metric_veRL_accepts_passes_and_is_the_one_veRL_filters_on(config, metric):
    """veRL takes any non-empty name (trainer_base.py:194-196): ``reward`` reads rm_scores, another
    name a reward_extra_info field (replay_buffer.py:278-302); the plugin passes each through."""
    from cppo_megatron.integrations.verl.dapo import filter_metric

    assert filter_metric(config) is None  # the filter off
    OmegaConf.update(dapo(config), "algorithm.filter_groups.metric", metric, force_add=True)
    check_compatible(config)
    prepare(config)
    assert filter_metric(config) == metric
    assert Trainer(config, {}).buffer.filter_groups_metric == metric


def test_max_num_gen_batches_warns_that_veRL_ignores_it(config):
    assert host_warnings(dapo(config)) == []
    OmegaConf.update(config, "algorithm.filter_groups.max_num_gen_batches", 3)
    (line,) = host_warnings(config)
    assert line.startswith("algorithm.filter_groups.max_num_gen_batches=3 is ignored by veRL 0.9.1's V1 replay buffer")


def test_allocation_and_the_refill_agree_on_the_prompts_to_draw(config):
    """veRL builds its buffer from the config allocation grew: the batch it fills with groups that
    carry a reward signal (and the in-flight bound of its refill) is the allocated prompt count."""
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    plan = prepare(dapo(config))  # G = 8, P = 0.75: 4 -> 16 prompts
    buffer = Trainer(config, {}).buffer
    assert buffer.filter_groups_metric == "reward" and buffer.gen_batch_size == 1
    assert buffer.train_batch_size == plan.train_batch_size == 16
    assert PPOTrainer._build_replay_buffer.__qualname__ == "PPOTrainer._build_replay_buffer"


# ------------------------------------------------------------------------------- in-process steps
class FakeTQ:
    """TransferQueue's kv_list / kv_batch_put / kv_batch_get / kv_clear over dicts."""

    def __init__(self):
        self.tags: dict[str, dict] = defaultdict(dict)
        self.data: dict[str, dict] = defaultdict(dict)

    def kv_list(self, partition_id=None):
        return {p: dict(t) for p, t in self.tags.items() if partition_id in (None, p)}

    def kv_batch_put(self, keys, partition_id, tags=None, fields=None):
        for key, tag in zip(keys, tags, strict=True):
            self.tags[partition_id][key] = dict(tag)

    def kv_batch_get(self, keys, partition_id, select_fields=None):
        rows = [self.data[partition_id][k] for k in keys]
        out = {f: [r[f] for r in rows] for f in select_fields}
        if "rm_scores" in out:
            out["rm_scores"] = torch.stack(out["rm_scores"]) if rows else torch.zeros(0, 1)
        if "response_mask" in out and rows:  # jagged, as TransferQueue holds it
            out["response_mask"] = torch.nested.as_nested_tensor(out["response_mask"], layout=torch.jagged)
        return out

    def kv_clear(self, keys, partition_id):
        for key in keys:
            self.tags[partition_id].pop(key, None)
            self.data[partition_id].pop(key, None)


def reward_of(index: int, s: int) -> tuple[float, float]:
    """(score, acc) of completion ``s`` of dataset row ``index``, by the row mod 4: 0 both equal; 1 score
    equal, acc varied (acc's filter passes a group without reward signal); 2 score varied, acc equal
    (acc's filter drops a group with a reward signal); 3 both varied."""
    score = 0.5 if index % 4 in (0, 1) else (s + 1) / G
    acc = 0.0 if index % 4 in (0, 2) else float(s % 2)
    return score, acc


class Rollout:
    """Generates G completions per prompt at once, scored by ``reward_of``: ``rm_scores`` holds the
    score, ``extra_fields.reward_extra_info`` the score and acc (what veRL's reward loop stores)."""

    def __init__(self, tq, trainer):
        self.tq, self.trainer = tq, trainer

    def generate_sequences(self, batch):
        for uid, index in zip(batch["uid"], batch["index"], strict=True):
            for s in range(G):
                key = f"{uid}_{s}_0"
                score, acc = reward_of(int(index), s)
                self.tq.tags["train"][key] = {"global_steps": self.trainer.global_steps}
                self.tq.data["train"][key] = {"uid": uid, "index": index,  # every veRL row has a mask
                                              "rm_scores": torch.tensor([0.0, score]),
                                              "response_mask": torch.ones(2, dtype=torch.int64),
                                              "extra_fields": {"reward_extra_info": {"score": score, "acc": acc}}}
            self.tq.tags["train"][uid]["status"] = "finished"


class Trainer:
    """The attributes veRL's V1 methods read, with the real methods bound."""

    def __init__(self, config, tq, seed=0):
        from verl.trainer.ppo.v1.trainer_base import PPOTrainer

        self.config, self.trainer_mode, self.global_steps = config, "sync", 0
        self.agent_loop_manager = Rollout(tq, self)
        self._rows = iter(np.random.default_rng(seed).permutation(10_000).tolist())
        for name in ("_submit_batch_to_rollout", "_add_prompts_to_generate", "_resolve_filter_groups_metric",
                     "_build_replay_buffer"):
            setattr(self, name, getattr(PPOTrainer, name).__get__(self))
        self.buffer = self._build_replay_buffer()
        self.buffer.poll_interval = 0.0

    def _next_train_batch(self, num_prompts=None):
        from verl.utils import tensordict_utils as tu

        n = num_prompts or int(self.config.data.train_batch_size)
        return tu.get_tensordict({"input_ids": torch.zeros(n, 1),
                                  "uid": np.array([uuid.uuid4().hex for _ in range(n)], dtype=object),
                                  "index": np.array([next(self._rows) for _ in range(n)], dtype=object)})


@pytest.fixture(params=["reward", "acc"])
def dapo_steps(request, config, tmp_path, monkeypatch, audit_on):
    """Two sync steps of DAPO then CPPO (P = 0.75, 16 prompts allocated) filtering on ``metric``,
    audited; returns (metric, records, {step: prune metrics})."""
    import transfer_queue

    from cppo_megatron.integrations.verl.diagnostics import audit
    from cppo_megatron.integrations.verl import dapo as dapo_module
    from cppo_megatron.integrations.verl.hook import prune_kv_batch
    from cppo_megatron.integrations.wrap import wrapped

    tq = FakeTQ()
    for name in ("kv_list", "kv_batch_put", "kv_batch_get", "kv_clear"):
        monkeypatch.setattr(transfer_queue, name, getattr(tq, name))
    audit_on(tmp_path)
    prepare(dapo(config, algorithm__filter_groups__metric=request.param))
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    rec = {name: f for methods in dapo_module.recorders(audit.record).values() for name, f in methods.items()}
    with (wrapped(PPOTrainer, "_submit_batch_to_rollout", rec["_submit_batch_to_rollout"], tag=audit.WRAP_TAG),
          wrapped(ReplayBuffer, "_evict_terminal_groups", rec["_evict_terminal_groups"], tag=audit.WRAP_TAG),
          wrapped(ReplayBuffer, "_clear_groups", rec["_clear_groups"], tag=audit.WRAP_TAG)):
        trainer = Trainer(config, tq)
        metrics = {}
        for step in (1, 2):
            trainer.global_steps = step
            trainer._add_prompts_to_generate(int(config.data.train_batch_size))  # prepare_step's batch
            batch, veRL_metrics = trainer.buffer.sample(global_steps=step, partition_id="train",
                                                        batch_size=int(config.data.train_batch_size))
            metrics[step] = dict(veRL_metrics)
            kept = prune_kv_batch(trainer, batch, metrics[step])
            tq.kv_clear(keys=kept.keys, partition_id="train")  # fit's step-end cleanup
        assert tq.tags["train"] == {}  # the sync buffer carries nothing into the next step
    return request.param, audit.read(tmp_path), metrics


def test_every_prompt_drawn_is_filtered_discarded_or_passed_to_cppo(dapo_steps):
    metric, records, metrics = dapo_steps
    row_of = {u: i for r in records if r["kind"] == "draw" for u, i in zip(r["uids"], r["prompts"], strict=True)}
    # the filter's verdict by dataset row mod 4: under reward rows 2 and 3 vary, under acc rows 1 and 3
    passing = {2, 3} if metric == "reward" else {1, 3}
    for step in (1, 2):
        acc = account_step(records, step, G)
        assert acc.problems() == [], acc.problems()
        assert acc.metric == metric
        assert len(acc.drawn) == len(acc.filtered) + len(acc.surplus) + len(acc.passed) and not acc.carried
        assert acc.filtered and len(acc.passed) == 16 and acc.kept == 32 and acc.pruned == 16 * G - 32
        assert acc.completions_generated == G * len(acc.drawn)
        assert {row_of[u] % 4 for u in acc.filtered} == {0, 1, 2, 3} - passing
        assert {row_of[u] % 4 for u in acc.passed + acc.surplus} == passing
        # groups that passed with all rewards equal: none under reward, exactly the rows 1 mod 4 under acc,
        # counted by the hook and named in the prune record
        equal = tuple(u for u in acc.passed if row_of[u] % 4 == 1)
        assert acc.zero_variance_passed == equal and (metric == "reward") is (equal == ())
        (pr,) = [r for r in records if r["kind"] == "prune" and r["step"] == step]
        assert pr["filter_metric"] == metric and pr["filter_passed_zero_variance"] == list(equal)
        assert metrics[step]["cppo/filter_passed_zero_variance"] == len(equal)
        assert metrics[step]["cppo/zero_variance_groups"] == len(equal)  # the core's count agrees
        # cppo.scope=group (the default) keeps k = 2 of every group, these too (advantage 0: no policy-gradient
        # signal); scope=batch prunes them first (tests/core/test_selection.py::test_zero_variance_groups_are_...)
        kept_per_uid = Counter(pr["uids"][i] for i in pr["kept"])
        assert all(kept_per_uid[u] == 2 for u in acc.passed), kept_per_uid
        # veRL's own counters say the same
        assert metrics[step]["training/filter_groups/evicted_samples"] == len(acc.filtered)
        assert metrics[step].get("training/filter_groups/discarded_surplus_samples", 0) == len(acc.surplus)
        assert metrics[step]["cppo/num_kept"] == 32
    if metric == "acc":  # both steps passed some: the case the count exists for
        assert all(metrics[s]["cppo/filter_passed_zero_variance"] > 0 for s in (1, 2)), metrics


# ------------------------------------------------------------------------------- the arithmetic
def records_of_a_step():
    """Step 1, G = 2: a, b filtered; e discarded as surplus; c, d passed to CPPO, 2 of 4 kept."""
    return [
        {"kind": "draw", "step": 1, "uids": ["a", "b", "c"], "prompts": [0, 2, 1]},
        {"kind": "draw", "step": 1, "uids": ["d", "e"], "prompts": [3, 5]},
        {"kind": "evict", "step": 1, "filtered": {"a": [1.0, 1.0], "b": [0.0, 0.0]}, "failed": [], "stale": []},
        {"kind": "clear", "rewards": {"a": [1.0, 1.0], "b": [0.0, 0.0]}, "submitted": {"a": 1, "b": 1}},
        {"kind": "clear", "rewards": {"e": [1.0, 0.0]}, "submitted": {"e": 1}},
        {"kind": "prune", "step": 1, "uids": ["c", "c", "d", "d"], "rewards": [1.0, 0.0, 0.5, 0.0], "kept": [0, 2]},
    ]


def test_the_accounting_of_one_step():
    acc = account_step(records_of_a_step(), 1, 2)
    assert isinstance(acc, StepAccount) and acc.problems() == []
    assert (acc.filtered, acc.surplus, acc.passed, acc.carried) == (("a", "b"), ("e",), ("c", "d"), ())
    assert (acc.completions_generated, acc.completions_filtered, acc.completions_surplus, acc.completions_passed,
            acc.kept, acc.pruned) == (10, 4, 2, 4, 2, 2)


def test_the_accounting_names_what_does_not_add_up():
    recs = records_of_a_step()
    recs[2] = {**recs[2], "filtered": {"a": [1.0, 1.0]}}  # one filtered group not recorded: it looks discarded
    assert account_step(recs, 1, 2).problems() == ["step 1: zero_variance_surplus ['b']"]
    recs = records_of_a_step()[:4] + records_of_a_step()[5:]  # the surplus clear lost
    assert "step 1: carried ['e']" in account_step(recs, 1, 2).problems()
    recs = records_of_a_step()
    recs[5] = {**recs[5], "rewards": [1.0, 1.0, 0.5, 0.0]}  # a group reached CPPO with equal rewards
    assert "step 1: zero_variance_passed ['c']" in account_step(recs, 1, 2).problems()
    recs = records_of_a_step()
    recs[2] = {**recs[2], "filtered": {"a": [1.0, 0.0], "b": [0.0, 0.0]}}  # a varied group filtered
    assert "step 1: varied_filtered ['a']" in account_step(recs, 1, 2).problems()
    recs = records_of_a_step() + [{"kind": "draw", "step": 1, "uids": ["f"], "prompts": [7]}]  # drawn, lost
    assert account_step(recs, 1, 2).problems() == [
        "step 1: carried ['f']",
        "step 1: 12 completions generated (6 x G=2) but 10 accounted for (filtered 4, surplus 2, passed 4)"]
    recs = records_of_a_step()
    recs[5] = {**recs[5], "kept": [0]}  # kept + pruned still the rows passed; a kept count is the test's to check
    assert account_step(recs, 1, 2).kept == 1


def records_of_an_acc_step():
    """``records_of_a_step`` filtered on acc: a (acc equal, rewards varied) filtered; c passed with
    equal rewards but varied acc; e discarded as surplus with equal rewards."""
    recs = records_of_a_step()
    recs[2] = {**recs[2], "filtered": {"a": [1.0, 0.0], "b": [0.0, 0.0]}, "metric": "acc",
               "filter_values": {"a": [1.0, 1.0], "b": [0.0, 0.0]}}
    recs[4] = {**recs[4], "rewards": {"e": [1.0, 1.0]}, "filter_values": {"e": [0.0, 1.0]}}
    recs[5] = {**recs[5], "rewards": [0.5, 0.5, 0.5, 0.0], "filter_metric": "acc",
               "filter_values": [0.0, 1.0, 1.0, 0.0]}
    return recs


def test_under_another_metric_equal_rewards_that_passed_are_counted_and_its_verdicts_checked():
    acc = account_step(records_of_an_acc_step(), 1, 2)
    assert acc.metric == "acc" and acc.problems() == []
    assert (acc.zero_variance_passed, acc.zero_variance_surplus, acc.varied_filtered) == (("c",), ("e",), ())
    recs = records_of_an_acc_step()
    recs[5] = {**recs[5], "filter_values": [1.0, 1.0, 1.0, 0.0]}  # c passed with acc equal: the filter erred
    assert account_step(recs, 1, 2).problems() == ["step 1: constant_passed ['c']"]
    recs = records_of_an_acc_step()
    recs[4] = {**recs[4], "filter_values": {"e": [1.0, 1.0]}}  # the surplus too
    assert account_step(recs, 1, 2).problems() == ["step 1: constant_passed ['e']"]
    recs = records_of_an_acc_step()
    recs[2] = {**recs[2], "filter_values": {"a": [1.0, 0.0], "b": [0.0, 0.0]}}  # a dropped with acc varied
    assert account_step(recs, 1, 2).problems() == ["step 1: varied_filtered ['a']"]
    recs = records_of_an_acc_step()
    recs[5] = {**recs[5], "filter_values": [None, 1.0, 1.0, 0.0]}  # a value missing: c no longer shows a spread
    assert account_step(recs, 1, 2).problems() == ["step 1: constant_passed ['c']"]


@pytest.mark.parametrize("step,group_size,match", [(0, 2, "step must be a positive int, got 0"),
                                                   (1, 0, "group_size must be a positive int, got 0"),
                                                   (2, 2, "step 2 has 0 prune records, expected 1")])
def test_account_step_names_bad_input(step, group_size, match):
    with pytest.raises(ValueError, match=match):
        account_step(records_of_a_step(), step, group_size)


@pytest.mark.parametrize("metric", ["reward", "acc"])
def test_rewards_that_cannot_be_read_are_recorded_empty_not_raised(monkeypatch, metric):
    """The audit must not stop a run: a TransferQueue read that fails leaves the group's rewards
    (and filter values) empty, which ``account_step`` then reports as completions not accounted for."""
    from types import SimpleNamespace

    import transfer_queue

    from cppo_megatron.integrations.verl.dapo import _group_reads

    def fail(**kwargs):
        raise RuntimeError("storage unit gone")

    monkeypatch.setattr(transfer_queue, "kv_batch_get", fail)
    buffer = SimpleNamespace(partitions={"train": {"u1_0_0": {}, "u1_1_0": {}, "u2_0_0": {}}},
                             filter_groups_metric=metric)
    rewards, values = _group_reads(buffer, "train", {"u1", "u3"})
    assert rewards == {"u1": [], "u3": []}
    assert values == (None if metric == "reward" else {"u1": [], "u3": []})
    assert _group_reads(buffer, "train", {"u3"}) == ({"u3": []}, None if metric == "reward" else {"u3": []})


def test_metric_values_read_reward_extra_info_as_veRL_does():
    from types import SimpleNamespace

    from cppo_megatron.integrations.verl.dapo import metric_values

    rows = [{"reward_extra_info": {"acc": 1}}, SimpleNamespace(data={"reward_extra_info": {"acc": 0.5}}),
            {"reward_extra_info": {"score": 1.0}}, "not a dict", {"reward_extra_info": None}]
    assert metric_values(rows, "acc") == [1.0, 0.5, None, None, None]
    with pytest.raises(ValueError, match="metric must be a reward_extra_info field name, got ''"):
        metric_values(rows, "")


def test_equal_reward_groups_names_the_groups_without_a_signal():
    from cppo_megatron.integrations.verl.dapo import equal_reward_groups

    uids = ["a", "b", "a", "b", "c", "d", "d"]
    assert equal_reward_groups(uids, [1.0, 0.0, 1.0, 0.5, 0.3, 0.2, 0.2]) == ["a", "d"]  # c: a group of one
    with pytest.raises(ValueError, match="2 uids for 1 rewards"):
        equal_reward_groups(["a", "b"], [1.0])
