"""CPU mode is scoped and reversible; what cannot run on CPU, and bad configs, fail clearly."""

import pytest
import torch

from ._common import hf_config, transformers

import cppo_megatron.megatron as cm
from cppo_megatron.megatron.convert import _qkv_full, _qkv_split

pytestmark = pytest.mark.megatron

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-mode behaviour")


@cpu_only
def test_cpu_mode_redirects_cuda_and_restores_everything():
    before = (torch.cuda.current_device, torch.cuda.synchronize)
    with pytest.raises((RuntimeError, AssertionError)):
        torch.empty(2, device="cuda")
    with cm.cpu_mode() as active:
        assert active
        assert torch.empty(2, device="cuda").device.type == "cpu"
        assert torch.ones(2).cuda().device.type == "cpu"
        assert torch.zeros(2).to("cuda").device.type == "cpu"
        assert torch.cuda.current_device() == "cpu"
        torch.cuda.synchronize()
        with cm.cpu_mode() as inner:  # re-entrant
            assert inner
        assert torch.empty(1, device="cuda").device.type == "cpu"
    assert (torch.cuda.current_device, torch.cuda.synchronize) == before
    with pytest.raises(ValueError):
        with cm.cpu_mode():
            raise ValueError("boom")
    assert (torch.cuda.current_device, torch.cuda.synchronize) == before
    with pytest.raises((RuntimeError, AssertionError)):
        torch.empty(2, device="cuda")
    with cm.cpu_mode(enabled=False) as active:
        assert not active


@cpu_only
def test_cuda_only_features_are_refused_by_name():
    cm.check_cpu_supported(use_distributed_optimizer=True)  # runs on CPU in the CPU mode (test_memory, test_actor)
    with pytest.raises(cm.CPUModeError, match="sequence_parallel"):
        cm.check_cpu_supported(use_distributed_optimizer=True, sequence_parallel=True)
    with pytest.raises(cm.CPUModeError, match="sequence_parallel"):
        cm.transformer_config_from_hf(hf_config(), tp=2, sequence_parallel=True)
    cm.check_cpu_supported()  # nothing requested: fine


def test_config_mapping_and_errors():
    cfg = cm.transformer_config_from_hf(hf_config(), tp=2)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups) == (2, 32, 4, 2)
    assert cfg.add_qkv_bias and not cfg.add_bias_linear and cfg.gated_linear_unit
    with pytest.raises(ValueError, match="tp=4 must divide"):
        cm.transformer_config_from_hf(hf_config(), tp=4)
    with pytest.raises(ValueError, match="pp=3 must divide"):
        cm.transformer_config_from_hf(hf_config(), pp=3)
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        cm.transformer_config_from_hf(transformers.GPT2Config())
    llama3 = transformers.LlamaConfig(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                       "original_max_position_embeddings": 8192})
    with pytest.raises(ValueError, match="rope_type 'llama3'"):
        cm.transformer_config_from_hf(llama3)
    assert cm.padded_vocab_size(101, 2) == 256 and cm.padded_vocab_size(256, 2) == 256


def test_qkv_layout_round_trip_and_grouping():
    heads, groups, d, h = 8, 2, 3, 5
    q, k, v = torch.randn(heads * d, h), torch.randn(groups * d, h), torch.randn(groups * d, h)
    full = _qkv_full(q, k, v, heads, groups, d)
    # group 1 block = its 4 query heads, then its key head, then its value head
    per = heads // groups * d
    block = full[(per + 2 * d) : 2 * (per + 2 * d)]
    assert torch.equal(block[:per], q[per : 2 * per])
    assert torch.equal(block[per : per + d], k[d : 2 * d]) and torch.equal(block[per + d :], v[d : 2 * d])
    for a, b in zip(_qkv_split(full, heads, groups, d), (q, k, v)):
        assert torch.equal(a, b)


def test_micro_batches_bound_the_padded_size():
    from cppo_megatron.megatron.passes import _micro_batches

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(2, 40, (57,), generator=g).tolist()
    seqs = [torch.zeros(L, dtype=torch.int64) for L in lengths]
    for budget, pp in ((40, 1), (100, 1), (64, 4), (4096, 4)):
        batches = _micro_batches(seqs, budget, pp)
        assert sorted(i for b in batches for i in b) == list(range(len(seqs)))
        assert all(len(b) * max(lengths[i] for i in b) <= budget for b in batches)
        assert len(batches) >= pp
    with pytest.raises(ValueError, match="sequence 0 has 9 tokens"):
        _micro_batches([torch.zeros(9)], 8, 1)


def test_with_cuda_present_nothing_is_refused(monkeypatch):
    """check_cpu_supported refuses only on CPU: with a CUDA device sequence parallelism is megatron-core's."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cm.check_cpu_supported(sequence_parallel=True, use_distributed_optimizer=True) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(cm.CPUModeError, match="sequence_parallel=True"):
        cm.check_cpu_supported(sequence_parallel=True)


def test_transformer_engine_is_used_only_when_it_imports_and_cuda_is_present(monkeypatch):
    import sys
    import types

    from cppo_megatron.megatron.model import te_available

    monkeypatch.setitem(sys.modules, "transformer_engine", None)  # not installed: the import fails
    assert te_available() is False
    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert te_available() is False  # installed, but no CUDA device to run it
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert te_available() is True
