"""The unmodified veRL 0.9.1 loop on CPU with veRL's MEGATRON engine (``strategy: megatron``,
mbridge, megatron-core on gloo) and the plugin: TP 2 x DP 2 (4 worker ranks, distributed
optimizer, sequence parallel), rollout through our ``hf`` replica, checked against the core
through the audit records.

Two real `cppo-megatron verl` runs of ``recipes/verl/tiny_cpu_megatron_cppo.yaml`` (2 steps
each, 4 prompts x G = 8, from a random-init export of the main job's model):

- the V1 loop with CPPO (P = 0.75, allocation: 16 prompts drawn), packed (thd) sequences;
- the legacy loop with P = 0 through the same estimator and hook (GRPO), padded (bshd)
  sequences — so both attention-mask paths of the CPU mode run inside the loop.
"""

from __future__ import annotations

import importlib.util
import math
import os

import pytest

from .test_cpu_e2e import (
    CHECKPOINTS,
    PROMPTS,
    STEPS,
    G,
    by_step,
    core_survivors,
    export_tiny_model,
    full_group_advantages,
    run_verl,
)

pytestmark = pytest.mark.verl
pytest.importorskip("megatron.core", reason="megatron-core is not installed (extra: megatron)")
# the recipe's route (vanilla_mbridge: true); the Megatron-Bridge environment runs its own module,
# test_cpu_megatron_bridge.py, with these checks
needs_mbridge = pytest.mark.skipif(importlib.util.find_spec("mbridge") is None,
                                   reason="mbridge is not installed (extra: verl)")

RECIPE = "tiny_cpu_megatron_cppo.yaml"
P = 0.75
DP = 2  # 4 ranks / TP 2
# the hf rollout's fp32 probabilities vs the bf16 Megatron actor's, same weights (veRL's
# training/rollout_probs_diff_max; measured 3-4e-4 here)
PROBS_DIFF_MAX = 0.01


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from cppo_megatron.integrations.verl.cpu.vocab import pad_vocab

    out = export_tiny_model(tmp_path_factory.mktemp("model"))
    assert pad_vocab(out, 8) == 24  # as the recipe's cppo_cpu.vocab_multiple does: TP splits the rows
    return out


V1_CPPO = (f"cppo.pruning_rate={P}", *CHECKPOINTS)


@pytest.fixture(scope="module")
def v1_cppo(tiny_model, tmp_path_factory):
    return run_verl(RECIPE, tmp_path_factory.mktemp("mv1"), tiny_model, *V1_CPPO)


@pytest.fixture(scope="module")
def legacy_grpo(tiny_model, tmp_path_factory):
    return run_verl(RECIPE, tmp_path_factory.mktemp("mlegacy"), tiny_model, "cppo.pruning_rate=0.0",
                    "trainer.use_v1=false", "actor_rollout_ref.model.use_remove_padding=false",
                    "actor_rollout_ref.actor.megatron.use_remove_padding=false")


def check_rows_and_advantages(run, *, pruning_rate, loop, prompts_per_step=PROMPTS, group_size=G):
    """Per step: the old-policy pass and the update got exactly the core's survivors (each once,
    nothing else but loss-free padding), each with its full-group advantage. ``prompts_per_step``
    and ``group_size`` are the run's before allocation (``data.train_batch_size``, ``rollout.n``)."""
    records = run["audit"]
    prunes, olds, updates = by_step(records, "prune"), by_step(records, "old_log_prob"), by_step(records, "update")
    assert sorted(updates) == list(range(1, STEPS + 1)), sorted(updates)
    keep = int(group_size * (1 - pruning_rate))
    prompts = int(prompts_per_step * group_size / keep)  # allocation
    for step in range(1, STEPS + 1):
        (pr,), (old,), (up,) = prunes[step], olds[step], updates[step]
        assert pr["loop"] == old["loop"] == up["loop"] == loop
        assert len(pr["rows"]) == prompts * group_size and len(set(pr["uids"])) == prompts
        kept = core_survivors(pr["uids"], pr["rewards"], step, pruning_rate)
        assert kept == pr["kept"]
        want = sorted(pr["rows"][i] for i in kept)
        assert sorted(r for r, pad in zip(old["rows"], old["padding"]) if not pad) == want
        assert sorted(up["rows"]) == want and len(want) == prompts_per_step * group_size
        full = dict(zip(pr["rows"], full_group_advantages(pr["uids"], pr["rewards"])))
        reward = dict(zip(pr["rows"], pr["rewards"]))
        for row, adv, r in zip(up["rows"], up["advantages"], up["rewards"]):
            assert r == pytest.approx(reward[row], abs=1e-6)
            assert adv == pytest.approx(full[row], abs=1e-4), (step, row)
        m = run["metrics"][step]
        assert m["cppo/num_completions"] == prompts * group_size and m["cppo/num_kept"] == len(want)
        assert math.isfinite(m["actor/pg_loss"]) and 0 < m["actor/grad_norm"] < 1e4
        assert m["timing_s/update_actor"] > 0 and m["timing_s/old_log_prob"] > 0
        # the Megatron actor's log-probs (bf16, TP 2) agree with the rollout's (HF, fp32)
        assert m["training/rollout_probs_diff_max"] < PROBS_DIFF_MAX, m["training/rollout_probs_diff_max"]


