"""Drift guard: hashes of the veRL 0.9.1 functions the plugin hooks or relies on.

The plugin wraps ``_balance_batch`` and depends on what runs around it (the V1 step order,
the loss-free padding, the mini-batch multiple, how the advantage step calls registered
estimators). The CPU mode adds the
platform selection, the process-group, engine-registry and FSDP offload seams it patches, the
rollout registries and the calls its ``hf`` rollout answers. If any of these change in the
installed veRL, ``changed()`` names them, so an upgrade fails loudly in the tests instead of silently training something else.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import textwrap

__all__ = ["PINNED", "changed", "source_hash"]

# "module:qualname" -> sha256[:16] of the dedented source, veRL 0.9.1
PINNED = {
    "verl.trainer.ppo.v1.trainer_base:PPOTrainer._balance_batch": "358620695a10c66e",
    "verl.trainer.ppo.v1.trainer_base:PPOTrainer._step_once": "b82ae0c246dd687f",
    "verl.trainer.ppo.v1.trainer_base:PPOTrainer._get_required_batch_multiple": "e468066c39a0cd23",
    "verl.trainer.ppo.v1.trainer_base:PPOTrainer._compute_advantage": "ce9f40b2d0cebe11",
    "verl.trainer.ppo.v1.trainer_base:PPOTrainer._update_actor": "604dd6989c331a03",
    "verl.trainer.ppo.v1.utils:compute_advantage_for_multi_trajectories": "d973cc8aec79bc3d",
    "verl.trainer.ppo.padding_utils:upsample_batch_to_divisible_size": "65c6774fbd9dad48",
    "verl.trainer.ppo.padding_utils:construct_minimal_padding_template": "31f96671a0742859",
    "verl.trainer.ppo.ray_trainer:RayPPOTrainer._balance_batch": "b7c960a9913b8eea",
    "verl.trainer.ppo.ray_trainer:RayPPOTrainer._get_dp_size": "7475bf407cca6276",
    "verl.trainer.ppo.ray_trainer:RayPPOTrainer._update_actor": "736c50c688084fa4",
    "verl.trainer.ppo.ray_trainer:RayPPOTrainer.fit": "b5678ef1a7c07ab6",
    "verl.trainer.ppo.ray_trainer:compute_advantage": "314695381c755264",
    "verl.trainer.ppo.core_algos:register_adv_est": "d560ae823494d769",
    "verl.trainer.ppo.core_algos:agg_loss": "fd052ff7eb539f78",
    "verl.trainer.main_ppo:main": "eb706c4f6622ed04",
    "verl.trainer.main_ppo:run_ppo": "a65eddb189e56ae1",
    # the CPU mode (integrations/verl/cpu/): platform choice, the three seams, the rollout
    # registries and the calls our hf rollout answers; the audit recorders' targets
    "verl.plugin.platform.platform_manager:_detect_platform_name": "8dffc2174390e96d",
    "verl.utils.distributed:initialize_global_process_group_ray": "761a94d1a2e058d3",
    "verl.workers.engine.base:EngineRegistry.get_engine_cls": "e5c6c38ad4a0fcf2",
    "verl.workers.engine.fsdp.transformer_impl:FSDPEngine._build_fsdp_module": "41da6c4ed82d496a",
    "verl.workers.engine_workers:TrainingWorker.__init__": "751deb94b2f32d4e",
    "verl.workers.engine_workers:ActorRolloutRefWorker.update_weights": "6894cd3fd3e20715",
    "verl.workers.rollout.base:get_rollout_class": "d0be5827f1214f04",
    "verl.workers.rollout.replica:RolloutReplica.init_hybrid": "ec903aad46adf76d",
    "verl.workers.rollout.replica:RolloutReplicaRegistry.get": "5af2d9851beaec2e",
    "verl.workers.rollout.llm_server:LLMServerClient.generate": "8d3e05f652e0cfd4",
    "verl.experimental.agent_loop.agent_loop:AgentLoopWorker.generate_sequences": "aaf4c62352a565b3",
    "verl.trainer.ppo.v1.trainer_base:PPOTrainer._compute_old_log_prob": "e9ee1fc72ac57177",
    "verl.trainer.ppo.ray_trainer:RayPPOTrainer._compute_old_log_prob": "37936dd4c6debf30",
    # the wall-clock budget of the veRL study (clock.py): the first call of a legacy step
    "verl.trainer.ppo.ray_trainer:RayPPOTrainer._get_gen_batch": "9a436d3f19493c7b",
}


def _resolve(name: str):
    module_name, qualname = name.split(":")
    obj = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    # our own wrapper and hydra's decorator hide the function veRL wrote
    obj = getattr(obj, "__cppo_original__", obj)
    return getattr(obj, "__wrapped__", obj)


def source_hash(name: str) -> str:
    """sha256[:16] of the source of ``module:qualname`` as installed."""
    src = textwrap.dedent(inspect.getsource(_resolve(name)))
    return hashlib.sha256(src.encode()).hexdigest()[:16]


def changed(pinned: dict[str, str] | None = None) -> list[str]:
    """Names whose installed source differs from the pinned hash (or that are gone)."""
    out = []
    for name, digest in (PINNED if pinned is None else pinned).items():
        try:
            now = source_hash(name)
        except (ImportError, AttributeError, OSError, TypeError) as exc:
            out.append(f"{name} (gone: {exc.__class__.__name__}: {exc})")
            continue
        if now != digest:
            out.append(f"{name} (source hash {now}, pinned {digest})")
    return out
