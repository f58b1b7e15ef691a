"""audit_vllm's comparison of served weights with the tensors sent (the pure part; the e2e run in
test_cpu_vllm_e2e.py checks it against vLLM's real Qwen2). The layout below is vLLM's: fused
``qkv_proj`` / ``gate_up_proj`` stacked in ``packed_modules_mapping`` order, the vocabulary padded,
``lm_head`` tied to the embedding."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cppo_megatron.integrations.verl.audit_vllm import served_difference, served_parameter

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
