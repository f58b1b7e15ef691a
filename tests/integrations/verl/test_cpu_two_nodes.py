"""The 14B Megatron cluster recipe on TWO Ray nodes, at toy size: ``qwen2.5-14b-math-megatron-cppo.yaml
--cpu recipes/verl/cpu_toy.yaml trainer.nnodes=2 trainer.n_gpus_per_node=2`` against a Ray cluster
started the way a cluster is (``ray start --head`` + ``ray start --address=...`` as a second node
with its own 2 logical GPUs; ``LocalRayCluster``: own temp dir and ports, stopped in teardown),
the run connecting through ``ray_kwargs.ray_init.address``.

veRL places one resource pool bundle set per node, so the 4 Megatron ranks sit 2 and 2 on the two
nodes; with TP 2 x PP 2 (TP innermost in megatron-core's rank order) each node holds one pipeline
stage: the pipeline's activations and gradients cross the nodes. Checked per step from the audit
records as in the single-node run: exactly the core's survivors are trained, each with its
full-group advantage; every weight sync is exact; from the ``placement`` records: which node
each rank (TP, PP) ran on; and from the key trace, as ``test_cpu_cluster_recipe.py`` (whose
single-node run CI leaves out for time): every recipe key the override set leaves alone was read.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from .conftest import ROOT
from .test_cpu_cluster_recipe import check_keys_read
from .test_cpu_e2e import STEPS
from .test_cpu_megatron_e2e import check_rows_and_advantages, check_syncs, tiny_model  # noqa: F401 (fixture)

pytestmark = pytest.mark.verl
pytest.importorskip("megatron.core", reason="megatron-core is not installed (extra: megatron)")

RECIPE = ROOT / "recipes" / "verl" / "qwen2.5-14b-math-megatron-cppo.yaml"
OVERRIDES = ROOT / "recipes" / "verl" / "cpu_toy.yaml"


@pytest.fixture(scope="module")
def cluster():
    from cppo_megatron.integrations.raycluster import LocalRayCluster

    # a short temp dir of our own (Ray's socket paths are limited), never /tmp/ray
    c = LocalRayCluster(f"/tmp/cppo-ray2-{os.getpid()}", nodes=2, gpus_per_node=2, cpus_per_node=8)
    try:
        c.start()
        yield c
    finally:
        c.stop()
        assert c.pids() == []  # nothing of the cluster is left running
        c.cleanup()


@pytest.fixture(scope="module")
def two_node_run(cluster, tiny_model, tmp_path_factory):  # noqa: F811 (the imported fixture)
    nodes = cluster.alive_nodes()
    tmp = tmp_path_factory.mktemp("toy14b2n")
    audit_dir, keys_dir, run_dir = tmp / "audit", tmp / "keys", tmp / "run"
    args = [sys.executable, "-m", "cppo_megatron.integrations.verl.main", str(RECIPE), "--cpu", str(OVERRIDES),
            "trainer.nnodes=2", "trainer.n_gpus_per_node=2", f"+ray_kwargs.ray_init.address={cluster.address}",
            # the recipe's vLLM replica (TP 4) would span both nodes: not run on CPU (cpu_toy.yaml says why)
            "actor_rollout_ref.rollout.name=hf",
            f"cppo_cpu.model_dir={tiny_model}", f"cppo_cpu.data_dir={tmp / 'data'}", f"cppo_cpu.run_dir={run_dir}",
            "cppo_cpu.eval_problems=16"]
    env = {**os.environ, "CPPO_VERL_AUDIT": str(audit_dir), "CPPO_VERL_KEYS": str(keys_dir), "PYTHONHASHSEED": "0"}
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run(args, capture_output=True, text=True, env=env, timeout=900, cwd=tmp)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-6000:]
    from cppo_megatron.integrations.verl.diagnostics import audit

    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"metrics": {m["step"]: m["data"] for m in metrics}, "audit": audit.read(audit_dir), "log": log,
            "nodes": nodes, "address": cluster.address, "keys": keys_dir}


def test_the_cpu_mode_names_its_ray_explicitly():
    """No address: a new local Ray ("local" — never a cluster some other `ray start` left in
    /tmp/ray/ray_current_cluster or RAY_ADDRESS); a cluster address: the single-node resource keys go."""
    from omegaconf import OmegaConf

    from cppo_megatron.integrations.verl.cpu.prepare import ray_address

    alone = OmegaConf.create({"ray_kwargs": {"ray_init": {"num_cpus": 16, "num_gpus": 4, "include_dashboard": False}}})
    assert ray_address(alone) == "local"
    assert OmegaConf.to_container(alone.ray_kwargs.ray_init) == {"num_cpus": 16, "num_gpus": 4,
                                                                 "include_dashboard": False, "address": "local"}
    joined = OmegaConf.create({"ray_kwargs": {"ray_init": {"num_cpus": 16, "num_gpus": 4, "address": "127.0.0.1:7"}}})
    assert ray_address(joined) == "127.0.0.1:7"
    assert OmegaConf.to_container(joined.ray_kwargs.ray_init) == {"address": "127.0.0.1:7"}


def test_the_cluster_has_two_nodes_of_two_logical_gpus(two_node_run):
    nodes = two_node_run["nodes"]
    assert len(nodes) == 2 and len({n["NodeID"] for n in nodes}) == 2
    assert all(n["Resources"].get("GPU") == 2.0 for n in nodes), nodes
    # the run connected to it (veRL prints its ray.init kwargs) instead of starting its own Ray
    assert f"'address': '{two_node_run['address']}'" in two_node_run["log"]


def test_14b_recipe_on_two_nodes_trains_the_core_survivors_with_the_pipeline_across_nodes(two_node_run, tiny_model):  # noqa: F811
    check_rows_and_advantages(two_node_run, pruning_rate=0.875, loop="v1", prompts_per_step=4, group_size=16)
    check_syncs(two_node_run, tiny_model)
    for step in range(1, STEPS + 1):
        m = two_node_run["metrics"][step]
        assert m["cppo/dp_size"] == 1  # 4 ranks / (TP 2 x PP 2)
        assert m["actor/kl_loss"] > 0
    places = [r for r in two_node_run["audit"] if r["kind"] == "placement"]
    node_ids = {n["NodeID"] for n in two_node_run["nodes"]}
    # actor and reference engines: 4 ranks each, every one on a node of the cluster
    assert len(places) == 8 and {p["node"] for p in places} == node_ids, places
    for rank in range(4):
        mine = [p for p in places if p["rank"] == rank]
        assert len({p["node"] for p in mine}) == 1  # actor and ref of a rank share its process
        assert mine[0]["tp_rank"] == rank % 2 and mine[0]["pp_rank"] == rank // 2
    stage_nodes = {pp: {p["node"] for p in places if p["pp_rank"] == pp} for pp in (0, 1)}
    # each pipeline stage on one node, the two stages on different nodes
    assert all(len(v) == 1 for v in stage_nodes.values()) and stage_nodes[0] != stage_nodes[1], stage_nodes


def test_every_key_the_override_set_leaves_alone_is_read_on_two_nodes(two_node_run):
    check_keys_read(two_node_run["keys"], rollout="hf")
