"""HF -> megatron (TP1, TP2, PP2) on 2 real gloo processes: per-token log-probs equal the HF
model's, and exporting back gives the HF tensors bit for bit. One launch covers all layouts."""

import pytest
import torch

from ._common import hf_logprobs, hf_model, sequences, transformers

import cppo_megatron.megatron as cm
from cppo_megatron.distributed import run_local

pytestmark = pytest.mark.megatron

LENGTHS = [5, 9, 3, 12, 7, 2]
LAYOUTS = [(1, 1), (2, 1), (1, 2)]  # (tp, pp) on 2 ranks; (1, 1) is TP1 with DP2


def llama_model(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                   max_position_embeddings=64, rope_theta=500000.0)
    return transformers.LlamaForCausalLM(cfg).float().eval()


def _worker(rank, world):
    out = {}
    for name, make in (("qwen2", hf_model), ("llama", llama_model)):
        hf = make()
        for tp, pp in LAYOUTS:
            cm.init_parallel(tp, pp, seed=0)
            model = cm.build_gpt_model(hf.config)
            # deliberately garble the fresh weights: loading must overwrite every parameter
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(0.123)
            cm.load_hf_weights(model, hf.state_dict(), hf.config)
            lp = cm.compute_logprobs(model, sequences(LENGTHS), max_tokens_per_micro_batch=16)
            exported = cm.export_hf_weights(model, hf.config)
            out[(name, tp, pp)] = (lp, exported)
            cm.destroy_parallel()
    return out


@pytest.fixture(scope="module")
def results():
    return run_local(_worker, 2, timeout=180)


@pytest.mark.parametrize("name", ["qwen2", "llama"])
@pytest.mark.parametrize("tp,pp", LAYOUTS)
def test_logprobs_match_hf_and_weights_round_trip(results, name, tp, pp):
    hf = hf_model() if name == "qwen2" else llama_model()
    ref = hf_logprobs(hf, sequences(LENGTHS))
    sd = hf.state_dict()
    tied = hf.config.tie_word_embeddings
    expected_keys = {k for k in sd if not (tied and k == "lm_head.weight")}
    for rank in range(2):
        lp, exported = results[rank][(name, tp, pp)]
        assert [x.shape[0] for x in lp] == [L - 1 for L in LENGTHS]
        for got, want in zip(lp, ref):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        assert set(exported) == expected_keys
        for k in expected_keys:
            assert torch.equal(exported[k], sd[k].float()), f"{k} changed in the round trip ({name}, tp={tp}, pp={pp})"
