"""The hook in veRL's default V1 trainer: the real ``PPOTrainerSync._balance_batch``
(wrapped) and ``_compute_advantage`` on a ``KVBatchMeta`` whose rows live in a real
TransferQueue (SimpleStorage on a local Ray), as the agent loop leaves them."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from cppo_megatron import CPPOConfig
from cppo_megatron.core import group_advantages, prune

from .batches import rewards_table

B, G, STEP, DP = 4, 8, 7, 3
EOS = 2


@pytest.fixture(scope="module")
def tq():
    ray = pytest.importorskip("ray")
    transfer_queue = pytest.importorskip("transfer_queue")
    from omegaconf import OmegaConf

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    transfer_queue.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1, "total_storage_size": 4096}}}))
    yield transfer_queue
    transfer_queue.close()
    ray.shutdown()


def jagged(rows):
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def put_rollout(tq, rewards: torch.Tensor, seed: int):
    """B x G single-turn outputs under keys ``{uid}_{session}_0``; returns (meta, keys)."""
    from transfer_queue import KVBatchMeta
    from verl.utils import tensordict_utils as tu

    gen = torch.Generator().manual_seed(seed)
    n = B * G
    p_len = torch.randint(2, 7, (B,), generator=gen).repeat_interleave(G)
    r_len = torch.randint(2, 11, (n,), generator=gen)
    prompts = [torch.randint(3, 100, (int(p_len[i]),), generator=gen) for i in range(n)]
    responses = [torch.randint(3, 100, (int(r_len[i]),), generator=gen) for i in range(n)]
    scores = []
    for i in range(n):
        s = torch.zeros(int(r_len[i]))
        s[-1] = rewards.reshape(-1)[i]
        scores.append(s)
    fields = {
        "uid": np.array([f"p{i // G}" for i in range(n)], dtype=object),
        "prompts": jagged(prompts),
        "responses": jagged(responses),
        "input_ids": jagged([torch.cat([p, r]) for p, r in zip(prompts, responses)]),
        "attention_mask": jagged([torch.ones(len(p) + len(r), dtype=torch.int64) for p, r in zip(prompts, responses)]),
        "response_mask": jagged([torch.ones(len(r), dtype=torch.int64) for r in responses]),
        "rm_scores": jagged(scores),
        "rollout_log_probs": jagged([torch.zeros(len(r)) for r in responses]),
        "row_id": torch.arange(n),
    }
    keys = [f"p{i // G}_{i % G}_0" for i in range(n)]
    tags = [{"seq_len": int(p_len[i] + r_len[i]), "global_steps": STEP} for i in range(n)]
    tq.kv_batch_put(keys=keys, partition_id="train", fields=tu.get_tensordict(fields), tags=tags)
    return KVBatchMeta(keys=keys, tags=tags, partition_id="train"), keys


def bare_v1_trainer(config):
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    trainer = object.__new__(PPOTrainerSync)
    trainer.config = config
    trainer.global_steps = STEP
    trainer.use_critic = False
    trainer.actor_rollout_wg = SimpleNamespace(_dispatch_info={"actor": list(range(DP))})
    trainer.tokenizer = SimpleNamespace(eos_token_id=EOS)
    return trainer


def test_v1_prune_balance_advantage(tq, plugin, config):
    assert plugin.is_installed("verl.trainer.ppo.v1.trainer_base")
    rewards = rewards_table(seed=3, prompts=B, group=G)
    meta, keys = put_rollout(tq, rewards, seed=3)
    trainer = bare_v1_trainer(config)
    metrics: dict = {}
    out = trainer._balance_batch(meta, metrics=metrics)

    sel = prune(rewards.reshape(-1), torch.arange(B * G) // G, CPPOConfig(pruning_rate=0.75), step=STEP).selection
    kept_keys = {keys[i] for i in sel.kept.tolist()}
    real = [k for k, t in zip(out.keys, out.tags) if not t.get("is_padding", False)]
    assert set(real) == kept_keys and len(real) == len(kept_keys)  # exactly the survivors
    # pruned rows are gone from storage, the kept ones and veRL's padding rows remain
    stored = set(tq.kv_list("train")["train"])
    assert stored == set(out.keys) and not stored & (set(keys) - kept_keys)
    # loss-free padding to lcm(DP, mini-batch x n) by veRL's own upsampler
    assert len(out) % math.lcm(DP, config.actor_rollout_ref.actor.ppo_mini_batch_size * G) == 0
    assert metrics["cppo/padding_rows"] == len(out) - len(real) == 16
    assert metrics["cppo/rows_cleared"] == 24 and metrics["cppo/num_kept"] == 8
    assert "cppo/filter_passed_zero_variance" not in metrics  # DAPO's filter is off: nothing to count
    assert "global_seqlen/max" in metrics
    # the split the workers get (equal contiguous chunks) has the better of veRL's and the core's loads
    w = torch.tensor([t["seq_len"] for t in out.tags], dtype=torch.float64)
    w = 24576 * w + w * w
    final = float(w.view(DP, -1).sum(1).max()) / (float(w.sum()) / DP)
    best = min(metrics["cppo/balance_imbalance_verl"], metrics["cppo/balance_imbalance_core"])
    assert final == pytest.approx(best, rel=1e-12)
    # per-DP-rank token loads: the dispatched order's contiguous chunks; and the survivors'
    # arrival order (as pruned, veRL's padding after them) for the imbalance without rebalancing
    lens = [int(t["seq_len"]) for t in out.tags]
    chunks = [sum(lens[r * len(lens) // DP:(r + 1) * len(lens) // DP]) for r in range(DP)]
    assert [metrics[f"cppo/dp_rank{r}_tokens"] for r in range(DP)] == chunks and metrics["cppo/dp_size"] == DP
    assert metrics["cppo/dp_tokens_imbalance"] == pytest.approx(max(chunks) / (sum(chunks) / DP))
    by_key = dict(zip(out.keys, lens))
    arrival = [by_key[k] for k in keys if k in kept_keys] + [by_key[k] for k, t in zip(out.keys, out.tags)
                                                            if t.get("is_padding", False)]
    raw = [sum(arrival[r * len(arrival) // DP:(r + 1) * len(arrival) // DP]) for r in range(DP)]
    assert metrics["cppo/dp_tokens_imbalance_unbalanced"] == pytest.approx(max(raw) / (sum(raw) / DP))
    data = tq.kv_batch_get(keys=out.keys, partition_id="train", select_fields=["uid", "row_id", "response_mask", "rm_scores"])
    pad = torch.tensor([t.get("is_padding", False) for t in out.tags])
    rows = data["row_id"][~pad]
    assert [str(u) for u, p in zip(data["uid"], pad) if not p] == [f"p{r // G}" for r in rows.tolist()]
    assert all(int(m.sum()) == 0 for m, p in zip(data["response_mask"].unbind(), pad) if p)

    # the old-policy and reference passes would write these; then veRL's advantage step
    lengths = [int(m.numel()) for m in data["response_mask"].unbind()]
    from verl.utils import tensordict_utils as tu

    lp = {"old_log_probs": jagged([torch.full((n,), -1.0) for n in lengths]),
          "ref_log_prob": jagged([torch.full((n,), -1.1) for n in lengths])}
    tq.kv_batch_put(keys=out.keys, partition_id="train", fields=tu.get_tensordict(lp))
    trainer._compute_advantage(out, metrics)
    adv = tq.kv_batch_get(keys=out.keys, partition_id="train", select_fields=["advantages"])["advantages"]
    full, _ = group_advantages(rewards.reshape(-1), torch.arange(B * G) // G)
    got = torch.stack([a[0] for a, p in zip(adv.unbind(), pad) if not p])
    torch.testing.assert_close(got, full[rows].to(got.dtype), atol=1e-5, rtol=1e-5)
    assert all(a.abs().sum().item() == 0 for a, p in zip(adv.unbind(), pad) if p)
    tq.kv_clear(keys=out.keys, partition_id="train")



@pytest.mark.parametrize("estimator", ["cppo", "grpo"])
def test_v1_signal_metrics_over_the_rows_before_pruning(tq, plugin, config, estimator):
    """signal/* at V1's seam from TransferQueue, with and without the cppo estimator."""
    from omegaconf import open_dict

    from cppo_megatron.core.signal import signal_metrics

    with open_dict(config):
        config.algorithm.adv_estimator = estimator
    rewards = rewards_table(seed=5, prompts=B, group=G)
    meta, keys = put_rollout(tq, rewards, seed=5)
    lengths = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=["response_mask"])["response_mask"]
    lengths = torch.tensor([int(x.sum()) for x in lengths.unbind()])
    metrics: dict = {}
    bare_v1_trainer(config)._balance_batch(meta, metrics=metrics)
    want = signal_metrics(rewards.reshape(-1), torch.arange(B * G) // G, lengths=lengths)
    assert {k: v for k, v in metrics.items() if k.startswith("signal/")} == want
    assert want["signal/zero_variance_share"] == 0.25 and want["signal/all_wrong_share"] == 0.25
    tq.kv_clear(keys=list(tq.kv_list("train")["train"]), partition_id="train")

def test_dp_size_of_a_megatron_actor_is_world_over_model_parallel():
    """TP 2 x DP 2: veRL registers each worker's Megatron DP rank ([0, 0, 1, 1]), so the hook
    balances over 2 DP ranks, not the 4 workers; each DP rank gets one contiguous half."""
    from cppo_megatron.integrations.verl.hook import _v1_dp_size, dp_load_metrics, dp_token_loads

    trainer = SimpleNamespace(actor_rollout_wg=SimpleNamespace(_dispatch_info={"actor": [0, 0, 1, 1]}))
    assert _v1_dp_size(trainer) == 2
    assert dp_token_loads([5, 7, 1, 3], 2) == [12, 4]
    m = dp_load_metrics([5, 3, 7, 1], [5, 7, 1, 3], 2)
    assert (m["cppo/dp_rank0_tokens"], m["cppo/dp_rank1_tokens"]) == (8.0, 8.0)
    assert m["cppo/dp_tokens_imbalance"] == 1.0 and m["cppo/dp_tokens_imbalance_unbalanced"] == 1.5
    with pytest.raises(ValueError, match="dp_size=3"):
        dp_token_loads([1, 2, 3, 4], 3)


def test_a_step_reads_the_run_settings_kept_from_the_first_step_not_the_config(tq, plugin, config, monkeypatch):
    """The hook reads ``trainer.config`` once per run (``runconfig.settings_of``): a second step
    parses nothing, and a config changed under a running trainer does not change what it does."""
    from cppo_megatron.integrations.verl import runconfig

    calls = {"cppo_config_from": 0, "is_cppo": 0}

    def counted(name):
        real = getattr(runconfig, name)

        def spy(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)

        return spy

    for name in calls:
        monkeypatch.setattr(runconfig, name, counted(name))
    trainer = bare_v1_trainer(config)
    kept = []
    for step, seed in ((STEP, 5), (STEP + 1, 6)):
        trainer.global_steps = step
        meta, _ = put_rollout(tq, rewards_table(seed=seed, prompts=B, group=G), seed=seed)
        metrics: dict = {}
        out = trainer._balance_batch(meta, metrics=metrics)
        kept.append(metrics["cppo/num_kept"])
        tq.kv_clear(keys=list(out.keys), partition_id="train")
        if step == STEP:  # after the first step: the run's config says GRPO at P = 0 now
            config.algorithm.adv_estimator = "grpo"
            config.cppo.pruning_rate = 0.0
    assert calls == {"cppo_config_from": 1, "is_cppo": 1}
    assert kept == [8.0, 8.0]  # both steps pruned as the run started: keep 2 of G=8 for B=4 prompts
    assert runconfig.settings_of(trainer).cfg.rate == 0.75


@pytest.fixture
def train_tq(tq):
    """``tq``, its train partition emptied after the test whether it passed or not (no rows left to the next)."""
    yield tq
    left = list(tq.kv_list("train").get("train", {}))
    if left:
        tq.kv_clear(keys=left, partition_id="train")


def test_v1_with_rebalance_off_dispatches_verls_own_order(train_tq, plugin, config):
    """``cppo.rebalance=false``: the core's order is computed and reported but never used, even where it
    balances better; the workers get veRL's split (its imbalance, not the better of the two)."""
    tq = train_tq
    from omegaconf import open_dict

    with open_dict(config):
        config.cppo.rebalance = False
    rewards = rewards_table(seed=3, prompts=B, group=G)
    meta, keys = put_rollout(tq, rewards, seed=3)
    metrics: dict = {}
    out = bare_v1_trainer(config)._balance_batch(meta, metrics=metrics)
    assert metrics["cppo/balance_imbalance_core"] < metrics["cppo/balance_imbalance_verl"]  # the core would help
    assert metrics["cppo/balance_used_core"] == 0.0
    w = torch.tensor([t["seq_len"] for t in out.tags], dtype=torch.float64)
    w = 24576 * w + w * w
    final = float(w.view(DP, -1).sum(1).max()) / (float(w.sum()) / DP)
    assert final == pytest.approx(metrics["cppo/balance_imbalance_verl"], rel=1e-12)


def test_v1_early_stopping_never_reads_a_stopped_reward_and_clears_the_stopped_rows(train_tq, plugin, config):
    """``cppo.early_stop``: each row's ``extra_fields["cppo_early_stop"]`` (as the agent loop leaves it)
    says which rows were stopped; their rewards (planted 99) enter no statistic, they are never kept,
    they leave TransferQueue with the pruned rows, ``signal/*`` is over the finished rows only, and the
    step's ``early_stop/*`` accounting adds up."""
    tq = train_tq
    from omegaconf import OmegaConf

    from cppo_megatron.core.early_stop import early_stop_prune, imputed_moments
    from cppo_megatron.core.signal import signal_metrics
    from cppo_megatron.integrations.verl import runconfig

    OmegaConf.update(config, "cppo.early_stop.enabled", True, force_add=True)
    cfg = runconfig.cppo_config_from(config)
    rewards = rewards_table(seed=4, prompts=B, group=G).reshape(-1)
    stopped = torch.zeros(B * G, dtype=torch.bool)
    stopped[[1, 2, 9, 17, 18, 19, 30]] = True
    rewards[stopped] = 99.0
    q = [0.2 if s else None for s in stopped.tolist()]  # a stopped row's last score; the others never scored
    infos = [{"stopped": bool(s), "stopped_at": 4 if s else -1, "q": qq, "explore": False, "shadow": False,
              "records": [[4, [0.0] * 10, qq]] if s else [], "ready": True, "version": 2, "degraded": False}
             for s, qq in zip(stopped.tolist(), q, strict=True)]
    meta, keys = put_rollout(tq, rewards.reshape(B, G), seed=4)
    from verl.utils import tensordict_utils as tu

    extra = np.array([{"cppo_early_stop": info, "global_steps": STEP} for info in infos], dtype=object)
    tq.kv_batch_put(keys=keys, partition_id="train", fields=tu.get_tensordict({"extra_fields": extra}))
    lengths = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=["response_mask"])["response_mask"]
    lengths = torch.tensor([int(x.sum()) for x in lengths.unbind()])
    metrics: dict = {}
    trainer = bare_v1_trainer(config)
    out = trainer._balance_batch(meta, metrics=metrics)

    # the decision: the core's, with q = 0.2's imputed moments for the stopped rows (an unfitted predictor's means)
    from cppo_megatron.core.early_stop import PrefixPredictor

    mu, sq = imputed_moments(torch.tensor([0.2 if s else 0.5 for s in stopped.tolist()], dtype=torch.float64),
                             PrefixPredictor().class_means)
    want = early_stop_prune(rewards, stopped, torch.arange(B * G) // G, cfg, expected=mu, expected_sq=sq, step=STEP)
    kept = {keys[i] for i in want.selection.kept.tolist()}
    real = {k for k, t in zip(out.keys, out.tags, strict=True) if not t.get("is_padding", False)}
    assert real == kept and not kept & {keys[i] for i in stopped.nonzero().squeeze(1).tolist()}
    stored = set(tq.kv_list("train")["train"])
    assert stored == set(out.keys)  # stopped and pruned rows cleared alike
    assert metrics["cppo/rows_cleared"] == B * G - len(kept)
    fin = (~stopped).nonzero().squeeze(1)
    assert {k: v for k, v in metrics.items() if k.startswith("signal/")} == signal_metrics(
        rewards[fin], (torch.arange(B * G) // G)[fin], lengths=lengths[fin])
    assert metrics["early_stop/started"] == B * G and metrics["early_stop/stopped"] == 7
    assert metrics["early_stop/kept"] == len(kept) and metrics["early_stop/pruned_after"] == B * G - 7 - len(kept)
    assert metrics["early_stop/tokens_stopped"] == int(lengths[stopped].sum())
    assert metrics["early_stop/reward_mean_estimate"] < 1.0  # the 99s never entered it
    # veRL's advantage step then gives each survivor the advantage against its full group's statistics,
    # the stopped rows in them by their imputed moments (the cppo estimator reads what the seam recorded)
    from verl.utils import tensordict_utils as tu

    data = tq.kv_batch_get(keys=out.keys, partition_id="train", select_fields=["row_id", "response_mask"])
    pad = torch.tensor([t.get("is_padding", False) for t in out.tags])
    lp = {name: jagged([torch.full((int(m.numel()),), -1.0) for m in data["response_mask"].unbind()])
          for name in ("old_log_probs", "ref_log_prob")}
    tq.kv_batch_put(keys=out.keys, partition_id="train", fields=tu.get_tensordict(lp))
    trainer._compute_advantage(out, metrics)
    adv = tq.kv_batch_get(keys=out.keys, partition_id="train", select_fields=["advantages"])["advantages"]
    got = torch.stack([a[0] for a, p in zip(adv.unbind(), pad, strict=True) if not p])
    torch.testing.assert_close(got, want.advantages[data["row_id"][~pad]].to(got.dtype), atol=1e-5, rtol=1e-5)
