"""megatron.memory's refusals (each names the bad value) and the terms of a first pipeline stage,
which holds no logits, by value: branches tests/megatron/test_memory.py does not reach."""

import pytest

from cppo_megatron.megatron.memory import GB, ShardMemory, shard_parameters, training_memory

from ._common import hf_config

pytestmark = pytest.mark.megatron


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"tp": 0}, "tp must be an integer >= 1, got 0"),
    ({"pp": True}, "pp must be an integer >= 1, got True"),
    ({"pp": 2, "pp_rank": 2}, r"pp_rank must be in \[0, 2\), got 2"),
    ({"tp": 3}, r"tp=3 must divide the attention heads \(4\) and key/value heads \(2\), pp=1 the layers \(2\)"),
    ({"pp": 4}, r"tp=1 must divide .* pp=4 the layers \(2\)"),
])
def test_shard_parameters_refuses_a_layout_the_model_cannot_take(kwargs, message):
    with pytest.raises(ValueError, match=message):
        shard_parameters(hf_config(), **kwargs)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"dtype": "fp8"}, r"dtype must be one of \['bfloat16', 'float16', 'float32'\], got 'fp8'"),
    ({"dp": 0}, "dp must be an integer >= 1, got 0"),
    ({"dp": True}, "dp must be an integer >= 1, got True"),
    ({"micro_batch_tokens": 0}, "micro_batch_tokens must be an integer >= 1, got 0"),
    ({"seq_len": 2.5}, "seq_len must be an integer >= 1, got 2.5"),
])
def test_training_memory_refuses_bad_sizes(kwargs, message):
    with pytest.raises(ValueError, match=message):
        training_memory(hf_config(), **kwargs)


def test_a_first_pipeline_stage_holds_two_stages_of_activations_and_no_logits():
    # hidden 32, 4 heads, 2 layers, float32 (2 bytes per activation unit x 2), 8 tokens of 8:
    # per layer 8 * 32 * (10 + 24 + 5 * 4 * 8 / 32) * 2 = 19968; stage 0 of 2 keeps 1 layer for
    # 2 micro-batches in flight, and no logits (those are the last stage's)
    first = training_memory(hf_config(), pp=2, pp_rank=0, micro_batch_tokens=8, seq_len=8)
    last = training_memory(hf_config(), pp=2, pp_rank=1, micro_batch_tokens=8, seq_len=8)
    assert first.activations == 19968 * 2
    assert last.activations == 19968 + 3 * 8 * 128 * 4  # the vocabulary 101 padded to 128
    assert (first.parameters, first.weights, first.gradients) == (shard_parameters(hf_config(), pp=2), 4 *
                                                                  first.parameters, 4 * first.parameters)


def test_shard_memory_in_gigabytes():
    m = ShardMemory(parameters=1, weights=GB, gradients=2 * GB, optimizer=GB // 2, reference=0, activations=GB)
    assert m.gb() == {"weights": 1.0, "gradients": 2.0, "optimizer": 0.5, "reference": 0.0, "activations": 1.0,
                      "total": 4.5}
