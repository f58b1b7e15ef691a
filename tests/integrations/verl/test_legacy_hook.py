"""The hook in veRL's legacy loop (``trainer.use_v1=False``): the real
``RayPPOTrainer._balance_batch`` (wrapped) on a real ``DataProto``, then veRL's
``compute_advantage`` and policy loss on the pruned batch."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from cppo_megatron import CPPOConfig
from cppo_megatron.core import aggregate_loss, clipped_surrogate, group_advantages, prune

from .batches import make_dataproto, rewards_table

B, G, STEP = 4, 8, 3


def bare_trainer(config, dp_size: int):
    """A RayPPOTrainer with only what _balance_batch reads (no Ray workers)."""
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    trainer = object.__new__(RayPPOTrainer)
    trainer.config = config
    trainer.global_steps = STEP
    trainer.use_critic = False
    trainer.actor_rollout_wg = SimpleNamespace(_dispatch_info={"actor": list(range(dp_size))})
    return trainer


@pytest.fixture
def pruned(plugin, config):
    """(batch after the hooked _balance_batch, metrics, rewards, core's selection), DP = 3."""
    assert plugin.is_installed("verl.trainer.ppo.ray_trainer")
    rewards = rewards_table(seed=2, prompts=B, group=G)
    batch = make_dataproto(rewards, seed=2)
    metrics: dict = {}
    out = bare_trainer(config, dp_size=3)._balance_batch(batch, metrics=metrics)
    assert out is None  # the legacy loop ignores the return value: the batch changes in place
    gids = torch.arange(B * G) // G
    expected = prune(rewards.reshape(-1), gids, CPPOConfig(pruning_rate=0.75), step=STEP).selection
    return batch, metrics, rewards, expected


def test_keeps_exactly_core_survivors_aligned(pruned):
    batch, metrics, rewards, expected = pruned
    real = ~torch.as_tensor(batch.non_tensor_batch["cppo_is_padding"])
    rows = batch.batch["row_id"][real]
    assert sorted(rows.tolist()) == expected.kept.tolist()  # exactly the survivors, none lost
    # every field moved with its row: uid, prompt text, prompt tokens, reward
    assert list(batch.non_tensor_batch["uid"][real.numpy()]) == [f"p{r // G}" for r in rows.tolist()]
    assert list(batch.non_tensor_batch["prompt_text"][real.numpy()]) == [f"question {r // G}" for r in rows.tolist()]
    torch.testing.assert_close(batch.batch["rm_scores"][real].sum(-1), rewards.reshape(-1)[rows])
    assert metrics["cppo/num_kept"] == 8 and metrics["cppo/num_pruned"] == 24
    assert metrics["cppo/kept_ratio"] == 0.25
    assert "global_seqlen/max" in metrics  # veRL's own rebalance ran after pruning
    lens = batch.batch["attention_mask"].sum(-1).double()
    w = 24576 * lens + lens * lens
    final = float(w.view(3, -1).sum(1).max()) / (float(w.sum()) / 3)
    assert final == pytest.approx(min(metrics["cppo/balance_imbalance_verl"], metrics["cppo/balance_imbalance_core"]))
    chunks = [int(c.sum()) for c in lens.view(3, -1)]  # what each of the 3 DP ranks is sent
    assert [metrics[f"cppo/dp_rank{r}_tokens"] for r in range(3)] == chunks
    assert metrics["cppo/dp_tokens_imbalance"] == pytest.approx(max(chunks) / (sum(chunks) / 3))
    # without rebalancing: the survivors in arrival order (row ids ascending), padding last
    arrival = torch.cat([lens[real][torch.argsort(rows)], lens[~real]])
    raw = [int(c.sum()) for c in arrival.view(3, -1)]
    assert metrics["cppo/dp_tokens_imbalance_unbalanced"] == pytest.approx(max(raw) / (sum(raw) / 3))


def test_pads_loss_free_to_dp_times_minibatch_multiple(pruned, config):
    batch, metrics, _, _ = pruned
    multiple = math.lcm(3, config.actor_rollout_ref.actor.ppo_mini_batch_size * G)  # 24
    assert len(batch) % multiple == 0 and len(batch) == 24
    pad = torch.as_tensor(batch.non_tensor_batch["cppo_is_padding"])
    assert int(pad.sum()) == 16 == metrics["cppo/padding_rows"]
    assert batch.batch["response_mask"][pad].sum().item() == 0
    assert batch.batch["rm_scores"][pad].abs().sum().item() == 0
    pad_uids = set(batch.non_tensor_batch["uid"][pad.numpy()])
    assert len(pad_uids) == 16 and not pad_uids & {f"p{b}" for b in range(B)}


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_verl_advantage_and_loss_on_pruned_batch(pruned, config, mode):
    """veRL's compute_advantage("cppo") and vanilla policy loss on the pruned, padded batch,
    split over 3 DP ranks with global denominators, equal the core's numbers on the kept rows."""
    from verl.trainer.ppo import core_algos
    from verl.trainer.ppo.ray_trainer import compute_advantage
    from verl.utils.config import omega_conf_to_dataclass

    batch, _, rewards, expected = pruned
    batch.batch["token_level_rewards"] = batch.batch["rm_scores"]
    batch = compute_advantage(batch, adv_estimator="cppo", num_repeat=G, config=config.algorithm)
    real = ~torch.as_tensor(batch.non_tensor_batch["cppo_is_padding"])
    rows = batch.batch["row_id"][real]
    full_adv, _ = group_advantages(rewards.reshape(-1), torch.arange(B * G) // G)
    mask = batch.batch["response_mask"].float()
    adv = batch.batch["advantages"]
    torch.testing.assert_close(adv[real], full_adv[rows].unsqueeze(1) * mask[real], atol=1e-5, rtol=1e-5)
    assert adv[~real].abs().sum().item() == 0

    old = -torch.rand(mask.shape, generator=torch.Generator().manual_seed(0))
    new = old + 0.25 * torch.randn(mask.shape, generator=torch.Generator().manual_seed(1))
    actor_cfg = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    loss_fn = core_algos.get_policy_loss_fn("vanilla")
    dp = 3
    global_tokens = mask.sum().item()
    global_seqs = int((mask.sum(-1) > 0).sum())
    per_rank = []
    for shard in torch.arange(len(batch)).chunk(dp):  # veRL's dispatch: equal contiguous chunks
        # as veRL's workers do: the global denominators of the whole (kept) batch
        actor_cfg.global_batch_info.update(dp_size=dp, batch_num_tokens=global_tokens, global_batch_size=global_seqs)
        loss, _ = loss_fn(old[shard], new[shard], adv[shard], mask[shard], loss_agg_mode=mode, config=actor_cfg)
        per_rank.append(loss)
    verl_loss = torch.stack(per_rank).mean()  # DDP averages the ranks' gradients
    ours, _ = clipped_surrogate(new[real], old[real], full_adv[rows], clip_low=actor_cfg.clip_ratio)
    core_loss = aggregate_loss(ours, mask[real], mode)
    torch.testing.assert_close(verl_loss, core_loss, atol=1e-6, rtol=1e-5)
    assert core_loss.abs().item() > 0


def test_inactive_without_cppo_estimator(plugin, config):
    from omegaconf import open_dict

    with open_dict(config):
        config.algorithm.adv_estimator = "grpo"
    batch = make_dataproto(rewards_table(seed=2, prompts=B, group=G), seed=2)
    metrics: dict = {}
    bare_trainer(config, dp_size=2)._balance_batch(batch, metrics=metrics)
    assert len(batch) == B * G and not any(k.startswith("cppo/") for k in metrics)


def test_with_allocation_kept_rows_fill_mini_batches_without_padding(plugin, config):
    """apply_allocation: 4 -> 16 prompts; 16 x k=2 = 32 kept = 2 mini-batches of 2 prompts x 8,
    exactly GRPO's 4 x 8 batch: no padding row on 2 DP ranks."""
    from omegaconf import open_dict

    from cppo_megatron.integrations.verl import apply_allocation

    with open_dict(config):
        config.actor_rollout_ref.actor.ppo_mini_batch_size = 2
    plan = apply_allocation(config)
    assert config.data.train_batch_size == 16 and plan.kept_per_step == 32
    batch = make_dataproto(rewards_table(seed=4, prompts=16, group=G), seed=4)
    metrics: dict = {}
    bare_trainer(config, dp_size=2)._balance_batch(batch, metrics=metrics)
    assert len(batch) == 32 and metrics["cppo/padding_rows"] == 0
    assert not batch.non_tensor_batch["cppo_is_padding"].any()
    assert len(batch) % (config.actor_rollout_ref.actor.ppo_mini_batch_size * G) == 0
    assert sorted(np.unique(batch.non_tensor_batch["uid"], return_counts=True)[1].tolist()) == [2] * 16


def test_run_without_our_entry_point_warns_that_allocation_was_skipped(plugin, config, monkeypatch):
    """veRL's own main_ppo with the plugin loaded never calls prepare(): the hook says so once,
    with the numbers, instead of training k/G of the completions without a word."""
    import warnings

    from omegaconf import open_dict

    from cppo_megatron.integrations.verl import hook
    from cppo_megatron.integrations.verl.runconfig import PREPARED_ENV

    monkeypatch.delenv(PREPARED_ENV, raising=False)
    monkeypatch.setattr(hook, "_UNPREPARED_WARNED", False)
    batch = make_dataproto(rewards_table(seed=2, prompts=B, group=G), seed=2)
    with pytest.warns(UserWarning) as caught:
        bare_trainer(config, dp_size=2)._balance_batch(batch, metrics={})
    # (a first import of veRL's trainer may warn about other things: keep ours)
    assert [str(w.message) for w in caught if str(w.message).startswith("cppo:")] == [
        "cppo: this veRL run did not start through `cppo-megatron verl` (python -m "
        "cppo_megatron.integrations.verl.main), so allocation was not applied: data.train_batch_size=4 prompts "
        "keep 2 of G=8 completions each, 8 per step instead of 32 (the paper's setting draws "
        "data.train_batch_size=16); run it through that entry point with the same overrides, or set the sizes "
        f"yourself and export {PREPARED_ENV}=1 to silence this"]
    with warnings.catch_warnings(record=True) as again:  # once per process
        warnings.simplefilter("always")
        bare_trainer(config, dp_size=2)._balance_batch(make_dataproto(rewards_table(seed=2, prompts=B, group=G),
                                                                      seed=2), metrics={})
    assert not [w for w in again if str(w.message).startswith("cppo:")]
    # a run prepared by our entry point carries the variable into every Ray worker: silent
    monkeypatch.setattr(hook, "_UNPREPARED_WARNED", False)
    monkeypatch.setenv(PREPARED_ENV, "1")
    assert hook.warn_if_unprepared(config) is False
    monkeypatch.delenv(PREPARED_ENV)
    with open_dict(config):
        config.cppo.allocation = False
        config.actor_rollout_ref.actor.ppo_mini_batch_size = 4
    with pytest.warns(UserWarning, match=r"the mini-batches were not shrunk to the kept count: "
                                         r"actor.ppo_mini_batch_size=4 prompts where 1 would follow"):
        assert hook.warn_if_unprepared(config) is True


@pytest.mark.parametrize("estimator", ["cppo", "grpo"])
def test_signal_metrics_over_the_rows_before_pruning(plugin, config, estimator):
    """signal/* at the seam, with the cppo estimator and without it: core.signal over every row
    that reached it (before pruning), lengths from the response mask."""
    from omegaconf import open_dict

    from cppo_megatron.core.signal import signal_metrics

    with open_dict(config):
        config.algorithm.adv_estimator = estimator
    rewards = rewards_table(seed=2, prompts=B, group=G)
    rewards[1] = 1.1  # one all-correct group beside the all-wrong group 0
    batch = make_dataproto(rewards, seed=2)
    lengths = batch.batch["response_mask"].sum(-1)
    metrics: dict = {}
    bare_trainer(config, dp_size=2)._balance_batch(batch, metrics=metrics)
    want = signal_metrics(rewards.reshape(-1), torch.arange(B * G) // G, lengths=lengths)
    assert {k: v for k, v in metrics.items() if k.startswith("signal/")} == want
    assert want["signal/all_correct_share"] == want["signal/all_wrong_share"] == 0.25
    assert want["signal/generated_tokens"] == float(lengths.sum()) and want["signal/completions"] == B * G


def test_signal_gen_share_in_verl_timing_metrics(plugin):
    from verl.trainer.ppo import ray_trainer
    from verl.trainer.ppo.v1 import trainer_base

    batch = make_dataproto(rewards_table(seed=2, prompts=B, group=G), seed=2)
    for module in (ray_trainer, trainer_base):
        out = module.compute_timing_metrics(batch=batch, timing_raw={"gen": 3.0, "step": 4.0, "update_actor": 1.0})
        assert out["signal/gen_share"] == 0.75 and out["timing_s/gen"] == 3.0
        assert "signal/gen_share" not in module.compute_timing_metrics(batch, {"update_actor": 1.0})


def test_signal_of_batches_without_rewards_and_the_timing_seam_lifecycle(plugin):
    """A batch without rm_scores (a reward model's run) gives no signal/*; the timing wrapper comes
    off and goes back on, and refuses a veRL that no longer imports the timing function."""
    from types import SimpleNamespace

    from verl.trainer.ppo import ray_trainer

    from cppo_megatron.integrations import wrap
    from cppo_megatron.integrations.verl import signal

    batch = make_dataproto(rewards_table(seed=2, prompts=B, group=G), seed=2)
    batch.batch.pop("rm_scores")
    assert signal.dataproto_signal(batch) == {}
    assert signal.kv_batch_signal(SimpleNamespace(keys=["a"], tags=[{"is_padding": True}], partition_id="x")) == {}
    signal.uninstall()
    assert not wrap.is_wrapped(ray_trainer.compute_timing_metrics, signal.WRAP_TAG)
    signal.install()
    assert wrap.is_wrapped(ray_trainer.compute_timing_metrics, signal.WRAP_TAG)
    with pytest.raises(RuntimeError, match="no longer imports compute_timing_metrics"):
        signal._patch(SimpleNamespace(__name__="verl.fake"))
