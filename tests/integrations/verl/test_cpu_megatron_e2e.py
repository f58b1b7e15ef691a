"""The unmodified veRL 0.9.1 loop on CPU with veRL's MEGATRON engine (``strategy: megatron``,
mbridge, megatron-core on gloo) and the plugin: TP 2 x DP 2 (4 worker ranks, distributed
optimizer, sequence parallel), rollout through veRL's own vLLM server (one replica, vLLM tensor
parallel 4 over the 4 worker ranks), checked against the core through the audit records.

Real `cppo-megatron verl` runs of ``recipes/verl/tiny_cpu_megatron_cppo.yaml`` (2 steps each,
4 prompts x G = 8, from a random-init export of the main job's model, vocabulary padded to 24 rows
whose 5 new rows are named in the tokenizer, cpu/vocab.py):

- the V1 loop with CPPO (P = 0.75, allocation: 16 prompts drawn), packed (thd) sequences, on vLLM:
  each of the 4 vLLM workers serves its shard of exactly the tensors the actor sent; ~5 min;
- the resume chain of that run (driver SIGKILLed, then resumed) on the ``hf`` stand-in, for CI time;
- with E2E_TESTS=all, the legacy loop with P = 0 through the same estimator and hook (GRPO), padded
  (bshd) sequences — so both attention-mask paths of the CPU mode run inside the loop.
"""

from __future__ import annotations

import importlib.util
import math
import os

import pytest

from .test_cpu_e2e import (
    CHECKPOINTS,
    HF,
    PROMPTS,
    STEPS,
    G,
    by_step,
    check_rollout_logprobs,
    check_vllm_syncs,
    core_survivors,
    export_tiny_model,
    full_group_advantages,
    needs_vllm,
    run_verl,
)

pytestmark = [pytest.mark.verl, pytest.mark.usefixtures("shm_registry")]  # nothing of ours left in /dev/shm
pytest.importorskip("megatron.core", reason="megatron-core is not installed (extra: megatron)")
# the recipe's route (vanilla_mbridge: true); the Megatron-Bridge environment runs its own module,
# test_cpu_megatron_bridge.py, with these checks
needs_mbridge = pytest.mark.skipif(importlib.util.find_spec("mbridge") is None,
                                   reason="mbridge is not installed (extra: verl)")

RECIPE = "tiny_cpu_megatron_cppo.yaml"
P = 0.75
DP = 2  # 4 ranks / TP 2
VLLM_WORKERS = 4  # the recipe's rollout: one replica of vLLM tensor parallel 4
# the rollout's probabilities vs the bf16 Megatron actor's, same weights (veRL's
# training/rollout_probs_diff_max; measured 3-4e-4 with the fp32 hf rollout)
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


def start_model_sums(model_dir) -> dict[str, float]:
    """sum |w| of each tensor of the start model's safetensors, in the engine's bf16."""
    import torch
    from safetensors.torch import load_file

    weights = load_file(model_dir / "model.safetensors")
    return {k: float(v.to(torch.bfloat16).double().abs().sum()) for k, v in weights.items()}


def check_syncs(run, model_dir):
    """The ``hf`` rollout server holds exactly the actor's exported tensors after each sync; the first
    sync sends the start model's safetensors exactly (in the engine's bf16); each update moves them."""
    import torch
    from safetensors.torch import load_file

    syncs = [r for r in run["audit"] if r["kind"] == "sync"]
    assert [s["global_steps"] for s in syncs] == list(range(STEPS + 1)), syncs
    for s in syncs:
        assert s["missing"] == [] and s["max_abs_diff"] == 0.0, s
    safe = start_model_sums(model_dir)
    first = syncs[0]["sums"]
    assert set(safe) <= set(first) and set(first) - set(safe) <= {"lm_head.weight"}, (sorted(first), sorted(safe))
    assert {k: first[k] for k in safe} == safe
    if "lm_head.weight" in first and "lm_head.weight" not in safe:  # tied: the head is the embedding
        assert first["lm_head.weight"] == safe["model.embed_tokens.weight"]
    prints = [s["fingerprint"] for s in syncs]
    assert all(a != b for a, b in zip(prints, prints[1:])), prints


