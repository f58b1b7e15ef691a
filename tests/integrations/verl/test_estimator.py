"""The ``cppo`` estimator through veRL's own registry and ``compute_advantage``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cppo_megatron import CPPOConfig
from cppo_megatron.core import group_advantages

from .batches import make_dataproto, rewards_table


def test_registered_in_verl_registry(plugin):
    from verl.trainer.ppo import core_algos

    assert core_algos.get_adv_estimator_fn("cppo") is plugin.compute_cppo_outcome_advantage
    plugin.register_estimator()  # idempotent: no "already registered" error
    assert core_algos.get_adv_estimator_fn("cppo") is plugin.compute_cppo_outcome_advantage


def test_full_group_statistics_not_survivors(plugin):
    """rewards [1,0,0,0,0,0,0,0], keep 4: +2.47 / -0.35, never survivor stats (+1.5 / -0.5)."""
    from verl.trainer.ppo import core_algos

    from cppo_megatron.integrations.verl.hook import decide
    from cppo_megatron.integrations.verl.stats import record_groups

    rewards = torch.tensor([1.0, 0, 0, 0, 0, 0, 0, 0])
    result, records = decide(["q"] * 8, rewards, CPPOConfig(keep_per_group=4), step=0)
    record_groups(records)
    kept = result.selection.kept
    mask = torch.ones(len(kept), 3)
    tlr = torch.zeros(len(kept), 3)
    tlr[:, -1] = rewards[kept]
    adv, ret = core_algos.get_adv_estimator_fn("cppo")(
        token_level_rewards=tlr, response_mask=mask, index=np.array(["q"] * len(kept), dtype=object)
    )
    scalar = adv[:, 0]
    assert scalar[0].item() == pytest.approx(2.4748, abs=1e-3)
    assert scalar[1:].tolist() == pytest.approx([-0.35355] * 3, abs=1e-4)
    # veRL's GRPO on the survivors alone gives the survivor-statistics values: the bug we avoid
    grpo, _ = core_algos.compute_grpo_outcome_advantage(tlr, mask, np.array(["q"] * len(kept), dtype=object))
    assert grpo[0, 0].item() == pytest.approx(1.5, abs=1e-4)
    assert torch.equal(adv, ret)


def test_compute_advantage_on_pruned_dataproto_matches_verl_grpo_on_full_batch(plugin, config):
    """veRL's compute_advantage(adv_estimator="cppo") on the survivors equals veRL's GRPO
    advantages of those rows computed on the full, unpruned batch."""
    from verl.trainer.ppo import core_algos
    from verl.trainer.ppo.ray_trainer import compute_advantage

    from cppo_megatron.integrations.verl.hook import decide
    from cppo_megatron.integrations.verl.stats import record_groups

    rewards = rewards_table(seed=1, prompts=4, group=8)
    full = make_dataproto(rewards, seed=1)
    full.batch["token_level_rewards"] = full.batch["rm_scores"]
    ref, _ = core_algos.compute_grpo_outcome_advantage(
        full.batch["token_level_rewards"], full.batch["response_mask"], full.non_tensor_batch["uid"]
    )
    result, records = decide(list(full.non_tensor_batch["uid"]), rewards.reshape(-1), CPPOConfig(pruning_rate=0.75), 5)
    record_groups(records)
    pruned = full.select_idxs(result.selection.kept)
    out = compute_advantage(pruned, adv_estimator="cppo", num_repeat=8, config=config.algorithm)
    kept = result.selection.kept
    torch.testing.assert_close(out.batch["advantages"], ref[kept], atol=1e-5, rtol=1e-5)
    expected, _ = group_advantages(rewards.reshape(-1), torch.arange(32) // 8)
    first = pruned.batch["response_mask"].argmax(-1)
    got = out.batch["advantages"][torch.arange(len(kept)), first]
    torch.testing.assert_close(got, expected[kept], atol=1e-5, rtol=1e-5)
    # the all-zero group 0 carries no signal; k = 2 of each group survive anyway (group scope)
    assert result.selection.kept_per_group.tolist() == [2, 2, 2, 2]


def test_unrecorded_row_is_an_error_padding_is_zero(plugin):
    from verl.trainer.ppo import core_algos

    from cppo_megatron.integrations.verl.stats import clear

    clear()
    fn = core_algos.get_adv_estimator_fn("cppo")
    with pytest.raises(ValueError, match=r"row 0 \(uid 'zz'\) has no full-group statistics"):
        fn(token_level_rewards=torch.ones(1, 2), response_mask=torch.ones(1, 2), index=np.array(["zz"], dtype=object))
    adv, _ = fn(token_level_rewards=torch.zeros(1, 2), response_mask=torch.zeros(1, 2), index=np.array(["pad"], dtype=object))
    assert adv.abs().sum().item() == 0.0
