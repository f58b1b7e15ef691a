import json
from dataclasses import replace

import numpy as np
import pytest

from cppo_megatron.bench.simulate import (
    PAPER,
    PAPER_CHECK_TOLERANCE,
    ClusterSim,
    decode_time,
    forward_flops,
    predict,
    run_paper_check,
    simulate_step,
    train_seconds,
)

A100_PEAK, A100_BW = 312e12, 2.039e12
P15 = 1.54e9  # Qwen2.5-1.5B parameters; 28 layers, hidden 1536, 2 KV heads x 128


def test_decode_time_hand_computed():
    cfg = ClusterSim(model="1.5B", gpu="A100-80GB", group_size=4, prompt_len=100, iter_overhead_s=0.004,
                     seq_overhead_s=1e-5, gen_mfu=0.5, bw_eff=0.7)
    kv = 2 * 28 * 2 * 128 * 2  # bytes per token of context: K and V, bf16
    expected = 0.0
    for t in range(10):  # 4 sequences of 10 tokens run side by side for 10 iterations
        compute = 4 * 2 * P15 / (A100_PEAK * 0.5)
        memory = (2 * P15 + 4 * (100 + t) * kv) / (A100_BW * 0.7)
        expected += 0.004 + 4 * 1e-5 + max(compute, memory)
    expected += 2 * P15 * 1 * 100 / (A100_PEAK * 0.5)  # prefill of the one prompt
    assert decode_time(cfg, np.array([10, 10, 10, 10])) == pytest.approx(expected, rel=1e-12)


def test_one_slot_decodes_sequences_back_to_back():
    cfg = ClusterSim(model="7B", group_size=1, max_num_seqs=1)
    both = decode_time(cfg, np.array([3, 5]))
    assert both == pytest.approx(decode_time(cfg, np.array([3])) + decode_time(cfg, np.array([5])), rel=1e-12)
    # with room for both, they overlap: one 5-iteration batch instead of 8 iterations
    assert decode_time(replace(cfg, max_num_seqs=2), np.array([3, 5])) < both


def test_forward_flops_and_train_seconds_hand_computed():
    cfg = ClusterSim(model="1.5B", tp=2, pp=2, train_mfu=0.25)
    assert forward_flops(cfg, np.array([100.0]))[0] == pytest.approx(2 * P15 * 100 + 2 * 28 * 1536 * 100**2)
    t = train_seconds(cfg, np.array([1e15]), np.array([4.0]))
    assert t[0] == pytest.approx(1e15 / (2 * 2 * A100_PEAK * 0.25) * (1 + 1 / 4))  # bubble (pp-1)/micro-batches
    tok = replace(cfg, train_tokens_per_gpu=1000.0)
    assert train_seconds(tok, np.array([6 * P15 * 8000]), np.array([1e9]))[0] == pytest.approx(2.0, rel=1e-6)


def test_allocation_draws_capacity_over_keep_prompts():
    cfg = ClusterSim(model="1.5B", dp=2, capacity=64, group_size=16)
    step = simulate_step(cfg, 0.875, np.random.default_rng(0))
    assert (step["prompts"], step["generated"], step["trained"]) == (32, 512, 64)
    step = simulate_step(replace(cfg, allocation=False), 0.875, np.random.default_rng(0))
    assert (step["prompts"], step["generated"], step["trained"]) == (4, 64, 8)


def test_without_allocation_fixed_lengths_speedup_equals_bound():
    # same rollout, training shrinks exactly by (1 - P): the prediction is the bound
    cfg = ClusterSim(model="1.5B", dp=2, capacity=64, group_size=16, response_sigma=0.0, allocation=False, samples=1)
    rows = {r["P"]: r for r in predict(cfg, [0.5, 0.75])}
    base = rows[0.0]
    fixed = sum(base[f"{k}_s"] for k in ("rollout", "reward", "sync", "overhead"))
    rest = sum(base[f"{k}_s"] for k in ("old_logprob", "ref_logprob", "update"))
    for p in (0.5, 0.75):
        assert rows[p]["rollout_s"] == pytest.approx(base["rollout_s"])
        assert rows[p]["speedup"] == pytest.approx((fixed + rest) / (fixed + (1 - p) * rest), rel=1e-9)
        assert rows[p]["speedup"] == pytest.approx(rows[p]["bound"], rel=1e-9)
        assert rows[p]["dp_imbalance_naive"] == pytest.approx(1.0)


def test_rebalancing_removes_most_straggler_cost():
    cfg = ClusterSim(model="7B", dp=8, capacity=256, response_sigma=1.0, samples=2)
    row = predict(cfg, [0.875])[-1]
    assert row["dp_imbalance_naive"] > row["dp_imbalance_balanced"] >= 1.0
    assert row["straggler_naive_s"] > 10 * row["straggler_balanced_s"]


def test_cluster_validation_names_the_field():
    with pytest.raises(ValueError, match="model must be one of"):
        ClusterSim(model="3B").validate()
    with pytest.raises(ValueError, match="rollout_tp=3 must divide the 8 rollout GPUs"):
        ClusterSim(rollout_tp=3).validate()
    with pytest.raises(ValueError, match=r"train_mfu must be in \(0, 1\]"):
        ClusterSim(train_mfu=1.5).validate()
    with pytest.raises(ValueError, match="pruning rates must be in"):
        predict(ClusterSim(samples=1), [1.0])


def test_paper_check_within_the_documented_error_bound():
    """docs/benchmarks.md promises every published point within +-25% with the defaults."""
    rep = run_paper_check(log=lambda *_: None)  # the CLI's default samples
    assert len(rep.rows) == 8
    for r in rep.rows:
        assert r["published"] == PAPER[r["setup"]][r["P"]]
        assert r["ratio"] == pytest.approx(r["predicted"] / r["published"])
        assert abs(r["ratio"] - 1) <= PAPER_CHECK_TOLERANCE, r
        # the attribution multiplies out, and pruning alone beats neither 1 nor the total
        assert r["batching_gain"] * r["vs_same_batch_grpo"] == pytest.approx(r["predicted"], rel=1e-9)
        assert 1.0 < r["vs_same_batch_grpo"] < r["predicted"]
    assert rep.extras["max_abs_rel_error"] <= PAPER_CHECK_TOLERANCE
    json.dumps(rep.to_json())


def test_speedup_attribution_batching_times_pruning():
    cfg = ClusterSim(model="1.5B", dp=1, capacity=16, group_size=16, rollout_gpus=1, samples=2)
    rows = {r["P"]: r for r in predict(cfg, [0.875])}
    r = rows[0.875]
    # the same-batch GRPO generates for CPPO's 8 prompts and trains all 128 completions
    same = predict(replace(cfg, capacity=128), [])[0]
    assert r["grpo_same_batch_s_per_prompt"] == pytest.approx(same["s_per_prompt"], rel=1e-12)
    assert same["rollout_s"] == pytest.approx(r["rollout_s"], rel=1e-12)  # identical rollout
    assert r["batching_gain"] == pytest.approx(rows[0.0]["s_per_prompt"] / same["s_per_prompt"])
    assert r["pruning_gain"] == pytest.approx(same["s_per_prompt"] / r["s_per_prompt"])
    assert r["speedup"] == pytest.approx(r["batching_gain"] * r["pruning_gain"])
    # without allocation the rollout batch does not grow: no batching gain, all pruning
    off = predict(replace(cfg, allocation=False), [0.875])[-1]
    assert off["batching_gain"] == pytest.approx(1.0) and off["pruning_gain"] == pytest.approx(off["speedup"])
