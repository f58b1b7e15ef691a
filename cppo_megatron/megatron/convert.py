"""HF Qwen2 / Llama weights <-> a megatron-core ``GPTModel`` sharded over TP and PP.

Layouts that differ between the two:

- attention: HF keeps q, k, v separately; megatron's ``linear_qkv`` interleaves them per
  query group: for each of the G key/value heads, its (heads/G) query heads, then its key
  head, then its value head. Splitting that along dim 0 gives each TP rank G/tp whole
  groups, which is why tp must divide num_key_value_heads.
- MLP: megatron's ``linear_fc1`` is [gate; up] *per TP shard* (each rank holds its own
  slice of gate followed by its slice of up), not the full gate followed by the full up.
- ``linear_proj`` (o_proj) and ``linear_fc2`` (down_proj) are split along the input dim.
- embedding / output layer: the vocabulary is padded to the megatron size and split
  along dim 0; padding rows are zero and are dropped on export.
- layers: pipeline stage s holds layers [s L/pp, (s+1) L/pp) under local indices.

``load_hf_weights`` fills this rank's shard from a full HF state dict (every rank passes
the same dict); ``export_hf_weights`` gathers a full HF state dict on every rank.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from .model import hf_get

__all__ = ["export_hf_weights", "load_hf_weights", "unwrap_model"]


def unwrap_model(model):
    """The ``GPTModel`` inside Megatron DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def _dims(hf_config):
    heads = int(hf_get(hf_config, "num_attention_heads"))
    groups = int(hf_get(hf_config, "num_key_value_heads") or heads)
    hidden = int(hf_get(hf_config, "hidden_size"))
    head_dim = int(hf_get(hf_config, "head_dim") or hidden // heads)
    return heads, groups, head_dim


def _qkv_full(q, k, v, heads, groups, d):
    """[heads*d (+2 groups*d), ...] in megatron's per-group interleaving."""
    rest = q.shape[1:]
    q = q.reshape(groups, heads // groups * d, *rest)
    k = k.reshape(groups, d, *rest)
    v = v.reshape(groups, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def _qkv_split(full, heads, groups, d):
    rest = full.shape[1:]
    per = heads // groups * d
    x = full.reshape(groups, per + 2 * d, *rest)
    return (
        x[:, :per].reshape(heads * d, *rest),
        x[:, per : per + d].reshape(groups * d, *rest),
        x[:, per + d :].reshape(groups * d, *rest),
    )


def _layer_map(te_fused: bool) -> dict:
    """megatron suffix (after ``decoder.layers.N.``) -> (kind, HF suffix(es) after ``model.layers.N.``)."""
    ln1 = "self_attention.linear_qkv.layer_norm_weight" if te_fused else "input_layernorm.weight"
    ln2 = "mlp.linear_fc1.layer_norm_weight" if te_fused else "pre_mlp_layernorm.weight"
    return {
        ln1: ("copy", "input_layernorm.weight"),
        ln2: ("copy", "post_attention_layernorm.weight"),
        "self_attention.linear_qkv.weight": ("qkv", ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                     "self_attn.v_proj.weight")),
        "self_attention.linear_qkv.bias": ("qkv", ("self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                                   "self_attn.v_proj.bias")),
        "self_attention.linear_proj.weight": ("col1", "self_attn.o_proj.weight"),
        "mlp.linear_fc1.weight": ("gate_up", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
        "mlp.linear_fc2.weight": ("col1", "mlp.down_proj.weight"),
    }


def _params(model) -> dict:
    return {k: v for k, v in unwrap_model(model).named_parameters()}


def _global_layer(model, local: int) -> int:
    return int(unwrap_model(model).decoder.layers[local].layer_number) - 1


def _split_key(name: str):
    """'decoder.layers.3.mlp.linear_fc1.weight' -> (3, 'mlp.linear_fc1.weight'), else (None, name)."""
    if name.startswith("decoder.layers."):
        rest = name[len("decoder.layers.") :]
        idx, _, suffix = rest.partition(".")
        return int(idx), suffix
    return None, name


_TOP_LEVEL = ("embedding.word_embeddings.weight", "output_layer.weight", "decoder.final_layernorm.weight")


def _check_mapped(params: dict, lmap: dict) -> None:
    """Refuse a model with a parameter this converter has no HF counterpart for, before anything
    is copied or gathered (a model other than ``build_gpt_model``'s Qwen2 / Llama)."""
    for name in params:
        layer, suffix = _split_key(name)
        if (name not in _TOP_LEVEL) if layer is None else (suffix not in lmap):
            raise ValueError(f"no HF counterpart known for megatron parameter {name!r}: this converter maps the "
                             "Qwen2 / Llama GPTModel that build_gpt_model builds")


def _tp():
    from megatron.core import parallel_state as ps

    return (ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(),
            ps.get_tensor_model_parallel_group())


@torch.no_grad()
def load_hf_weights(model, hf_state_dict: dict, hf_config: Any) -> None:
    """Copy a full HF Qwen2/Llama state dict into this rank's TP/PP shard of ``model``.

    Every parameter of the shard must be filled and every HF tensor the shard needs must
    be present; otherwise a ValueError names the key.
    """
    tp, tp_rank, _ = _tp()
    heads, groups, d = _dims(hf_config)
    params = _params(model)
    te_fused = any(k.endswith("layer_norm_weight") for k in params)
    lmap = _layer_map(te_fused)
    _check_mapped(params, lmap)
    tied = bool(hf_get(hf_config, "tie_word_embeddings", False))
    sd = {k: v for k, v in hf_state_dict.items()}

    def hf(key):
        if key not in sd:
            raise ValueError(f"HF state dict has no {key!r}, needed for this megatron shard")
        return sd[key].detach().to(torch.float32)

    def shard(t, dim):
        return t.chunk(tp, dim=dim)[tp_rank]

    def vocab_shard(t, rows):
        padded = torch.zeros(rows * tp, *t.shape[1:], dtype=t.dtype)
        padded[: t.shape[0]] = t
        return shard(padded, 0)

    for name, p in params.items():
        layer, suffix = _split_key(name)
        if layer is None:
            if name == "embedding.word_embeddings.weight":
                val = vocab_shard(hf("model.embed_tokens.weight"), p.shape[0])
            elif name == "output_layer.weight":
                src = "model.embed_tokens.weight" if tied else "lm_head.weight"
                val = vocab_shard(hf(src), p.shape[0])
            else:  # decoder.final_layernorm.weight (_check_mapped)
                val = hf("model.norm.weight")
        else:
            kind, src = lmap[suffix]
            pre = f"model.layers.{_global_layer(model, layer)}."
            if kind == "copy":
                val = hf(pre + src)
            elif kind == "qkv":
                q, k, v = (hf(pre + s) for s in src)
                val = shard(_qkv_full(q, k, v, heads, groups, d), 0)
            elif kind == "col1":
                val = shard(hf(pre + src), 1)
            else:  # gate_up
                gate, up = (hf(pre + s) for s in src)
                val = torch.cat([shard(gate, 0), shard(up, 0)], dim=0)
        if tuple(val.shape) != tuple(p.shape):
            raise ValueError(f"{name}: converted HF tensor has shape {tuple(val.shape)}, "
                             f"the shard needs {tuple(p.shape)}")
        p.copy_(val.to(p.dtype))


def _gather_tp(t: torch.Tensor, dim: int) -> list[torch.Tensor]:
    tp, _, group = _tp()
    if tp == 1:
        return [t]
    parts = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def _pipeline_keepers(dst_ranks) -> list[int]:
    """The ranks of this rank's pipeline group that keep the exported dict."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        ranks = [dist.get_rank()]
    else:
        ranks = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
    return [r for r in ranks if dst_ranks is None or r in dst_ranks]


@torch.no_grad()
def export_hf_weights(model, hf_config: Any, *, dst_ranks: Iterable[int] | None = None) -> dict:
    """The full HF state dict (float32, CPU) of a TP/PP-sharded ``model``, on every rank, or
    only on ``dst_ranks`` (global ranks; the others return ``{}``).

    TP shards are all-gathered, pipeline stages exchange their converted parts (with
    ``dst_ranks``: sent only to the ranks that keep them). Meant for checkpoints and for
    syncing weights into a rollout engine. A rank outside ``dst_ranks`` whose pipeline group
    has no member in it holds at most one gathered tensor at a time (every rank still joins
    the TP all-gathers).
    """
    from megatron.core import parallel_state as ps

    keep_set = None if dst_ranks is None else {int(r) for r in dst_ranks}
    keepers = _pipeline_keepers(keep_set)
    keep_any = bool(keepers)  # someone in my pipeline group needs my stage's part
    heads, groups, d = _dims(hf_config)
    vocab = int(hf_get(hf_config, "vocab_size"))
    tied = bool(hf_get(hf_config, "tie_word_embeddings", False))
    params = _params(model)
    te_fused = any(k.endswith("layer_norm_weight") for k in params)
    lmap = _layer_map(te_fused)
    _check_mapped(params, lmap)
    out: dict = {}
    for name, p in params.items():
        if not keep_any:
            out.clear()  # nobody in this pipeline group keeps the weights: drop each tensor at once
        layer, suffix = _split_key(name)
        t = p.detach()
        if layer is None:
            if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                if name == "output_layer.weight" and tied:
                    continue  # the same tensor as the embedding (first stage exports it)
                full = torch.cat(_gather_tp(t, 0), dim=0)[:vocab]
                out["model.embed_tokens.weight" if name.startswith("embedding") else "lm_head.weight"] = full
            else:  # decoder.final_layernorm.weight (_check_mapped)
                out["model.norm.weight"] = t.clone()
            continue
        kind, dst = lmap[suffix]
        pre = f"model.layers.{_global_layer(model, layer)}."
        if kind == "copy":
            out[pre + dst] = t.clone()
        elif kind == "qkv":
            full = torch.cat(_gather_tp(t, 0), dim=0)
            for key, val in zip(dst, _qkv_split(full, heads, groups, d), strict=True):
                out[pre + key] = val.contiguous()
        elif kind == "col1":
            out[pre + dst] = torch.cat(_gather_tp(t, 1), dim=1)
        else:
            parts = _gather_tp(t, 0)
            half = t.shape[0] // 2
            out[pre + dst[0]] = torch.cat([s[:half] for s in parts], dim=0)
            out[pre + dst[1]] = torch.cat([s[half:] for s in parts], dim=0)
    if not keep_any:
        out.clear()
    out = {k: v.to("cpu", torch.float32) for k, v in out.items()}
    if ps.get_pipeline_model_parallel_world_size() > 1 and keep_any:
        pp_group = ps.get_pipeline_model_parallel_group()
        n_stages = ps.get_pipeline_model_parallel_world_size()
        if len(keepers) == 1:
            stages: list | None = [None] * n_stages if dist.get_rank() == keepers[0] else None
            dist.gather_object(out, stages, dst=keepers[0], group=pp_group)
        else:
            stages = [None] * n_stages
            dist.all_gather_object(stages, out, group=pp_group)
        out = {k: v for part in (stages or []) for k, v in part.items()}
    if keep_set is not None and dist.get_rank() not in keep_set:
        return {}
    if tied:
        out.pop("lm_head.weight", None)
    return out
