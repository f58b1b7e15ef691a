"""Parallel state and a megatron-core ``GPTModel`` built from a HF Qwen2 / Llama config.

    init_parallel(tp=2, pp=1, seed=0)      # after torch.distributed.init_process_group
    model = build_gpt_model(hf_config)     # this rank's shard, float32, local layer spec
    load_hf_weights(model, hf_model.state_dict(), hf_config)   # convert.py
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .._optional import require
from .cpu_mode import check_cpu_supported, cpu_mode, on_cpu

__all__ = [
    "ParallelLayout",
    "SUPPORTED_MODEL_TYPES",
    "build_gpt_model",
    "destroy_parallel",
    "hf_get",
    "init_parallel",
    "padded_vocab_size",
    "transformer_config_from_hf",
    "te_available",
]

SUPPORTED_MODEL_TYPES = ("qwen2", "llama")


def _mcore():
    return require("megatron.core", "the Megatron-core path")


@dataclass(frozen=True)
class ParallelLayout:
    """This rank's place in the TP x PP x DP grid."""

    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


def init_parallel(tp: int = 1, pp: int = 1, *, seed: int = 0, timeout_minutes: int = 30) -> ParallelLayout:
    """Initialise megatron-core's model-parallel groups on the default process group.

    ``timeout_minutes``: a collective on those groups that waits longer (a peer died or
    hangs) fails instead of blocking forever.

    ``torch.distributed`` must already be initialised; world size = tp * pp * dp. The
    seed fixes weight initialisation and dropout on every rank (on CPU through megatron's
    inference RNG tracker, which does not need CUDA RNG state).
    """
    import torch.distributed as dist

    _mcore()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call init_process_group first")
    world = dist.get_world_size()
    for name, v in (("tp", tp), ("pp", pp)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    if world % (tp * pp):
        raise ValueError(f"world size {world} is not divisible by tp * pp = {tp} * {pp}")
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 distributed_timeout_minutes=timeout_minutes)
    with cpu_mode():
        model_parallel_cuda_manual_seed(seed, inference_rng_tracker=on_cpu())
    torch.manual_seed(seed)
    return current_layout()


def current_layout() -> ParallelLayout:
    from megatron.core import parallel_state as ps

    return ParallelLayout(
        tp=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        dp=ps.get_data_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
    )


def destroy_parallel() -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()


def te_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not usable"
        return False
    return torch.cuda.is_available()


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = 128) -> int:
    """Megatron splits the vocabulary evenly over TP ranks: pad to a multiple of tp * ``multiple``."""
    step = tp * multiple
    return int(math.ceil(vocab_size / step) * step)


def hf_get(hf_config, name, default=None):
    """``hf_config``'s field ``name`` (``default`` when absent), from a transformers config
    object or its dict form."""
    return getattr(hf_config, name, default) if not isinstance(hf_config, dict) else hf_config.get(name, default)


def _rope_theta(hf_config) -> float:
    # transformers 5 keeps rope settings in rope_parameters (rope_scaling is an alias);
    # older configs have rope_theta and rope_scaling at the top level.
    params = hf_get(hf_config, "rope_parameters") or hf_get(hf_config, "rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default")) if isinstance(params, dict) else "default"
    if rope_type not in (None, "default"):
        raise ValueError(f"rope_type {rope_type!r} ({params}) is not supported by this converter (only default RoPE)")
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta if theta is not None else hf_get(hf_config, "rope_theta", 10000.0))


