"""A Transformer-Engine-free GPT layer spec with Transformer Engine's parameter names.

mbridge 0.15.1 builds every model from ``get_gpt_decoder_block_spec(config,
use_transformer_engine=True)`` (``mbridge/core/llm_bridge.py:149``), which needs Transformer
Engine (absent on CPU: ``NameError: TENorm``). Its weight map, its HF export and the dist
checkpoints name TE's modules: the input RMSNorm is ``self_attention.linear_qkv.layer_norm_weight``
and the pre-MLP RMSNorm ``mlp.linear_fc1.layer_norm_weight`` (TE fuses the norm into the linear).

``te_free_block_spec`` starts from megatron-core's local spec and keeps those names:

- ``input_layernorm`` / ``pre_mlp_layernorm`` become ``IdentityOp``; ``linear_qkv`` and
  ``linear_fc1`` are ``LocalLayerNormColumnParallelLinear``, a ``ColumnParallelLinear`` that owns
  ``layer_norm_weight`` and applies the RMSNorm to its input first (as TE's
  ``TELayerNormColumnParallelLinear``);
- the class name contains ``LayerNormColumnParallelLinear`` on purpose: Megatron-Bridge's
  ``AutoMapping`` recognises TE's fused norm + linear by that substring
  (``megatron/bridge/models/conversion/param_mapping.py:1482``) and then treats
  ``layer_norm_weight`` as replicated and ``weight``/``bias`` as column-parallel;
- the final norm and q/k norms are ``SequenceParallelRMSNorm``: megatron-core's torch norm
  refuses sequence parallel (``transformer/torch_norm.py:32``), which mbridge switches on
  whenever TP > 1 (``llm_bridge.py:72``). Under sequence parallel each TP rank normalises a
  slice of the sequence, so the weight's gradient is partial: the weight carries
  ``sequence_parallel=True``, and megatron-core sums such gradients over the TP group
  (``distributed/finalize_model_grads.py:354``), as it does for TE's norms.

The norm computes like HF's ``Qwen2RMSNorm``: in float32, cast back, then scaled by the weight.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Any

import torch

# LocalLayerNormColumnParallelLinear too (built lazily by __getattr__: it subclasses megatron-core's linear)
__all__ = ["SequenceParallelRMSNorm", "rms_norm", "te_free_block_spec"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32 (HF ``Qwen2RMSNorm``).

    Args:
        x: [..., H] activations (bf16/fp16/fp32).
        weight: [H] scale, same dtype as the parameters.
    Returns: [..., H] in ``x``'s dtype.
    """
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


class SequenceParallelRMSNorm(torch.nn.Module):
    """RMSNorm whose weight gradient is summed over the TP group under sequence parallel.

    Built by megatron-core's ``build_module`` as ``(config=..., hidden_size=..., eps=...)``.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **kwargs: Any) -> None:
        super().__init__()
        if getattr(config, "normalization", "RMSNorm") != "RMSNorm":
            raise ValueError(f"cppo cpu mode: normalization={config.normalization!r}; the TE-free spec has RMSNorm "
                             "only")
        self.eps = float(eps)
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = bool(config.sequence_parallel)  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def _column_parallel_linear():
    from megatron.core.tensor_parallel import ColumnParallelLinear

    return ColumnParallelLinear


class _NormedMixin:
    """Owns ``layer_norm_weight`` and normalises the input before the column-parallel GEMM."""

    weight: torch.Tensor  # ColumnParallelLinear's, next in the MRO (unset before its __init__)

    def _init_norm(self, input_size: int, config) -> None:
        if getattr(config, "normalization", "RMSNorm") != "RMSNorm":
            raise ValueError(f"cppo cpu mode: normalization={config.normalization!r}; the TE-free spec has RMSNorm "
                             "only")
        device = self.weight.device if getattr(self, "weight", None) is not None else None
        self.norm_eps = float(config.layernorm_epsilon)
        self.layer_norm_weight = torch.nn.Parameter(torch.ones(input_size, dtype=config.params_dtype, device=device))
        # the norm sees this rank's sequence slice under sequence parallel: sum its grad over TP
        self.layer_norm_weight.sequence_parallel = bool(  # type: ignore[attr-defined]  # megatron-core's tag
            config.sequence_parallel)

    def forward(self, input_, *args, **kwargs):
        # a mixin: super() is ColumnParallelLinear in the classes built below
        return super().forward(  # type: ignore[misc]
            rms_norm(input_, self.layer_norm_weight, self.norm_eps), *args, **kwargs)


def __getattr__(name: str):
    # the class subclasses megatron-core's ColumnParallelLinear: built on first use, so importing
    # this module does not import megatron-core
    if name == "LocalLayerNormColumnParallelLinear":
        base = _column_parallel_linear()

        class LocalLayerNormColumnParallelLinear(_NormedMixin, base):  # type: ignore[valid-type, misc]
            """``ColumnParallelLinear`` with TE's fused input RMSNorm (``layer_norm_weight``)."""

            def __init__(self, input_size: int, output_size: int, *args: Any, **kwargs: Any) -> None:
                super().__init__(input_size, output_size, *args, **kwargs)
                self._init_norm(input_size, kwargs["config"])

        globals()[name] = LocalLayerNormColumnParallelLinear
        return LocalLayerNormColumnParallelLinear
    raise AttributeError(name)


