"""The veRL run configuration where its tests did not reach (scripts/coverage_floor.py): the cppo
group absent or not a mapping, allocation's refusals with a gen batch or a critic, the micro-batch
shrink under dynamic batch sizes, the plugin export into a config without a Ray section, and a
recipe that puts a mapping where veRL has a value. Real composed veRL configs (conftest)."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf, open_dict

from cppo_megatron import CPPOConfig
from cppo_megatron.integrations.verl import preflight, runconfig


def test_a_config_without_a_cppo_group_has_the_defaults():
    assert runconfig.cppo_config_from(OmegaConf.create({"algorithm": {}})) == CPPOConfig()


def test_a_cppo_group_that_is_not_a_mapping_is_refused():
    with pytest.raises(ValueError, match=r"^cppo: must be a mapping of CPPO settings, got list: \[1, 2\]$"):
        runconfig.cppo_config_from({"cppo": OmegaConf.create([1, 2])})


def test_allocation_refuses_a_gen_batch_that_does_not_divide_the_grown_batch(config):
    with open_dict(config):
        config.data.gen_batch_size = 5  # 4 prompts x 8 / keep 2 = 16: 5 does not divide it
    with pytest.raises(ValueError, match="^allocation: data.gen_batch_size=5 does not divide the grown "
                                         "data.train_batch_size=16$"):
        runconfig.apply_allocation(config)


def test_without_allocation_the_critic_mini_batch_follows_the_kept_count(config):
    with open_dict(config):
        config.cppo.allocation = False
        config.actor_rollout_ref.actor.ppo_mini_batch_size = 4
        config.critic.enable = True
        config.critic.ppo_mini_batch_size = 8
    plan = runconfig.apply_allocation(config)
    assert (plan.actor_mini_batch_before, plan.actor_mini_batch) == (4, 1)  # keep 2 of G 8
    assert config.critic.ppo_mini_batch_size == 2
    with open_dict(config):
        config.actor_rollout_ref.actor.ppo_mini_batch_size = 4
        config.critic.ppo_mini_batch_size = 3
    with pytest.raises(ValueError, match=r"^allocation=false: critic.ppo_mini_batch_size=3 x 2 / 8$"):
        runconfig.apply_allocation(config)


def test_dynamic_batch_sizes_need_no_micro_batch_shrink(config):
    with open_dict(config):
        config.cppo.allocation = False
        config.actor_rollout_ref.actor.ppo_mini_batch_size = 4
        config.actor_rollout_ref.actor.use_dynamic_bsz = True
        config.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = 3
    plan = runconfig.apply_allocation(config)
    assert plan.micro_batches == () and config.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 3


def test_the_plugin_reaches_the_workers_of_a_config_without_a_ray_section():
    config = OmegaConf.create({"trainer": {}})
    runconfig.export_plugin_to_workers(config, {"X": "1"})
    assert OmegaConf.to_container(config.ray_kwargs) == {"ray_init": {"runtime_env": {"env_vars": {
        "VERL_USE_EXTERNAL_MODULES": runconfig.PLUGIN_MODULE, "X": "1"}}}}


def test_a_mapping_where_verl_has_a_value_is_named(base_config):
    overlay = OmegaConf.create({"trainer": {"total_epochs": {"oops": 1}}})
    assert runconfig.overlay_mismatches(overlay, base_config) == ["trainer.total_epochs: a mapping where veRL has int"]


def test_the_preflight_has_no_model_to_read_without_a_path():
    assert preflight.model_config(OmegaConf.create({"actor_rollout_ref": {"model": {"path": ""}}})) == (
        None, "no actor_rollout_ref.model.path")


def test_a_mapping_where_verl_has_null_is_accepted_and_not_checked_below(base_config):
    """veRL leaves ``actor.optim.override_optimizer_config`` null for a mapping of the user's own: a recipe's
    mapping there passes, keys and all (veRL has no schema under it to check them against); a typo beside
    it is still named."""
    assert base_config.actor_rollout_ref.actor.optim.override_optimizer_config is None
    overlay = OmegaConf.create({"actor_rollout_ref": {"actor": {"optim": {
        "override_optimizer_config": {"betas": [0.9, 0.95], "anything": {"nested": 1}}, "lrr": 1e-6}}}})
    assert runconfig.overlay_mismatches(overlay, base_config) == [
        "actor_rollout_ref.actor.optim.lrr: not a key of veRL's config"]


def test_allocation_refuses_a_keep_that_does_not_divide_the_completions(config):
    with open_dict(config):
        config.cppo.pruning_rate = 0.625  # keep 3 of G = 8: 4 prompts x 8 = 32 completions, 32 / 3 prompts
    with pytest.raises(ValueError, match=r"^allocation: data.train_batch_size=4 x rollout.n=8 / keep=3 is not an "
                                         r"integer number of prompts; pick a pruning rate with G\(1-P\) dividing "
                                         r"G\*b$"):
        runconfig.apply_allocation(config)
    assert config.data.train_batch_size == 4  # refused before anything changed
