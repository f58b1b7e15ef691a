"""The veRL hook where the loop tests did not reach (scripts/coverage_floor.py): its refusals by
message, a V1 batch with nothing to prune, the legacy loop with the audit on and a critic, the
DP-load helpers on batches that do not split, and the install checks against a veRL whose class
moved. Real veRL objects; TransferQueue as the dict-backed stand-in of test_dapo.py."""

from __future__ import annotations

import types
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from cppo_megatron import CPPOConfig
from cppo_megatron.integrations.verl import hook

from .batches import make_dataproto, rewards_table
from .test_dapo import FakeTQ


def test_decide_refuses_batches_that_do_not_line_up():
    with pytest.raises(ValueError, match="^3 uids for 2 rewards$"):
        hook.decide(["a", "a", "b"], torch.zeros(2), CPPOConfig(), 0)
    with pytest.raises(ValueError, match="^cppo: the batch reaching _balance_batch is empty$"):
        hook.decide([], torch.zeros(0), CPPOConfig(), 0)


@pytest.fixture
def tq(monkeypatch):
    import transfer_queue

    fake = FakeTQ()
    for name in ("kv_batch_get", "kv_clear"):
        monkeypatch.setattr(transfer_queue, name, getattr(fake, name))
    return fake


def _v1_trainer(config):
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    trainer = object.__new__(PPOTrainerSync)
    trainer.config, trainer.global_steps = config, 2
    return trainer


def test_a_grpo_v1_batch_clears_nothing_and_keeps_every_key(plugin, config, tq):
    from transfer_queue import KVBatchMeta

    OmegaConf.update(config, "cppo.pruning_rate", 0.0)
    keys = [f"p{i // 4}_{i % 4}_0" for i in range(8)] + ["pad_0_0"]
    for i, key in enumerate(keys[:-1]):
        tq.data["train"][key] = {"uid": f"p{i // 4}", "rm_scores": torch.tensor([0.0, float(i % 2)]),
                                  "response_mask": torch.ones(2, dtype=torch.int64)}  # every veRL row has one
    tags = [{"seq_len": 3}] * 8 + [{"seq_len": 3, "is_padding": True}]
    metrics: dict = {}
    out = hook.prune_kv_batch(_v1_trainer(config), KVBatchMeta(keys=keys, tags=tags, partition_id="train"), metrics)
    assert out.keys == keys  # the 8 real rows in order, then veRL's padding row
    assert metrics["cppo/rows_cleared"] == 0.0 and metrics["cppo/pruning_rate"] == 0.0
    assert len(tq.data["train"]) == 8  # nothing cleared


def test_keep_per_group_reports_no_pruning_rate(plugin, config, tq):
    from transfer_queue import KVBatchMeta

    OmegaConf.update(config, "cppo.pruning_rate", None)
    OmegaConf.update(config, "cppo.keep_per_group", 1)
    keys = [f"p0_{s}_0" for s in range(4)]
    for s, key in enumerate(keys):
        tq.data["train"][key] = {"uid": "p0", "rm_scores": torch.tensor([3.0 if s == 3 else 0.0]),
                                  "response_mask": torch.ones(1, dtype=torch.int64)}
    metrics: dict = {}
    out = hook.prune_kv_batch(_v1_trainer(config), KVBatchMeta(keys=keys, tags=[{}] * 4, partition_id="train"),
                              metrics)
    assert out.keys == ["p0_3_0"]  # the largest |A| of the group (A = 1.5; the others -0.5)
    assert "cppo/pruning_rate" not in metrics and metrics["cppo/rows_cleared"] == 3.0


def test_keys_that_are_not_agent_session_keys_are_not_checked_for_sessions():
    hook._check_single_output_sessions(["a_1_0", "plain", "b_1_0"])  # 'plain': not {uid}_{session}_{output}
    with pytest.raises(ValueError, match="keys 'a_1_0' and 'a_1_1' are two outputs of one agent session"):
        hook._check_single_output_sessions(["a_1_0", "a_1_1"])


def test_response_lengths_of_padded_and_flat_masks():
    assert hook._row_tokens(torch.tensor([[1, 1, 0], [1, 0, 0]])).tolist() == [2, 1]
    assert hook._row_tokens(torch.tensor([3, 5])).tolist() == [3, 5]


def _legacy_trainer(config, dp_size, *, use_critic=False, steps=3):
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    trainer = object.__new__(RayPPOTrainer)
    trainer.config, trainer.global_steps, trainer.use_critic = config, steps, use_critic
    trainer.actor_rollout_wg = SimpleNamespace(_dispatch_info={"actor": list(range(dp_size))})
    return trainer


def test_the_required_multiple_follows_the_critic_and_its_warmup(config):
    OmegaConf.update(config, "critic.ppo_mini_batch_size", 3, force_add=True)
    # actor mini-batch 1 x n 8 = 8; critic 3 x 8 = 24; DP 2
    assert hook._required_multiple(_legacy_trainer(config, 2), 2) == 8
    assert hook._required_multiple(_legacy_trainer(config, 2, use_critic=True), 2) == 24
    OmegaConf.update(config, "trainer.critic_warmup", 5, force_add=True)  # step 3 < 5: the actor does not update
    assert hook._required_multiple(_legacy_trainer(config, 2), 2) == 2


