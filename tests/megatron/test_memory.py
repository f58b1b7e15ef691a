"""The memory estimate against what megatron-core really allocates, and by value.

- ``shard_parameters`` = the built shards' parameter count, per TP/PP rank (Qwen2 tied, Llama
  untied, TP2 and PP2);
- on a real ``MegatronActor`` after one update (2 gloo ranks): the bytes of its weights, its DDP
  gradient buffer and its optimizer's master copies and Adam moments = ``training_memory``'s
  weights / gradients / optimizer terms, for float32 and bf16, with and without the
  distributed optimizer (which halves the optimizer term at DP 2);
- the Qwen2.5 architectures of ``recipes/models`` have their published parameter counts, and a
  7B shard's terms by hand.
"""

import json

import pytest
import torch

from ._common import REPO, hf_config, hf_model, sequences

import cppo_megatron.megatron as cm
from cppo_megatron.distributed import run_local
from cppo_megatron.megatron.memory import hf_parameters, shard_parameters, training_memory

pytestmark = pytest.mark.megatron


def _config(arch, kw):
    if arch == "qwen2":
        return hf_config(**kw)
    import transformers

    base = {k: v for k, v in hf_config(**kw).to_dict().items() if k != "model_type"}
    return transformers.LlamaConfig(**base)


def _count_shards(rank, world, tp, pp, arch, kw):
    cm.init_parallel(tp, pp, seed=0)
    model = cm.build_gpt_model(_config(arch, kw))
    stage = cm.current_layout().pp_rank
    n = sum(p.numel() for p in model.parameters())
    cm.destroy_parallel()
    return stage, n


@pytest.mark.parametrize("tp,pp,arch,kw", [(2, 1, "qwen2", {}), (1, 2, "qwen2", {}),
                                           (1, 2, "qwen2", {"tie_word_embeddings": False}),
                                           (2, 1, "llama", {"tie_word_embeddings": False})])
def test_shard_parameters_count_the_built_shards(tp, pp, arch, kw):
    cfg = _config(arch, kw)
    counts = run_local(_count_shards, tp * pp, tp, pp, arch, kw, timeout=120)
    assert [n for _, n in counts] == [shard_parameters(cfg, tp=tp, pp=pp, pp_rank=stage) for stage, _ in counts]


def _storages(tensors) -> set:
    return {t.untyped_storage().data_ptr() for t in tensors}


def _actor_bytes(rank, world, dtype, distopt):
    hf = hf_model()
    actor = cm.MegatronActor(hf.config, hf.state_dict(),
                             cm.ActorConfig(tp=1, pp=1, lr=1e-3, dtype=dtype, distributed_optimizer=distopt,
                                            loss=cm.PolicyLossConfig(kl_coef=0.0)))
    seqs = sequences([6, 9, 5, 7])
    masks = [torch.ones(s.numel() - 1) for s in seqs]
    old = actor.logprobs(seqs)
    actor.update(seqs, masks, torch.tensor([1.0, -1.0, 0.5, -0.5]), old)
    module = cm.unwrap_model(actor.model)
    params = list(module.parameters())
    weights = sum(p.numel() * p.element_size() for p in params)
    grads = sum(b.grad_data.numel() * b.grad_data.element_size() for b in actor.model.buffers)
    model_storage = _storages(params) | _storages(b.param_data for b in actor.model.buffers if b.param_data is not None)
    opts = getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
    opt_bytes = 0
    for opt in opts:
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                if p.untyped_storage().data_ptr() not in model_storage:  # a master copy, not a view
                    opt_bytes += p.numel() * p.element_size()
                for key in ("exp_avg", "exp_avg_sq"):
                    s = inner.state[p][key]
                    opt_bytes += s.numel() * s.element_size()
    dtypes = {str(p.dtype) for p in params}
    cm.destroy_parallel()
    return dict(params=sum(p.numel() for p in params), weights=weights, gradients=grads, optimizer=opt_bytes,
                dtypes=dtypes)


@pytest.mark.parametrize("dtype,distopt", [("float32", False), ("bfloat16", False), ("float32", True),
                                           ("bfloat16", True)])
def test_training_memory_is_what_the_actor_allocates(dtype, distopt):
    got = run_local(_actor_bytes, 2, dtype, distopt, timeout=240)
    est = training_memory(hf_config(), tp=1, pp=1, dp=2, dtype=dtype, distributed_optimizer=distopt)
    for r in got:
        assert r["dtypes"] == {f"torch.{dtype}"}  # every shard parameter in the recipe's dtype
        assert r["params"] == est.parameters
        assert r["weights"] == est.weights
        # megatron pads its buffers to whole buckets: within a few percent on this tiny model
        assert r["gradients"] == pytest.approx(est.gradients, rel=0.05)
        assert r["optimizer"] == pytest.approx(est.optimizer, rel=0.05)
    # the two DP ranks hold half each with the distributed optimizer
    assert sum(r["optimizer"] for r in got) == pytest.approx(2 * est.optimizer, rel=0.05)


def _arch(name):
    import transformers

    data = json.loads((REPO / "recipes" / "models" / f"{name}.json").read_text())
    data = {k: v for k, v in data.items() if not k.startswith("_")}
    assert data.pop("model_type") == "qwen2"
    return transformers.Qwen2Config(**data)


def test_qwen25_architectures_have_their_published_sizes():
    assert hf_parameters(_arch("qwen2.5-1.5b-instruct")) == 1_543_714_304
    assert hf_parameters(_arch("qwen2.5-7b-instruct")) == 7_615_616_512
    assert hf_parameters(_arch("qwen2.5-14b-instruct")) == 14_770_033_664


def test_a_7b_shard_by_hand():
    cfg = _arch("qwen2.5-7b-instruct")  # hidden 3584, 28 layers, 28 heads / 4 kv of 128, ffn 18944
    h, q, kv, f = 3584, 3584, 512, 18944
    layer = (h * (q + 2 * kv) + q * h + 3 * h * f) // 4 + (q + 2 * kv) // 4 + 2 * h
    n = 28 * layer + 2 * (152064 * h // 4) + h  # vocabulary 152064 is already a multiple of 128 x 4
    assert shard_parameters(cfg, tp=4) == n
    m = training_memory(cfg, tp=4, dp=2, dtype="bfloat16", distributed_optimizer=True, reference=True,
                        micro_batch_tokens=4096, seq_len=4096, fused_attention=True)
    assert (m.weights, m.gradients, m.reference) == (2 * n, 4 * n, 2 * n)
    assert m.optimizer == (12 * n + 1) // 2  # fp32 master + two Adam moments, over 2 DP ranks
    plain = training_memory(cfg, tp=4, dp=2, dtype="float32")
    assert plain.optimizer == 8 * n and plain.weights == 4 * n  # float32: no master copy, not sharded
    assert m.total == m.weights + m.gradients + m.optimizer + m.reference + m.activations
