"""What one rank of a megatron-core policy holds, in bytes, before it is built.

``shard_parameters(hf_config, tp=, pp=, pp_rank=)`` counts the parameters of one TP/PP shard
exactly as ``build_gpt_model`` lays them out (vocabulary padded to a multiple of 128 tp and
split over TP, layers split over PP, norms replicated, a tied embedding duplicated on the last
stage when pp > 1); a test compares it with the built shards' ``numel``.
``training_memory`` turns a shard into bytes for the Megatron actor (``MegatronActor``):

- weights: shard parameters x the dtype's bytes;
- gradients: Megatron DDP's float32 gradient buffer (``grad_reduce_in_fp32=True``), 4 B each;
- optimizer: Adam's two float32 moments, 8 B, plus a float32 master copy for bf16 / fp16
  weights, 4 B (``Float16OptimizerWithFloat16Params``); the distributed optimizer divides both
  by the DP size (each DP rank owns 1/dp of them);
- reference: a frozen second shard (``kl_coef > 0``), weights only;
- activations of one micro-batch of ``micro_batch_tokens`` tokens with sequences of
  ``seq_len``: per layer ``T h (10 + 24/tp + 5 a s / (h tp))`` 16-bit values (Korthikanti et al.,
  2022, no sequence parallelism, no recomputation; the s-squared term is the unfused attention
  of the local layer spec), doubled for float32, times the micro-batches in flight on the first
  pipeline stage (pp under 1F1B), plus the float32 logits of the last stage and two copies
  (log-softmax, its gradient).

An estimate, not a measurement: allocator overhead, communication buffers and fragmentation
come on top (the launcher's fit check keeps 10 % headroom).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .model import hf_get, padded_vocab_size

__all__ = ["DTYPE_BYTES", "ShardMemory", "hf_parameters", "kv_cache_bytes", "shard_parameters", "training_memory"]

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GB = 1e9


def _dims(hf_config: Any) -> dict:
    heads = int(hf_get(hf_config, "num_attention_heads"))
    hidden = int(hf_get(hf_config, "hidden_size"))
    return dict(
        hidden=hidden,
        heads=heads,
        groups=int(hf_get(hf_config, "num_key_value_heads") or heads),
        head_dim=int(hf_get(hf_config, "head_dim") or hidden // heads),
        ffn=int(hf_get(hf_config, "intermediate_size")),
        layers=int(hf_get(hf_config, "num_hidden_layers")),
        vocab=int(hf_get(hf_config, "vocab_size")),
        tied=bool(hf_get(hf_config, "tie_word_embeddings", False)),
        qkv_bias=hf_get(hf_config, "model_type") == "qwen2" or bool(hf_get(hf_config, "attention_bias", False)),
    )


def hf_parameters(hf_config: Any) -> int:
    """Parameters of the HF model itself (unpadded vocabulary, the tied head counted once)."""
    d = _dims(hf_config)
    h, q, kv = d["hidden"], d["heads"] * d["head_dim"], d["groups"] * d["head_dim"]
    layer = h * (q + 2 * kv) + q * h + 3 * h * d["ffn"] + 2 * h + ((q + 2 * kv) if d["qkv_bias"] else 0)
    embed = d["vocab"] * h
    return d["layers"] * layer + embed * (1 if d["tied"] else 2) + h


def kv_cache_bytes(hf_config: Any, sequences: int, seq_len: int, dtype: str = "float32") -> int:
    """Keys and values of ``sequences`` sequences of ``seq_len`` tokens (HF ``generate``'s cache)."""
    d = _dims(hf_config)
    return 2 * d["layers"] * d["groups"] * d["head_dim"] * sequences * seq_len * DTYPE_BYTES[dtype]


def shard_parameters(hf_config: Any, *, tp: int = 1, pp: int = 1, pp_rank: int = 0) -> int:
    """Parameters of one TP/PP shard of ``build_gpt_model(hf_config)`` (every TP rank of a stage
    holds the same number)."""
    for name, v in (("tp", tp), ("pp", pp)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    if not 0 <= pp_rank < pp:
        raise ValueError(f"pp_rank must be in [0, {pp}), got {pp_rank!r}")
    d = _dims(hf_config)
    if d["layers"] % pp or d["groups"] % tp or d["heads"] % tp:
        raise ValueError(f"tp={tp} must divide the attention heads ({d['heads']}) and key/value heads "
                         f"({d['groups']}), pp={pp} the layers ({d['layers']})")
    h, q, kv = d["hidden"], d["heads"] * d["head_dim"], d["groups"] * d["head_dim"]
    layer = (h * (q + 2 * kv) + q * h + 3 * h * d["ffn"]) // tp + 2 * h
    if d["qkv_bias"]:
        layer += (q + 2 * kv) // tp
    n = d["layers"] // pp * layer
    embed = padded_vocab_size(d["vocab"], tp) * h // tp
    first, last = pp_rank == 0, pp_rank == pp - 1
    if first:
        n += embed
    if last:
        n += h  # final norm
        if not d["tied"] or pp > 1:
            n += embed  # the output layer (a tied one is a copy on the last stage when pp > 1)
    return n


@dataclass(frozen=True)
class ShardMemory:
    """Bytes one rank's Megatron actor holds (``training_memory``); ``total`` is their sum."""

    parameters: int
    weights: int
    gradients: int
    optimizer: int
    reference: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.reference + self.activations

    def gb(self) -> dict:
        return {k: getattr(self, k) / GB for k in ("weights", "gradients", "optimizer", "reference", "activations",
                                                    "total")}


def training_memory(hf_config: Any, *, tp: int = 1, pp: int = 1, dp: int = 1, pp_rank: int = 0,
                    dtype: str = "float32", distributed_optimizer: bool = False, reference: bool = False,
                    micro_batch_tokens: int = 8192, seq_len: int = 1024, fused_attention: bool = False) -> ShardMemory:
    """``ShardMemory`` of one rank at pipeline stage ``pp_rank`` (module docstring: the terms).
    ``fused_attention``: Transformer Engine / flash attention keeps no s x s scores (drops the
    s-squared activation term)."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ValueError(f"dp must be an integer >= 1, got {dp!r}")
    for name, v in (("micro_batch_tokens", micro_batch_tokens), ("seq_len", seq_len)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    n = shard_parameters(hf_config, tp=tp, pp=pp, pp_rank=pp_rank)
    width = DTYPE_BYTES[dtype]
    opt_per_param = 8 + (4 if width < 4 else 0)
    optimizer = math.ceil(n * opt_per_param / (dp if distributed_optimizer else 1))
    d = _dims(hf_config)
    T, s, h = micro_batch_tokens, min(seq_len, micro_batch_tokens), d["hidden"]
    scores = 0.0 if fused_attention else 5 * d["heads"] * s / (h * tp)
    per_layer = T * h * (10 + 24 / tp + scores) * (width / 2)
    acts = per_layer * (d["layers"] // pp) * (pp - pp_rank if pp > 1 else 1)
    if pp_rank == pp - 1:
        acts += 3 * T * padded_vocab_size(d["vocab"], tp) // tp * 4
    return ShardMemory(parameters=n, weights=n * width, gradients=4 * n, optimizer=optimizer,
                       reference=n * width if reference else 0, activations=int(acts))