def _replace(spec, **submodules):
    """A copy of ``spec`` (a ModuleSpec) with some of its submodules replaced."""
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, **submodules))


def _te_named_layer(layer_spec, normed_linear, norm):
    from megatron.core.transformer.identity_op import IdentityOp

    sub = layer_spec.submodules
    attn = sub.self_attention
    if not hasattr(attn.submodules, "linear_qkv"):
        raise ValueError("cppo cpu mode: the TE-free layer spec supports standard self-attention only (not MLA)")
    mlp = sub.mlp
    # megatron-core 0.16: a ModuleSpec; 0.18: functools.partial(MLP.as_mlp_submodule, submodules=...)
    mlp_sub = mlp.keywords.get("submodules") if isinstance(mlp, functools.partial) else getattr(mlp, "submodules", None)
    if mlp_sub is None or getattr(mlp_sub, "linear_fc1", None) is None:
        raise ValueError("cppo cpu mode: the TE-free layer spec supports dense MLPs only (not MoE)")
    qk = {k: (norm if getattr(attn.submodules, k) is not IdentityOp else IdentityOp)
          for k in ("q_layernorm", "k_layernorm")}
    attn = _replace(attn, linear_qkv=normed_linear, **qk)
    if isinstance(mlp, functools.partial):
        normed_sub = dataclasses.replace(mlp_sub, linear_fc1=normed_linear)
        mlp = functools.partial(mlp.func, *mlp.args, **{**mlp.keywords, "submodules": normed_sub})
    else:
        mlp = _replace(mlp, linear_fc1=normed_linear)
    layer = _replace(layer_spec, input_layernorm=IdentityOp, self_attention=attn,
                     pre_mlp_layernorm=IdentityOp, mlp=mlp)
    # the local spec maps input_layernorm./pre_mlp_layernorm. to the TE names for checkpoints;
    # with the norms inside the linears the names are TE's already
    return dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, sharded_state_dict_keys_map={}))


def te_free_block_spec(config, vp_stage: int | None = None):
    """The decoder block spec mbridge would build with Transformer Engine, built without it.

    Args:
        config: megatron-core ``TransformerConfig`` (RMSNorm, dense MLP, standard attention).
        vp_stage: virtual pipeline stage, or None.
    Returns: ``TransformerBlockSubmodules`` whose parameter names equal TE's spec's.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    if config.normalization != "RMSNorm":
        raise ValueError(f"cppo cpu mode: normalization={config.normalization!r}; mbridge supports RMSNorm only")
    if getattr(config, "num_moe_experts", None):
        raise ValueError("cppo cpu mode: MoE models are not supported by the TE-free layer spec")
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm",
                                       vp_stage=vp_stage)
    normed = __getattr__("LocalLayerNormColumnParallelLinear")
    done: dict[int, Any] = {}  # one replacement per distinct layer spec (layers share them)
    layers = []
    for spec in block.layer_specs:
        if id(spec) not in done:
            done[id(spec)] = _te_named_layer(copy.copy(spec), normed, SequenceParallelRMSNorm)
        layers.append(done[id(spec)])
    return dataclasses.replace(block, layer_specs=layers, layer_norm=SequenceParallelRMSNorm)
