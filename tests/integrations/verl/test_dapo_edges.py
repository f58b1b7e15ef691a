"""DAPO + CPPO accounting in veRL where test_dapo.py did not reach (scripts/coverage_floor.py): the
step account's own arithmetic messages, what the audit recorders leave out (another partition, an
empty clear), groups with no trajectory, and rewards held as jagged tensors."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from cppo_megatron.integrations.verl import dapo
from cppo_megatron.integrations.verl.dapo import REPLAY_BUFFER, StepAccount


def _account(**kw) -> StepAccount:
    base = dict(step=3, group_size=2, drawn=("a", "b", "c"), filtered=("a",), failed=(), surplus=(),
                passed=("b", "c"), carried=(), unexplained=(), completions_filtered=2, completions_surplus=0,
                completions_passed=4, kept=2, pruned=2, zero_variance_passed=(), varied_filtered=(),
                zero_variance_surplus=())
    return StepAccount(**{**base, **kw})


def test_a_balanced_step_has_no_problems():
    assert _account().problems() == [] and _account().completions_generated == 6


def test_prompts_that_do_not_add_up_are_named_with_every_part():
    assert _account(passed=("b",), completions_passed=2, kept=1, pruned=1).problems() == [
        "step 3: 3 prompts drawn but filtered 1 + failed 0 + surplus 0 + passed 1 + carried 0 = 2",
        "step 3: 6 completions generated (3 x G=2) but 4 accounted for (filtered 2, surplus 0, passed 2)",
    ]


def test_survivors_and_pruned_must_be_what_reached_cppo():
    assert _account(kept=1).problems() == ["step 3: kept 1 + pruned 2 != 4 completions passed to CPPO"]


def test_a_failed_group_excuses_the_completion_count_only():
    acc = _account(failed=("c",), passed=("b",), completions_passed=2, kept=1, pruned=1)
    assert acc.problems() == []  # a failed group's completions are not all seen; its prompt still counts


def _wrapped(kind):
    records = []
    factory = dapo.recorders(lambda what, **kw: records.append((what, kw)))[REPLAY_BUFFER][kind]
    calls = []
    return factory(lambda self, *a, **kw: calls.append(a)), records, calls


def test_only_the_train_partition_is_recorded(monkeypatch):
    evict, records, calls = _wrapped("_evict_terminal_groups")
    buffer = SimpleNamespace(partitions={"val": {}})
    evict(buffer, 4, "val", ({"x"}, {"y"}, set()))
    assert records == [] and calls == [(4, "val", ({"x"}, {"y"}, set()))]  # veRL's own method still ran


def test_a_clear_of_no_groups_is_not_recorded():
    clear, records, calls = _wrapped("_clear_groups")
    clear(SimpleNamespace(partitions={"train": {}}, prompt_global_steps={"train": {}}), "train", [])
    assert records == [] and calls == [("train", [])]


def test_groups_without_trajectories_are_recorded_with_no_rewards():
    clear, records, _ = _wrapped("_clear_groups")
    buffer = SimpleNamespace(partitions={"train": {}}, prompt_global_steps={"train": {"u1": 2}})
    clear(buffer, "train", ["u1", "u2"])
    assert records == [("clear", {"rewards": {"u1": [], "u2": []}, "submitted": {"u1": 2, "u2": None}})]


def test_rewards_held_as_jagged_tensors_are_summed_per_row(monkeypatch):
    import transfer_queue

    jagged = torch.nested.as_nested_tensor([torch.tensor([0.0, 1.0]), torch.tensor([0.5])], layout=torch.jagged)
    monkeypatch.setattr(transfer_queue, "kv_batch_get", lambda **kw: {"rm_scores": jagged})
    clear, records, _ = _wrapped("_clear_groups")
    buffer = SimpleNamespace(partitions={"train": {"u1_0_0": {}, "u1_1_0": {}}}, prompt_global_steps={"train": {}})
    clear(buffer, "train", ["u1"])
    assert records[0][1]["rewards"] == {"u1": [1.0, 0.5]}


def test_a_config_without_an_algorithm_section_has_the_filter_off():
    assert dapo.filter_groups_enabled({"algorithm": None}) is False
    assert dapo.filter_groups_enabled({"algorithm": {"filter_groups": 3}}) is False


def test_config_get_reads_a_dotted_key_or_gives_the_default():
    from omegaconf import OmegaConf

    from cppo_megatron.integrations.verl.dapo import config_get

    plain = {"trainer": {"v1": {"trainer_mode": "sync", "sampler": None}, "use_v1": False}}
    for cfg in (plain, OmegaConf.create(plain)):
        assert config_get(cfg, "trainer.v1.trainer_mode") == "sync"
        assert config_get(cfg, "trainer.use_v1", True) is False  # a falsy value is a value
        assert config_get(cfg, "trainer.v1.sampler", "none") == "none"  # None: the default
        assert config_get(cfg, "trainer.v1.trainer_mode.deeper", 7) == 7  # a str is not a mapping
        assert config_get(cfg, "data.gen_batch_size") is None
