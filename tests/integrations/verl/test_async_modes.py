"""CPPO in veRL's separate_async trainer mode (integrations/verl/async_modes.py), against the
pinned veRL's real ``PPOTrainerSeparateAsync`` (constructed without Ray: its ``__init__`` builds the
replay buffer only): veRL's mini-batch assert holds after CPPO's allocation, the recipe's sizes are
checked in CPPO's units, and the real mini-batch size is back before anything else reads it."""

from __future__ import annotations

import inspect
import textwrap

import pytest

from .conftest import compose

pytestmark = pytest.mark.verl

SEP = ["trainer.v1.trainer_mode=separate_async", "trainer.v1.separate_async.parameter_sync_step=2",
       "actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=1",
       "actor_rollout_ref.rollout.checkpoint_engine.backend=cpu", "actor_rollout_ref.hybrid_engine=false"]


def _config(plugin, *extra: str, mini: int = 2, prompts: int = 4):
    from cppo_megatron.integrations.verl.main import CONFIG_DIR

    return compose(CONFIG_DIR, "cppo_trainer", ["actor_rollout_ref.rollout.n=8", "cppo.pruning_rate=0.75",
                                                f"data.train_batch_size={prompts}",
                                                f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}", *SEP, *extra])


def _trainer_cls():
    from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync

    return PPOTrainerSeparateAsync


@pytest.mark.parametrize("allocation,sizes,prompts,mini", [(True, (4, 2), 16, 2), (False, (8, 4), 8, 1)])
def test_after_allocation_veRLs_assert_holds_and_the_mini_batch_is_restored(plugin, allocation, sizes, prompts, mini):
    from cppo_megatron.integrations.verl.async_modes import separate_async_rule

    config = _config(plugin, f"cppo.allocation={allocation}", prompts=sizes[0], mini=sizes[1])
    plan = plugin.prepare(config)
    # allocation: 4 -> 16 prompts, 8 per local update keep 2 of G=8 each: 16 rows = a mini-batch of 2 x G;
    # allocation=false: 4 prompts per local update keep 8 rows = the mini-batch shrunk from 4 to 1 x G
    assert (plan.train_batch_size, plan.actor_mini_batch) == (prompts, mini)
    assert separate_async_rule(config) == ""
    trainer = _trainer_cls()(config)
    assert trainer.parameter_sync_step == 2
    assert int(config.actor_rollout_ref.actor.ppo_mini_batch_size) == mini  # the kept-count value, back
    assert int(trainer.config.actor_rollout_ref.actor.ppo_mini_batch_size) == mini


def test_without_the_plugins_wrap_veRLs_own_assert_refuses_the_allocated_sizes(plugin):
    from cppo_megatron.integrations.wrap import original

    config = _config(plugin)
    plugin.prepare(config)
    bare = original(_trainer_cls().__dict__["__init__"])
    with pytest.raises(AssertionError, match="train_batch_size must equal parameter_sync_step"):
        bare(object.__new__(_trainer_cls()), config)


def test_sizes_that_do_not_fill_one_mini_batch_per_local_update_are_refused_in_cppos_units(plugin):
    from omegaconf import open_dict

    from cppo_megatron.integrations.verl.async_modes import separate_async_rule

    config = _config(plugin)
    plugin.prepare(config)
    with open_dict(config):
        config.data.train_batch_size = 24  # 12 prompts per local update keep 24 rows; the mini-batch trains 16
    why = separate_async_rule(config)
    assert "samples 12 prompts and keeps 24" in why and "ppo_mini_batch_size=2 trains 16" in why
    with pytest.raises(ValueError, match="separate_async: each of the 2 local updates samples 12 prompts"):
        _trainer_cls()(config)
    with open_dict(config):
        config.data.train_batch_size = 15
    assert "not a multiple of trainer.v1.separate_async.parameter_sync_step=2" in separate_async_rule(config)


def test_a_grpo_run_is_left_to_veRL(plugin):
    config = _config(plugin, "algorithm.adv_estimator=grpo", mini=2, prompts=4)
    _trainer_cls()(config)  # 4 == 2 x 2: veRL's rule, untouched
    config = _config(plugin, "algorithm.adv_estimator=grpo", mini=2, prompts=16)
    with pytest.raises(AssertionError, match="train_batch_size must equal"):
        _trainer_cls()(config)


def _source(obj) -> str:
    from cppo_megatron.integrations.wrap import original

    return textwrap.dedent(inspect.getsource(original(obj)))


def test_only_veRLs_assert_reads_the_mini_batch_while_it_is_presented_in_prompts(plugin):
    """The wrap presents the mini-batch in prompts for the whole ``__init__``: nothing else run by it
    may read that size (the drift guard pins these functions; this says why they matter)."""
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    cls = _trainer_cls()
    init = _source(cls.__dict__["__init__"])
    code = [line.strip() for line in init.splitlines() if "ppo_mini_batch_size" in line
            and not line.strip().startswith(("f\"", "\""))]  # the assert's message lines aside
    assert code == ["ppo_mini_batch_size = config.actor_rollout_ref.actor.ppo_mini_batch_size",
                    "assert train_batch_size == parameter_sync_step * ppo_mini_batch_size, ("], code
    for fn in (PPOTrainer.__init__, PPOTrainer._build_replay_buffer):
        assert "ppo_mini_batch_size" not in _source(fn), fn.__qualname__


def test_veRLs_info_line_with_prints_flush_keyword_is_logged_not_raised(plugin, caplog):
    """``trainer_separate_async.py:181``: ``logger.info(..., flush=True)`` with hybrid_engine=false."""
    import logging

    import verl.trainer.ppo.v1.trainer_separate_async as mod

    from cppo_megatron.integrations.verl.async_modes import FlushTolerantLogger

    assert isinstance(mod.logger, FlushTolerantLogger)
    with caplog.at_level(logging.INFO, logger=mod.logger.logger.name):
        mod.logger.info("[V1SepAsync] hybrid replicas disabled", flush=True)
    assert "[V1SepAsync] hybrid replicas disabled" in caplog.text
    with pytest.raises(TypeError, match="flush"):  # the wall it answers
        mod.logger.logger.info("x", flush=True)
