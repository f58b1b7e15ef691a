"""The Megatron path's input checks, by message, in this process (each refuses before any process
group or model is needed); and the memory model's values at its edges. Branch coverage found these
unreached (scripts/coverage_floor.py)."""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (extra: megatron)")

from cppo_megatron.megatron.actor import ActorConfig  # noqa: E402
from cppo_megatron.megatron.memory import shard_parameters, training_memory  # noqa: E402
from cppo_megatron.megatron.model import (  # noqa: E402
    ParallelLayout,
    init_parallel,
    transformer_config_from_hf,
)
from cppo_megatron.megatron.passes import (  # noqa: E402
    PolicyLossConfig,
    UpdateBatch,
    compute_logprobs,
    policy_loss,
    policy_update,
)

QWEN = {"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128, "num_hidden_layers": 4, "vocab_size": 1000, "tie_word_embeddings": True,
        "hidden_act": "silu"}


def _batch(m=2, **kw) -> UpdateBatch:
    seqs = [torch.arange(4), torch.arange(3)][:m]
    base = dict(sequences=seqs, loss_mask=[torch.ones(s.numel() - 1) for s in seqs], advantages=torch.zeros(m),
                old_logprobs=[torch.zeros(s.numel() - 1) for s in seqs])
    return UpdateBatch(**{**base, **kw})


CASES = [
    ("an unknown dtype", lambda: ActorConfig(dtype="fp8"), "dtype must be one of"),
    ("mu of 0", lambda: ActorConfig(mu=0), "mu must be an integer >= 1, got 0"),
    ("a zero learning rate", lambda: ActorConfig(lr=0.0), "lr must be > 0, got 0.0"),
    ("an unknown KL estimator", lambda: PolicyLossConfig(kl_kind="k9"), "kl_kind must be one of"),
    ("an unknown loss aggregation", lambda: PolicyLossConfig(loss_agg_mode="sum"), "loss_agg_mode must be one of"),
    ("a negative KL coefficient", lambda: PolicyLossConfig(kl_coef=-0.1), "kl_coef must be >= 0, got -0.1"),
    ("a zero temperature", lambda: PolicyLossConfig(temperature=0.0), "temperature must be > 0, got 0.0"),
    ("sequences that are not a list", lambda: compute_logprobs(None, torch.arange(4)),
     "sequences must be a list of 1-D token id tensors, got Tensor"),
    ("a one-token sequence", lambda: compute_logprobs(None, [torch.arange(4), torch.tensor([5])]),
     re.escape("sequences[1] must be 1-D with at least 2 tokens, got shape (1,)")),
    ("float token ids", lambda: compute_logprobs(None, [torch.zeros(3)]),
     "sequences\\[0\\] must hold integer token ids, got torch.float32"),
    ("a zero sampling temperature", lambda: compute_logprobs(None, [torch.arange(3)], temperature=0),
     "temperature must be > 0, got 0"),
    ("advantages of another length", lambda: _batch(advantages=torch.zeros(3)).validate(False),
     re.escape("advantages must be [m] = [2], got shape (3,)")),
    ("weights of another length", lambda: _batch(weights=torch.ones(1)).validate(False),
     re.escape("weights must be [m] = [2], got shape (1,)")),
    ("a KL term without reference log-probs", lambda: _batch().validate(True),
     re.escape("kl_coef > 0 needs ref_logprobs (or set kl_coef=0)")),
    ("fewer loss-mask rows than sequences", lambda: _batch(loss_mask=[torch.ones(3)]).validate(False),
     "loss_mask has 1 rows for 2 sequences"),
    ("a reference row of the wrong length",
     lambda: _batch(ref_logprobs=[torch.zeros(3), torch.zeros(5)]).validate(True),
     re.escape("ref_logprobs[1] must be [L-1] = [2], got (5,)")),
    ("a backward pass on a model without Megatron's DDP wrapper",
     lambda: policy_loss(torch.nn.Linear(2, 2), _batch(), PolicyLossConfig(kl_coef=0.0)),
     "policy_loss with backward needs the Megatron DDP model from build_ddp_and_optimizer"),
    ("a negative gradient clip", lambda: policy_update(None, None, _batch(), PolicyLossConfig(), clip_grad=-1.0),
     re.escape("clip_grad must be >= 0 (0 disables clipping), got -1.0")),
    ("a GELU model", lambda: transformer_config_from_hf({**QWEN, "hidden_act": "gelu"}),
     "hidden_act 'gelu' is not supported \\(only silu\\)"),
    ("sliding-window attention", lambda: transformer_config_from_hf({**QWEN, "use_sliding_window": True}),
     "use_sliding_window=True is not supported by this converter"),
    ("biased MLPs", lambda: transformer_config_from_hf({**QWEN, "mlp_bias": True}),
     "mlp_bias=True is not supported by this converter"),
    ("a fractional tp", lambda: shard_parameters(QWEN, tp=1.5), "tp must be an integer >= 1, got 1.5"),
    ("a stage outside the pipeline", lambda: shard_parameters(QWEN, pp=2, pp_rank=2),
     re.escape("pp_rank must be in [0, 2), got 2")),
    ("a tp that does not divide the heads", lambda: shard_parameters(QWEN, tp=3),
     re.escape("tp=3 must divide the attention heads (4) and key/value heads (2), pp=1 the layers (4)")),
    ("an unknown dtype in the memory model", lambda: training_memory(QWEN, dtype="fp8"), "dtype must be one of"),
    ("dp of 0", lambda: training_memory(QWEN, dp=0), "dp must be an integer >= 1, got 0"),
    ("a zero micro-batch", lambda: training_memory(QWEN, micro_batch_tokens=0),
     "micro_batch_tokens must be an integer >= 1, got 0"),
]


@pytest.mark.parametrize("call,message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_refused_with_a_message_naming_the_value(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_a_torch_dtype_is_taken_by_name():
    assert ActorConfig(dtype=torch.bfloat16).dtype == "bfloat16"


def test_no_sequences_need_no_pass():
    assert compute_logprobs(None, []) == []


def test_megatron_needs_a_process_group_first():
    assert not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised: call init_process_group first"):
        init_parallel(tp=1, pp=1)


def test_a_layout_knows_its_first_and_last_stage():
    middle = ParallelLayout(tp=1, pp=3, dp=1, tp_rank=0, pp_rank=1, dp_rank=0)
    assert (middle.is_first_stage, middle.is_last_stage) == (False, False)
    last = ParallelLayout(tp=1, pp=3, dp=1, tp_rank=0, pp_rank=2, dp_rank=0)
    assert (last.is_first_stage, last.is_last_stage) == (False, True)


def test_the_memory_of_a_middle_pipeline_stage_has_no_vocabulary_terms():
    # 4 layers over pp 4: stage 1 holds one layer and no embedding, head or final norm
    mid = training_memory(QWEN, pp=4, pp_rank=1, micro_batch_tokens=16, seq_len=16)
    layer = 64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 128 + 2 * 64 + (64 + 2 * 32)
    assert mid.parameters == layer
    last = training_memory(QWEN, pp=4, pp_rank=3, micro_batch_tokens=16, seq_len=16)
    assert last.parameters == layer + 64 + 1024 * 64  # final norm and the output layer (a tied head's copy)
    gb = mid.gb()
    assert gb["total"] == pytest.approx(mid.total / 1e9) and set(gb) == {"weights", "gradients", "optimizer",
                                                                         "reference", "activations", "total"}