@needs_mbridge
@needs_vllm
def test_v1_cppo_megatron_tp2_dp2_on_vllm_tp4_trains_the_core_survivors(v1_cppo, tiny_model, shm_registry):
    from cppo_megatron.integrations import vllm_shm

    check_rows_and_advantages(v1_cppo, pruning_rate=P, loop="v1")
    check_dp_loads(v1_cppo)
    # the start model's tensors first, then each update's: every TP rank of vLLM serves its shard of them
    check_vllm_syncs(v1_cppo["audit"], workers=VLLM_WORKERS, start_sums=start_model_sums(tiny_model))
    assert check_rollout_logprobs(v1_cppo, tolerance=PROBS_DIFF_MAX) == [1, 2]
    # vLLM TP 4's CPU communicator made one segment per rank (vLLM leaves them when its workers are killed):
    # recorded as made, removed by the launcher at the run's end
    cpushm = [name for kind, name in vllm_shm.recorded(shm_registry) if kind == "shm" and "-cpushm_" in name]
    assert len(cpushm) >= VLLM_WORKERS and {n.rsplit("_", 1)[1] for n in cpushm} == {str(r) for r in range(4)}
    assert vllm_shm.left(shm_registry) == []


# CI time: the legacy loop's plain GRPO on Megatron (padded attention, also checked at engine level in
# test_cpu_megatron_engine.py) runs with E2E_TESTS=all
@needs_mbridge
@needs_vllm
@pytest.mark.skipif(os.environ.get("E2E_TESTS", "") != "all", reason="the legacy Megatron GRPO run runs with E2E_TESTS=all")
def test_legacy_grpo_megatron_tp2_dp2_padded_keeps_every_row(legacy_grpo, tiny_model):
    check_rows_and_advantages(legacy_grpo, pruning_rate=0.0, loop="legacy")
    check_dp_loads(legacy_grpo)
    check_vllm_syncs(legacy_grpo["audit"], workers=VLLM_WORKERS, start_sums=start_model_sums(tiny_model))
    assert check_rollout_logprobs(legacy_grpo, tolerance=PROBS_DIFF_MAX) == [1, 2]


# ------------------------------------------------------------------------------ a dead worker, resume
# CI: the driver SIGKILLed during step 2 after step 1's checkpoint, then the same command to the end
# (2 more TP 2 x DP 2 runs, ~2 min); RESUME_TESTS=all puts a dead worker rank first (one more run,
# as the FSDP chain of test_cpu_e2e.py does in CI) — docs/records/verl_features.md
FULL_CHAIN = os.environ.get("RESUME_TESTS", "") == "all"


@pytest.fixture(scope="module")
def chain(tiny_model, tmp_path_factory):
    """The run of ``v1_cppo``, generating with the ``hf`` stand-in (CI time), again in one run dir: (with RESUME_TESTS=all: worker rank 1, TP peer of
    rank 0 on DP rank 0, SIGKILLed during step 2, after step 1's checkpoint;) the same command, its
    driver SIGKILLed during step 2; the same command, to the end."""
    from . import resume

    tmp = tmp_path_factory.mktemp("mchain")
    attempts = []
    if FULL_CHAIN:
        attempts.append(run_verl(RECIPE, tmp, tiny_model, *V1_CPPO, *HF, attempt="1",
                                 when=resume.strike_during(2, "worker", rank=1), expect_ok=False))
    attempts.append(run_verl(RECIPE, tmp, tiny_model, *V1_CPPO, *HF, attempt="2",
                             when=resume.strike_during(2, "driver"), expect_ok=False))
    return [*attempts, run_verl(RECIPE, tmp, tiny_model, *V1_CPPO, *HF, attempt="3")]


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