def transformer_config_from_hf(
    hf_config: Any,
    *,
    tp: int = 1,
    pp: int = 1,
    params_dtype: torch.dtype = torch.float32,
    sequence_parallel: bool = False,
    **overrides: Any,
):
    """A megatron ``TransformerConfig`` equal in function to a HF Qwen2 / Llama config.

    Dropout is off (RL log-probs must be deterministic); fused kernels that need CUDA are
    off on CPU. ``overrides`` go straight to ``TransformerConfig``.
    """
    _mcore()
    from megatron.core.transformer import TransformerConfig

    model_type = hf_get(hf_config, "model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: {list(SUPPORTED_MODEL_TYPES)}")
    if hf_get(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf_get(hf_config, 'hidden_act')!r} is not supported (only silu)")
    if hf_get(hf_config, "use_sliding_window", False):
        raise ValueError("use_sliding_window=True is not supported by this converter")
    if hf_get(hf_config, "mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported by this converter")
    _rope_theta(hf_config)  # rejects RoPE scaling this converter does not implement
    check_cpu_supported(sequence_parallel=sequence_parallel)
    heads = int(hf_get(hf_config, "num_attention_heads"))
    groups = int(hf_get(hf_config, "num_key_value_heads") or heads)
    hidden = int(hf_get(hf_config, "hidden_size"))
    head_dim = hf_get(hf_config, "head_dim") or hidden // heads
    layers = int(hf_get(hf_config, "num_hidden_layers"))
    if groups % tp or heads % tp:
        raise ValueError(
            f"tp={tp} must divide num_attention_heads={heads} and num_key_value_heads={groups}"
        )
    if layers % pp:
        raise ValueError(f"pp={pp} must divide num_hidden_layers={layers}")
    qkv_bias = model_type == "qwen2" or bool(hf_get(hf_config, "attention_bias", False))
    cpu = on_cpu()
    kw = dict(
        num_layers=layers,
        hidden_size=hidden,
        ffn_hidden_size=int(hf_get(hf_config, "intermediate_size")),
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=int(head_dim),
        normalization="RMSNorm",
        layernorm_epsilon=float(hf_get(hf_config, "rms_norm_eps", 1e-6)),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=sequence_parallel,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=cpu,
        perform_initialization=True,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        # micro-batches differ in shape after pruning + packing: pipeline stages send shapes
        variable_seq_lengths=pp > 1,
        moe_token_dispatcher_type="alltoall",  # the only dispatcher megatron allows with the above (no MoE here)
        init_method_std=float(hf_get(hf_config, "initializer_range", 0.02)),
    )
    kw.update(overrides)
    return TransformerConfig(**kw)


def build_gpt_model(
    hf_config: Any,
    *,
    config=None,
    use_te: bool | None = None,
    vocab_multiple: int = 128,
):
    """This rank's ``GPTModel`` shard for a HF Qwen2 / Llama config (after ``init_parallel``).

    Args:
        hf_config: a ``transformers`` config (or dict) of a Qwen2 / Llama model.
        config: a ``TransformerConfig`` (default ``transformer_config_from_hf`` for the
            current TP/PP sizes).
        use_te: Transformer Engine layer spec; default when TE imports and CUDA is present.
        vocab_multiple: the vocabulary is padded to a multiple of tp * this (the padded
            logits are masked out when computing log-probs).
    """
    _mcore()
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    layout = current_layout()
    if config is None:
        config = transformer_config_from_hf(hf_config, tp=layout.tp, pp=layout.pp)
    use_te = te_available() if use_te is None else use_te
    if use_te and on_cpu():
        raise ValueError("use_te=True needs CUDA: Transformer Engine does not run on CPU")
    spec = get_gpt_layer_with_transformer_engine_spec() if use_te else get_gpt_layer_local_spec(normalization="RMSNorm")
    vocab = int(hf_get(hf_config, "vocab_size"))
    with cpu_mode():
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=padded_vocab_size(vocab, layout.tp, vocab_multiple),
            max_sequence_length=int(hf_get(hf_config, "max_position_embeddings", 4096)),
            pre_process=ps.is_pipeline_first_stage(),
            post_process=ps.is_pipeline_last_stage(),
            share_embeddings_and_output_weights=bool(hf_get(hf_config, "tie_word_embeddings", False)),
            position_embedding_type="rope",
            rotary_base=_rope_theta(hf_config),
        )
    model.cppo_vocab_size = vocab  # the real vocabulary: logits beyond it are padding
    if config.bf16 or config.fp16:
        from megatron.core.transformer.module import Float16Module

        # what megatron's training loop does for half-precision runs: every parameter (norms
        # included, which megatron's torch norm creates in float32) in the config's dtype, inputs
        # cast on the first stage, logits back to float32 on the last
        model = Float16Module(config, model)
    if torch.cuda.is_available():  # pragma: no cover - CUDA only
        model.cuda(torch.cuda.current_device())
    return model
