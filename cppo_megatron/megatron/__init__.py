"""megatron-core pieces for CPPO: model build and HF weight conversion, per-token log-probs
on pruned packed micro-batches, the policy update, and CPU mode. Needs the ``megatron``
extra; everything imports megatron-core lazily.

- ``model``: ``init_parallel``, ``build_gpt_model``, ``transformer_config_from_hf``
- ``convert``: ``load_hf_weights``, ``export_hf_weights``
- ``passes``: ``compute_logprobs``, ``policy_loss``, ``policy_update``,
  ``build_ddp_and_optimizer``, ``UpdateBatch``, ``PolicyLossConfig``, ``ForwardCounter``
- ``actor``: ``MegatronActor``: ``step`` (prune + rebalance -> old/ref log-probs -> mu updates),
  or ``logprobs`` / ``update`` on survivors chosen by the caller; ``state_dict`` per rank
- ``cpu_mode``: ``cpu_mode()``, ``check_cpu_supported``, ``CPUModeError``
"""

from .actor import ActorConfig, ActorStepResult, MegatronActor
from .convert import export_hf_weights, load_hf_weights, unwrap_model
from .cpu_mode import CPUModeError, check_cpu_supported, cpu_mode, on_cpu
from .model import (
    ParallelLayout,
    build_gpt_model,
    current_layout,
    destroy_parallel,
    init_parallel,
    padded_vocab_size,
    transformer_config_from_hf,
)
from .optimizer import build_ddp_and_optimizer
from .passes import (
    ForwardCounter,
    PolicyLossConfig,
    UpdateBatch,
    compute_logprobs,
    policy_loss,
    policy_update,
)

__all__ = [
    "ActorConfig",
    "ActorStepResult",
    "MegatronActor",
    "CPUModeError",
    "ForwardCounter",
    "ParallelLayout",
    "PolicyLossConfig",
    "UpdateBatch",
    "build_ddp_and_optimizer",
    "build_gpt_model",
    "check_cpu_supported",
    "compute_logprobs",
    "cpu_mode",
    "current_layout",
    "destroy_parallel",
    "export_hf_weights",
    "init_parallel",
    "load_hf_weights",
    "on_cpu",
    "padded_vocab_size",
    "policy_loss",
    "policy_update",
    "transformer_config_from_hf",
    "unwrap_model",
]
