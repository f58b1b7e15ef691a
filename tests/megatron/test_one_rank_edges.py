"""The model, converter and pass edges that need megatron-core's parallel state, on one gloo rank in
this process (issue 43 item 7: the full CI run left them unreached): init_parallel's refusals,
Transformer Engine refused on CPU, the converter's refusals (a missing or misshapen HF tensor, a
parameter it has no counterpart for), the micro-batch budget, and the log-probs of a vocabulary that
needs no padding."""

from __future__ import annotations

import pytest
import torch

from ._common import hf_config, hf_logprobs, hf_model, sequences

import cppo_megatron.megatron as cm  # noqa: E402

pytestmark = [pytest.mark.megatron, pytest.mark.in_process_dist]


@pytest.mark.parametrize("tp,pp,message", [
    (0, 1, "tp must be an integer >= 1, got 0"),
    (True, 1, "tp must be an integer >= 1, got True"),
    (1, 1.5, "pp must be an integer >= 1, got 1.5"),
    (2, 1, r"world size 1 is not divisible by tp \* pp = 2 \* 1"),
])
def test_init_parallel_refuses_a_layout_the_world_cannot_hold(one_rank, tp, pp, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        cm.init_parallel(tp, pp)


def test_transformer_engine_is_refused_on_cpu(one_rank):
    cm.init_parallel(1, 1, seed=0)
    with pytest.raises(ValueError, match="^use_te=True needs CUDA: Transformer Engine does not run on CPU$"):
        cm.build_gpt_model(hf_config(), use_te=True)


@pytest.fixture
def tiny(one_rank):
    """The tiny Qwen2 as HF model and as a one-rank megatron model loaded from it."""
    cm.init_parallel(1, 1, seed=0)
    hf = hf_model()
    model = cm.build_gpt_model(hf.config)
    cm.load_hf_weights(model, hf.state_dict(), hf.config)
    return hf, model


def test_a_missing_or_misshapen_hf_tensor_is_named(tiny):
    hf, model = tiny
    sd = hf.state_dict()
    with pytest.raises(ValueError, match="^HF state dict has no 'model.norm.weight', needed for this megatron shard$"):
        cm.load_hf_weights(model, {k: v for k, v in sd.items() if k != "model.norm.weight"}, hf.config)
    with pytest.raises(ValueError, match=r"^decoder.final_layernorm.weight: converted HF tensor has shape \(31,\), "
                                         r"the shard needs \(32,\)$"):
        cm.load_hf_weights(model, {**sd, "model.norm.weight": torch.ones(31)}, hf.config)


@pytest.mark.parametrize("where,name", [(None, "extra_scale"), (0, "decoder.layers.0.extra_scale")])
def test_a_parameter_without_an_hf_counterpart_is_refused_before_anything_moves(tiny, where, name):
    hf, model = tiny
    owner = model if where is None else model.decoder.layers[where]
    owner.register_parameter("extra_scale", torch.nn.Parameter(torch.ones(3)))
    before = {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    message = f"^no HF counterpart known for megatron parameter '{name}': this converter maps the Qwen2 / Llama"
    zeros = {k: torch.zeros_like(v) for k, v in hf.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        cm.load_hf_weights(model, zeros, hf.config)
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())  # refused before the first copy
    with pytest.raises(ValueError, match=message):  # the export drops nothing silently
        cm.export_hf_weights(model, hf.config)


def test_the_micro_batch_budget_must_be_a_positive_integer(tiny):
    _, model = tiny
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match=f"^max_tokens_per_micro_batch must be an integer >= 1, got {bad!r}$"):
            cm.compute_logprobs(model, sequences([5, 4]), max_tokens_per_micro_batch=bad)


def test_a_vocabulary_that_needs_no_padding_gives_the_hf_log_probs(one_rank):
    """vocab_size 128 = the megatron padding multiple: no logit is masked (every other test pads 101)."""
    cm.init_parallel(1, 1, seed=0)
    hf = hf_model(vocab_size=128)
    model = cm.build_gpt_model(hf.config)
    assert model.embedding.word_embeddings.weight.shape[0] == 128 and model.cppo_vocab_size == 128
    cm.load_hf_weights(model, hf.state_dict(), hf.config)
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 128, (n,), generator=g) for n in (5, 9, 3)]
    seqs[0][2] = 127  # the last vocabulary row is a real token
    got = cm.compute_logprobs(model, seqs, max_tokens_per_micro_batch=16)
    for g_lp, want in zip(got, hf_logprobs(hf, seqs), strict=True):
        torch.testing.assert_close(g_lp, want, atol=1e-5, rtol=0)