def check_dp_loads(run):
    """Per step: the tokens each of the 2 DP ranks receives (veRL sends DP rank r the r-th
    contiguous half of the order entering the old-policy pass; its TP peer the same rows) are
    logged and equal a recomputation; the order is at least as balanced as arrival order."""
    olds = by_step(run["audit"], "old_log_prob")
    for step in range(1, STEPS + 1):
        (old,) = olds[step]
        m = run["metrics"][step]
        lens = old["seq_lens"]
        assert len(lens) % DP == 0 and m["cppo/dp_size"] == DP
        half = len(lens) // DP
        loads = [sum(lens[r * half:(r + 1) * half]) for r in range(DP)]
        assert [m[f"cppo/dp_rank{r}_tokens"] for r in range(DP)] == loads
        assert m["cppo/dp_tokens_imbalance"] == pytest.approx(max(loads) / (sum(loads) / DP))
        assert m["cppo/dp_tokens_imbalance_unbalanced"] >= 1.0
        # the balancer used (core or veRL's Karmarkar-Karp) has the smaller workload imbalance
        assert m["cppo/balance_used_core"] in (0.0, 1.0)


def check_syncs(run, model_dir):
    """The rollout server holds exactly the actor's exported tensors after each sync; the first
    sync sends the start model's safetensors exactly (in the engine's bf16); each update moves them."""
    import torch
    from safetensors.torch import load_file

    syncs = [r for r in run["audit"] if r["kind"] == "sync"]
    assert [s["global_steps"] for s in syncs] == list(range(STEPS + 1)), syncs
    for s in syncs:
        assert s["missing"] == [] and s["max_abs_diff"] == 0.0, s
    weights = load_file(model_dir / "model.safetensors")
    safe = {k: float(v.to(torch.bfloat16).double().abs().sum()) for k, v in weights.items()}
    first = syncs[0]["sums"]
    assert set(safe) <= set(first) and set(first) - set(safe) <= {"lm_head.weight"}, (sorted(first), sorted(safe))
    assert {k: first[k] for k in safe} == safe
    if "lm_head.weight" in first and "lm_head.weight" not in safe:  # tied: the head is the embedding
        assert first["lm_head.weight"] == safe["model.embed_tokens.weight"]
    prints = [s["fingerprint"] for s in syncs]
    assert all(a != b for a, b in zip(prints, prints[1:])), prints


@needs_mbridge
def test_v1_cppo_megatron_tp2_dp2_trains_the_core_survivors(v1_cppo, tiny_model):
    check_rows_and_advantages(v1_cppo, pruning_rate=P, loop="v1")
    check_dp_loads(v1_cppo)
    check_syncs(v1_cppo, tiny_model)


# CI time: the legacy loop's plain GRPO on Megatron (padded attention, also checked at engine level in
# test_cpu_megatron_engine.py) runs with E2E_TESTS=all
@needs_mbridge
@pytest.mark.skipif(os.environ.get("E2E_TESTS", "") != "all", reason="the legacy Megatron GRPO run runs with E2E_TESTS=all")
def test_legacy_grpo_megatron_tp2_dp2_padded_keeps_every_row(legacy_grpo, tiny_model):
    check_rows_and_advantages(legacy_grpo, pruning_rate=0.0, loop="legacy")
    check_dp_loads(legacy_grpo)
    check_syncs(legacy_grpo, tiny_model)


# ------------------------------------------------------------------------------ a dead worker, resume
# CI: the driver SIGKILLed during step 2 after step 1's checkpoint, then the same command to the end
# (2 more TP 2 x DP 2 runs, ~2 min); RESUME_TESTS=all puts a dead worker rank first (one more run,
# as the FSDP chain of test_cpu_e2e.py does in CI) — docs/integrations/verl.md
FULL_CHAIN = os.environ.get("RESUME_TESTS", "") == "all"


@pytest.fixture(scope="module")
def chain(tiny_model, tmp_path_factory):
    """The run of ``v1_cppo`` again in one run dir: (with RESUME_TESTS=all: worker rank 1, TP peer of
    rank 0 on DP rank 0, SIGKILLed during step 2, after step 1's checkpoint;) the same command, its
    driver SIGKILLed during step 2; the same command, to the end."""
    from . import resume

    tmp = tmp_path_factory.mktemp("mchain")
    attempts = []
    if FULL_CHAIN:
        attempts.append(run_verl(RECIPE, tmp, tiny_model, *V1_CPPO, attempt="1",
                                 when=resume.strike_during(2, "worker", rank=1), expect_ok=False))
    attempts.append(run_verl(RECIPE, tmp, tiny_model, *V1_CPPO, attempt="2", when=resume.strike_during(2, "driver"),
                             expect_ok=False))
    return [*attempts, run_verl(RECIPE, tmp, tiny_model, *V1_CPPO, attempt="3")]


@needs_mbridge
@pytest.mark.skipif(not FULL_CHAIN, reason="the Megatron dead-worker run runs with RESUME_TESTS=all (CI: the FSDP one)")
def test_a_dead_worker_rank_ends_the_run_with_a_message_naming_it(chain):
    from . import resume

    resume.check_dead_worker(chain[0], rank=1, resume_from=1)


@needs_mbridge
def test_resume_after_a_sigkill_of_the_driver_tp2_dp2(v1_cppo, chain):
    from . import resume

    kills = [1] * (len(chain) - 1)
    assert chain[-2]["run"].struck == "driver" and chain[-2]["run"].returncode == -9
    resume.check_chain(v1_cppo, chain, kills=kills, steps=STEPS, pruning_rate=P, prompts_per_step=PROMPTS)
