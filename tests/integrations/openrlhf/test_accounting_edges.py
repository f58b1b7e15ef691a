"""OpenRLHF's DAPO accounting and preflight where their tests did not reach (scripts/coverage_floor.py):
each refusal of a ledger, a step account and the passed-group guard by its message, and the CPU
mode's logical GPUs in the preflight."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cppo_megatron.integrations.openrlhf import filtering, preflight
from cppo_megatron.integrations.openrlhf.filtering import FilteredGroup, FilterLedger, StepAccount


def _group(passed=True, g=2, prompt="p"):
    return FilteredGroup(prompt=prompt, label=None, scores=(1.0,) * g, rewards=(1.0,) * g, passed=passed)


def _ledger(passed=(True, False), g=2, **kw):
    base = dict(serial="s1", drawn=len(passed), group_size=g, groups=tuple(_group(p, g) for p in passed),
                exhausted=False, range=(0.0, 1.0))
    return FilterLedger(**{**base, **kw})


@pytest.mark.parametrize("kw,message", [
    (dict(group_size=0, groups=()), "FilterLedger: group_size must be >= 1, got 0"),
    (dict(drawn=3), "FilterLedger s1: 3 prompts drawn but 2 groups generated; every drawn prompt must come back"),
    (dict(groups=(_group(True, 2), _group(True, 3, prompt="long one"))),
     "FilterLedger s1: group 1 \\('long one'\\) has 3 completions, expected 2"),
])
def test_a_ledger_that_does_not_describe_its_groups_is_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        _ledger(**kw)


def test_build_ledger_refuses_a_bad_group_size_and_foreign_samples():
    with pytest.raises(ValueError, match="build_ledger: group_size must be an integer >= 1, got True"):
        filtering.build_ledger([], [], drawn=0, group_size=True, exhausted=False, filter_range=(0.0, 1.0))
    produced = [object(), object()]
    with pytest.raises(ValueError, match="build_ledger: 1 returned samples were not produced by this call"):
        filtering.build_ledger(produced, [object()], drawn=1, group_size=2, exhausted=False, filter_range=(0.0, 1.0))


def test_a_step_account_with_a_zero_group_size_is_refused():
    with pytest.raises(ValueError, match="StepAccount: group_size must be >= 1, got 0"):
        StepAccount(drawn=0, filtered=0, passed=0, group_size=0, kept=0, pruned=0, target=1, exhausted=False)


def test_account_step_refuses_what_the_ledgers_cannot_explain():
    with pytest.raises(ValueError, match=r"account_step: no filter ledger on the rollout samples \(is the samples "):
        filtering.account_step([], num_samples=0, kept=0, target=1)
    with pytest.raises(ValueError, match=r"account_step: ledgers disagree on the group size: \[2, 3\]"):
        filtering.account_step([_ledger(), _ledger(g=3)], num_samples=2, kept=2, target=1)
    with pytest.raises(ValueError, match="account_step: kept=3 outside 0..2"):
        filtering.account_step([_ledger()], num_samples=2, kept=3, target=1)
    acc = filtering.account_step([_ledger()], num_samples=2, kept=1, target=2)
    assert (acc.drawn, acc.filtered, acc.passed, acc.kept, acc.pruned, acc.short) == (2, 1, 1, 1, 1, True)


def _args(nodes=1, gpus=2):
    return SimpleNamespace(
        actor=SimpleNamespace(num_nodes=nodes, num_gpus_per_node=gpus, model_name_or_path=""),
        vllm=SimpleNamespace(num_engines=1, tensor_parallel_size=1),
        train=SimpleNamespace(colocate_all=False, async_enable=False, micro_batch_size=1, batch_size=2),
        ds=SimpleNamespace(ring_attn_size=1, tensor_parallel_size=1),
        data=SimpleNamespace(max_len=32),
    )


def test_the_cpu_mode_must_declare_a_logical_gpu_per_actor():
    assert preflight.problems(_args(), cpu_num_gpus=1) == [
        "the CPU mode declares 1 logical GPUs (cpu.num_gpus) but --actor.num_nodes x --actor.num_gpus_per_node = 2: "
        "the actors' placement would wait forever; set cpu.num_gpus 2"]
    assert preflight.problems(_args(), cpu_num_gpus=2) == []