def test_the_legacy_loop_with_the_audit_numbers_rows_and_pads_with_row_minus_one(plugin, config, tmp_path,
                                                                                  audit_on):
    from cppo_megatron.integrations.verl.diagnostics import audit

    audit_on(tmp_path)
    batch = make_dataproto(rewards_table(seed=1, prompts=4, group=8), seed=1)
    metrics: dict = {}
    _legacy_trainer(config, dp_size=3)._balance_batch(batch, metrics=metrics)
    rows = batch.non_tensor_batch["cppo_row"]
    padding = batch.non_tensor_batch["cppo_is_padding"]
    # 8 kept, padded to lcm(DP 3, mini-batch 1 x n 8) = 24 rows
    assert metrics["cppo/padding_rows"] == 16.0 and len(rows) == 24 and padding.sum() == 16
    assert (rows[padding] == -1).all() and sorted(rows[~padding].tolist()) == sorted(set(rows[~padding].tolist()))
    (record,) = [r for r in audit.read(tmp_path) if r["kind"] == "prune"]
    assert record["loop"] == "legacy" and record["rows"] == list(range(32)) and len(record["kept"]) == 8


def test_a_batch_already_marked_for_padding_keeps_its_marks(plugin):
    batch = make_dataproto(rewards_table(seed=0, prompts=1, group=4))
    batch.non_tensor_batch["cppo_is_padding"] = np.array([False, False, True, False])
    assert hook.pad_dataproto_loss_free(batch, 2, step=0) == 0
    assert batch.non_tensor_batch["cppo_is_padding"].tolist() == [False, False, True, False]


def test_the_legacy_loop_needs_rewards_on_the_batch(plugin, config):
    batch = make_dataproto(rewards_table(seed=0, prompts=1, group=4))
    batch.batch.pop("rm_scores")
    with pytest.raises(ValueError, match="^cppo: no rm_scores on the batch at _balance_batch; rewards must be "):
        hook.prune_dataproto(_legacy_trainer(config, 1), batch, {})


def test_dp_helpers_on_batches_that_do_not_split():
    assert hook.better_order([5, 3, 2], 2, CPPOConfig()) == (None, {})
    assert hook.better_order([], 2, CPPOConfig()) == (None, {})
    assert hook.dp_load_metrics([1, 2, 3], [1, 2, 3], 2) == {}
    assert hook.dp_load_metrics([1, 2], [1, 2, 3], 2) == {}
    with pytest.raises(ValueError, match="dp_token_loads: 3 rows do not split into dp_size=2 equal chunks"):
        hook.dp_token_loads([1, 2, 3], 2)


def test_install_refuses_a_verl_whose_trainer_moved():
    module = types.ModuleType("verl.trainer.ppo.ray_trainer")
    with pytest.raises(RuntimeError, match="^cppo: verl.trainer.ppo.ray_trainer has no RayPPOTrainer; veRL changed$"):
        hook._patch_module(module)
    module.RayPPOTrainer = type("RayPPOTrainer", (), {})
    with pytest.raises(RuntimeError, match="^cppo: RayPPOTrainer._balance_batch is gone; veRL changed$"):
        hook._patch_module(module)


def test_uninstall_takes_the_hook_off_both_loops_and_install_puts_it_back(plugin):
    try:
        hook.uninstall()
        assert not hook.is_installed("verl.trainer.ppo.ray_trainer")
        assert not hook.is_installed("verl.trainer.ppo.v1.trainer_base")
    finally:
        hook.install()
    assert hook.is_installed("verl.trainer.ppo.ray_trainer") and hook.is_installed("verl.trainer.ppo.v1.trainer_base")


def test_uninstall_in_a_process_that_never_imported_the_v1_trainer_unhooks_the_rest(plugin, monkeypatch):
    """A Ray worker that imported only the legacy loop: ``uninstall`` skips the V1 module it never
    imported (without importing it), still takes the hook off the legacy loop after it, and drops the
    pending import hook, so a later import stays unhooked."""
    import sys

    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    from cppo_megatron.integrations import importhook, wrap

    v1, legacy = "verl.trainer.ppo.v1.trainer_base", "verl.trainer.ppo.ray_trainer"
    assert list(hook.HOOK_TARGETS) == [v1, legacy]  # the one skipped comes first
    try:
        with monkeypatch.context() as mp:
            mp.delitem(sys.modules, v1)
            hook.uninstall()
            assert v1 not in sys.modules  # not imported to be unhooked
            assert importhook.pending(hook._patch_module) == []
            assert not hook.is_installed(legacy)
        # the module it never saw (here: put back afterwards) was left as it was
        assert wrap.is_wrapped(PPOTrainer.__dict__["_balance_batch"], hook.WRAP_TAG)
    finally:
        hook.install()
    assert hook.is_installed(legacy) and hook.is_installed(v1)
