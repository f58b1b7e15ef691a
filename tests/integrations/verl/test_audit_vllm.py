"""audit_vllm's comparison of served weights with the tensors sent (the pure part; the e2e run in
test_cpu_e2e.py checks it against vLLM's real Qwen2). The layout below is vLLM's: fused
``qkv_proj`` / ``gate_up_proj`` stacked in ``packed_modules_mapping`` order, the vocabulary padded,
``lm_head`` tied to the embedding."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cppo_megatron.integrations.verl.diagnostics.audit_vllm import served_difference, served_parameter

Q, KV, H, V, V_PAD = 4, 2, 3, 6, 8


class _Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv_proj = nn.Linear(H, Q + 2 * KV, bias=False)


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = _Attn()


class _Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(V_PAD, H)
        self.layers = nn.ModuleList([_Layer()])


class _Served(nn.Module):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.model = _Inner()
        self.lm_head = self.model.embed_tokens  # tied
        self.to(dtype)


def _sent(seed=0):
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(V, H, generator=g)
    return {"model.layers.0.self_attn.q_proj.weight": torch.randn(Q, H, generator=g),
            "model.layers.0.self_attn.k_proj.weight": torch.randn(KV, H, generator=g),
            "model.layers.0.self_attn.v_proj.weight": torch.randn(KV, H, generator=g),
            "model.embed_tokens.weight": emb, "lm_head.weight": emb.clone()}


def _load(model, sent):
    with torch.no_grad():
        p = "model.layers.0.self_attn."
        qkv = torch.cat([sent[p + "q_proj.weight"], sent[p + "k_proj.weight"], sent[p + "v_proj.weight"]])
        model.model.layers[0].self_attn.qkv_proj.weight.copy_(qkv)
        model.model.embed_tokens.weight[:V].copy_(sent["model.embed_tokens.weight"])
        model.model.embed_tokens.weight[V:].fill_(7.0)  # padding rows: anything
    return model


def test_a_served_model_holding_every_sent_tensor_differs_by_zero():
    sent = _sent()
    out = served_difference(_load(_Served(), sent), sent)
    assert out == {"max_abs_diff": 0.0, "missing": [], "mismatched": []}


def test_each_shard_of_a_fused_parameter_is_found_at_its_offset():
    sent, model = _sent(), _load(_Served(), _sent())
    sizes = {k: v.shape[0] for k, v in sent.items()}
    v_slice, name = served_parameter(model, "model.layers.0.self_attn.v_proj.weight", sizes)
    assert name == "model.layers.0.self_attn.qkv_proj.weight"
    torch.testing.assert_close(v_slice, sent["model.layers.0.self_attn.v_proj.weight"], rtol=0, atol=0)
    with torch.no_grad():  # one value of k served wrong: found, by its size
        model.model.layers[0].self_attn.qkv_proj.weight[Q + 1, 2] += 0.25
    assert served_difference(model, sent)["max_abs_diff"] == pytest.approx(0.25)


def test_stale_served_weights_show_their_difference():
    old, new = _sent(0), _sent(1)
    model = _load(_Served(), old)
    want = max(float((new[k] - old[k]).abs().max()) for k in new)
    assert served_difference(model, new)["max_abs_diff"] == pytest.approx(want)


def test_names_vllm_does_not_hold_and_shapes_that_do_not_fit_are_named():
    sent = _sent()
    model = _load(_Served(), sent)
    extra = {**sent, "model.norm.weight": torch.ones(H), "model.layers.0.self_attn.q_proj.weight": torch.ones(Q, H + 1)}
    out = served_difference(model, extra)
    assert out["missing"] == ["model.norm.weight"]
    assert out["mismatched"] == ["model.layers.0.self_attn.q_proj.weight -> model.layers.0.self_attn.qkv_proj.weight "
                                 f"({Q}, {H}) for ({Q}, {H + 1})"]
    with pytest.raises(ValueError, match="no received tensors"):
        served_difference(model, {})


def test_bf16_serving_is_compared_after_the_same_rounding():
    sent = _sent()
    model = _load(_Served(torch.bfloat16), sent)  # vLLM rounds the fp32 actor's tensors on load
    assert served_difference(model, sent)["max_abs_diff"] == 0.0


# --- vLLM tensor parallelism: each rank serves a shard, found through the parameter's own loader


class _ColumnShard(nn.Module):
    """A column-parallel fused QKV of rank ``rank`` of 2, with a loader in vLLM's convention
    (``weight_loader(param, full_tensor, shard_id)``): rows of each shard split over the ranks."""

    def __init__(self, rank):
        super().__init__()
        self.rank = rank
        self.qkv_proj = nn.Linear(H, (Q + 2 * KV) // 2, bias=False)
        self.qkv_proj.weight.weight_loader = self._load_qkv

    def _load_qkv(self, param, full, shard_id):
        sizes = {"q": Q // 2, "k": KV // 2, "v": KV // 2}
        start = {"q": 0, "k": Q // 2, "v": Q // 2 + KV // 2}[shard_id]
        n = sizes[shard_id]
        param.data[start:start + n].copy_(full[self.rank * n:(self.rank + 1) * n])


class _ShardedServed(nn.Module):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

    def __init__(self, rank):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([nn.Module()])
        self.model.layers[0].self_attn = _ColumnShard(rank)
        self.model.norm = nn.Linear(H, 1, bias=False)  # a replicated parameter, no loader of its own


def _sharded_sent():
    g = torch.Generator().manual_seed(1)
    p = "model.layers.0.self_attn."
    return {p + "q_proj.weight": torch.randn(Q, H, generator=g), p + "k_proj.weight": torch.randn(KV, H, generator=g),
            p + "v_proj.weight": torch.randn(KV, H, generator=g), "model.norm.weight": torch.randn(1, H, generator=g)}


def _serve_rank(rank, sent):
    m = _ShardedServed(rank)
    p = "model.layers.0.self_attn."
    with torch.no_grad():
        q, k, v = (sent[p + f"{x}_proj.weight"] for x in "qkv")
        m.model.layers[0].self_attn.qkv_proj.weight.copy_(torch.cat([
            q[rank * Q // 2:(rank + 1) * Q // 2], k[rank * KV // 2:(rank + 1) * KV // 2],
            v[rank * KV // 2:(rank + 1) * KV // 2]]))
        m.model.norm.weight.copy_(sent["model.norm.weight"])
    return m


@pytest.mark.parametrize("rank", [0, 1])
def test_a_tensor_parallel_rank_serving_its_shards_differs_by_zero_and_keeps_its_values(rank):
    from cppo_megatron.integrations.verl.diagnostics.audit_vllm import sharded_difference

    sent = _sharded_sent()
    model = _serve_rank(rank, sent)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    out = sharded_difference(model, sent)
    assert out["max_abs_diff"] == 0.0 and out["missing"] == [] and out["mismatched"] == []
    assert out["compared_values"] == (Q + 2 * KV) // 2 * H + H  # the rank's shard and the replicated norm
    for k, v in model.named_parameters():  # the NaN-filled loads were undone exactly
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)


def test_a_shard_served_from_the_other_ranks_rows_is_found():
    from cppo_megatron.integrations.verl.diagnostics.audit_vllm import sharded_difference

    sent = _sharded_sent()
    model = _serve_rank(0, sent)
    model.model.layers[0].self_attn.rank = 1  # rank 1's loader: rank 0's served rows are wrong for it
    assert sharded_difference(model, sent)["max_abs_diff"] > 0.1
    with torch.no_grad():
        model.model.layers[0].self_attn.qkv_proj.weight[Q // 2, 0] += 0.5  # one k value on rank 0
    model.model.layers[0].self_attn.rank = 0
    assert sharded_difference(model, sent)["max_abs_diff"] == pytest.approx(0.5)
    sent["model.extra.weight"] = torch.zeros(2)
    assert sharded_difference(model, sent)["missing"] == ["model.extra.weight"]


def test_teed_weights_pass_through_sync_and_async_iterators_and_keep_copies():
    """The adapter's recorder sits on a plain generator (colocated sync) and on a checkpoint
    engine's async generator (separate_async's standalone replica)."""
    import asyncio

    from cppo_megatron.integrations.verl.diagnostics.audit_vllm import _teed

    sent = _sent()
    kept: dict = {}
    assert [n for n, _ in _teed(iter(sent.items()), kept)] == list(sent)
    assert all(torch.equal(kept[k], v) and kept[k].data_ptr() != v.data_ptr() for k, v in sent.items())

    async def agen():
        for item in sent.items():
            yield item

    async def drain():
        return [n async for n, _ in _teed(agen(), kept_async)]

    kept_async: dict = {}
    assert asyncio.run(drain()) == list(sent) and set(kept_async) == set(sent)
