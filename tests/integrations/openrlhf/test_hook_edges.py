"""The CPPO hook on OpenRLHF where test_hook.py did not reach (scripts/coverage_floor.py): its refusals
by message, an empty rollout, the advantage step without recorded statistics, filtering without a
ledger, and the configuration from the environment. OpenRLHF's real experience maker and samples."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from cppo_megatron import CPPOConfig
from cppo_megatron.integrations.openrlhf import hook

from .test_hook import GROUPS, REWARDS

pytestmark = pytest.mark.openrlhf


def test_samples_with_no_prompt_or_several_are_refused(make_rollout, fresh):
    samples = fresh(make_rollout(GROUPS[:1]))
    samples[2].prompts = []
    with pytest.raises(ValueError, match="rollout sample 2 holds 0 prompts; CPPO expects OpenRLHF's single-sample"):
        hook.group_ids_from_samples(samples, 8)
    samples[2].prompts = ["a", "b"]
    with pytest.raises(ValueError, match="rollout sample 2 holds 2 prompts"):
        hook.group_ids_from_samples(samples, 8)


def test_pruning_without_an_installed_hook_says_how_to_install_it(orl, make_args, make_maker, make_rollout, fresh):
    hook.uninstall(orl.Maker)
    maker = make_maker(make_args("--rollout.n_samples_per_prompt", "8"))
    with pytest.raises(RuntimeError, match=r"the CPPO hook for OpenRLHF is not installed \(call install\(cfg\)\)"):
        hook.prune_rollout_samples(maker, fresh(make_rollout(GROUPS[:1])))


def test_an_empty_rollout_is_returned_as_is(make_args, make_maker):
    maker = make_maker(make_args("--rollout.n_samples_per_prompt", "8"))
    empty: list = []
    assert hook.prune_rollout_samples(maker, empty, CPPOConfig(pruning_rate=0.5)) is empty


def test_a_sample_of_several_rows_is_refused(make_args, make_maker, make_rollout, fresh):
    maker = make_maker(make_args("--rollout.n_samples_per_prompt", "8"))
    samples = fresh(make_rollout(GROUPS[:1]))
    samples[1].rewards = torch.tensor([1.0, 0.0])
    with pytest.raises(ValueError, match="rollout sample 1 holds 1 rows; expected one"):
        hook.prune_rollout_samples(maker, samples, CPPOConfig(pruning_rate=0.5))


def test_filtering_on_without_a_ledger_warns_that_dropped_groups_go_uncounted(make_args, make_maker, make_rollout,
                                                                              fresh, caplog):
    args = make_args("--rollout.n_samples_per_prompt", "8", "--algo.dynamic_filtering_enable",
                     "--algo.dynamic_filtering_range", "0.01", "0.99")
    maker = make_maker(args)
    with caplog.at_level(logging.WARNING):
        kept = hook.prune_rollout_samples(maker, fresh(make_rollout([GROUPS[0], GROUPS[1]])),
                                          CPPOConfig(pruning_rate=0.5))
    assert len(kept) == 8
    assert ("dynamic filtering is on but the rollout carries no filter ledger (OpenRLHF's samples generator is not "
            "hooked): the dropped groups are not accounted for this step") in caplog.text


def test_the_advantage_step_without_recorded_statistics_is_openrlhfs_own(make_args, make_maker):
    maker = make_maker(make_args("--rollout.n_samples_per_prompt", "8"))
    calls = []

    def original(m, exps):
        calls.append(exps)
        return exps

    assert hook.compute_advantages_with_recorded_stats(maker, [], original) == [] and calls == [[]]


def test_an_experience_without_its_group_statistics_is_refused(make_args, make_maker):
    from types import SimpleNamespace

    maker = make_maker(make_args("--rollout.n_samples_per_prompt", "8"))
    recorded = SimpleNamespace(info={hook.MEAN_KEY: torch.zeros(1), hook.STD_KEY: torch.ones(1)},
                               rewards=torch.ones(1))
    bare = SimpleNamespace(info={}, rewards=torch.ones(1))
    with pytest.raises(ValueError, match=f"experience 1 lacks the recorded group statistics \\({hook.MEAN_KEY}, "):
        hook.compute_advantages_with_recorded_stats(maker, [recorded, bare], lambda m, e: e, CPPOConfig())


def test_install_takes_a_cppo_config_only(orl):
    with pytest.raises(ValueError, match="install expects a CPPOConfig, got dict"):
        hook.install({"pruning_rate": 0.5}, orl.Maker)


def test_the_config_from_the_environment(monkeypatch, orl):
    monkeypatch.delenv(hook.ENV_CONFIG, raising=False)
    assert hook.config_from_env() is None and hook.install_from_env(orl.Maker) is False
    hook.setup_ray_worker()  # nothing configured: nothing registered
    monkeypatch.setenv(hook.ENV_CONFIG, "{pruning_rate: 0.5")
    with pytest.raises(ValueError, match=r"\$CPPO_OPENRLHF_CONFIG is not JSON \(.*\): '\{pruning_rate: 0.5'"):
        hook.config_from_env()
    monkeypatch.setenv(hook.ENV_CONFIG, json.dumps({"pruning_rate": 0.25}))
    assert hook.config_from_env() == CPPOConfig(pruning_rate=0.25)


def test_experiences_without_an_info_reward_get_their_rewards_back_and_no_info_reward(
        orl, make_args, make_maker, make_rollout, fresh):
    """OpenRLHF fills ``info["reward"]`` only when a reward came with the sample or from its reward model,
    and guards it itself (``length_penalty.py``); the advantage step with the recorded statistics does too:
    without one, the experience's rewards are restored (penalised), its advantages are those of the run
    with one, and no ``info["reward"]`` appears."""
    from .test_hook import _run

    groups = [g for g in GROUPS if len(g[1]) == 8]
    args = make_args("--rollout.n_samples_per_prompt", "8", "--reward.overlong_buffer_len", "4",
                     "--rollout.max_new_tokens", "14")
    cfg = CPPOConfig(pruning_rate=0.5, eps=1e-9)
    samples = make_rollout(groups)
    bare = fresh(samples)
    for s in bare:
        del s.info["reward"]
    _, with_info = _run(orl, make_maker, args, fresh(samples), cfg)
    _, without = _run(orl, make_maker, args, bare, cfg)
    assert all("reward" not in e.info for e in without) and all("reward" in e.info for e in with_info)

    def rows(exps):
        return {int(u): (e.advantages[i], float(e.rewards[i]))
                for e in exps for i, u in enumerate(e.info["uid"].tolist())}

    a, b = rows(with_info), rows(without)
    assert sorted(a) == sorted(b) and len(a) == 4 * len(groups)
    penalised = [u for u in a if abs(a[u][1] - float(REWARDS[u])) > 1e-6]
    assert penalised  # the overlong penalty changed some rewards: the restored ones are the penalised ones
    for uid in a:
        torch.testing.assert_close(b[uid][0], a[uid][0])
        assert b[uid][1] == pytest.approx(a[uid][1])


def test_uninstall_in_a_process_that_never_imported_the_samples_generator(orl, monkeypatch):
    """A Ray worker that never imports OpenRLHF's samples generator: install leaves DAPO's filter
    waiting on its import, uninstall drops the wait and touches no generator class."""
    import sys

    from cppo_megatron.integrations import importhook, wrap
    from cppo_megatron.integrations.openrlhf import filtering

    generator = orl.SamplesGenerator
    with monkeypatch.context() as mp:
        mp.delitem(sys.modules, filtering.GENERATOR_MODULE)
        hook.install(CPPOConfig(pruning_rate=0.5), orl.Maker)
        assert importhook.pending(filtering.install_generator) == [filtering.GENERATOR_MODULE]
        hook.uninstall(orl.Maker)
        assert importhook.pending(filtering.install_generator) == [] and not hook.is_installed(orl.Maker)
        assert filtering.GENERATOR_MODULE not in sys.modules  # not imported to be unhooked
    assert not any(wrap.is_wrapped(generator.__dict__[name], filtering.WRAP_TAG)
                   for name in ("_process_response_into_experience", "_generate_vllm"))
