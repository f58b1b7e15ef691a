"""The rollout side of the weight sync, inside vLLM's worker, for OpenRLHF's CPU mode.

OpenRLHF's ``RolloutRayActor`` runs ``vllm.AsyncLLMEngine``, whose engine core and worker live
in a subprocess that vLLM spawns (it always spawns inside a Ray actor). The worker gets
OpenRLHF's ``WorkerWrap`` (``trainer/ray/vllm_worker_wrap.py``) mixed in; the actor's rank 0
calls its ``init_process_group`` once and ``update_weight(name, dtype, shape, empty_cache)``
per parameter while broadcasting the tensor. On CPU two of its lines cannot work:

- ``vllm_worker_wrap.py:40`` allocates the receive buffer on ``"cuda"`` and :46 passes
  ``torch.cuda.current_stream()``;
- ``vllm_worker_wrap.py:48`` calls ``model.load_weights`` per tensor, but vLLM's CPU backend
  repacks linear weights after loading (``dispatch_cpu_unquantized_gemm`` replaces them by an
  empty tensor and a packed copy), so loading into the model afterwards fails.

So on CPU ``update_weight`` receives into a CPU buffer over the gloo group of
``seams.GlooBroadcaster`` and collects the tensors; at the sync's last tensor (OpenRLHF sets
``empty_cache=True`` only for it, ``ppo_actor.py:427,482``) it reloads them all through
vLLM's own ``reload_weights`` (which re-runs the CPU repacking).

How this reaches the subprocess: vLLM loads the ``vllm.general_plugins`` entry points in
every engine and worker process before it resolves the worker extension class
(``v1/worker/worker_base.py:274-300``); ours (``register``) installs the patch there, only
when the run's CPU mode is on and no CUDA device exists.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from ...importhook import after_import
from ...wrap import wrap
from ..diagnostics import AUDIT_ENV

__all__ = ["WORKER_WRAP_MODULE", "install", "register"]

WORKER_WRAP_MODULE = "openrlhf.trainer.ray.vllm_worker_wrap"
WRAP_TAG = __name__  # marks our layer on WorkerWrap.update_weight (integrations/wrap.py)


def _update_weight_cpu(self, name, dtype, shape, empty_cache=False):
    """``WorkerWrap.update_weight`` on CPU: receive over gloo, reload all at the last tensor."""
    if dtype != self.model_config.dtype:
        raise ValueError(f"weight sync {name}: actor sends {dtype}, the vLLM engine runs {self.model_config.dtype}")
    weight = torch.empty(shape, dtype=dtype, device="cpu")
    if getattr(self, "_model_update_with_ray", False):
        raise RuntimeError(
            "OpenRLHF CPU mode: --vllm.sync_with_ray cannot work with gloo (Ray's collective group would reuse "
            "the actor's DeepSpeed process group); remove the flag"
        )
    self._model_update_group.broadcast(weight, src=0)
    pending = self.__dict__.setdefault("_cppo_pending_weights", {})
    pending[name] = weight
    if empty_cache:  # the sync's last tensor
        weights = dict(pending)
        pending.clear()
        self.reload_weights(weights_iterator=list(weights.items()))
        if os.environ.get(AUDIT_ENV):  # the audit (diagnostics/) is imported only in audit mode
            from ..diagnostics import audit

            audit.record_engine_sync(self, weights)


def _cpu_update_weight(current):
    @functools.wraps(current)
    def update_weight(self, name, dtype, shape, empty_cache=False):
        return _update_weight_cpu(self, name, dtype, shape, empty_cache)

    return update_weight


def _patch_worker_wrap(module) -> None:
    wrap(module.WorkerWrap, "update_weight", _cpu_update_weight, tag=WRAP_TAG)


def install() -> None:
    """The rollout-side seams (idempotent): the worker wrap, the gloo process group, and the record of
    the shared memory vLLM makes on CPU (``integrations/vllm_shm.py``, removed by the launcher)."""
    from ... import vllm_shm
    from . import seams

    vllm_shm.install()

    after_import(seams.DIST_UTIL_MODULE, seams.patch_dist_util)
    after_import(WORKER_WRAP_MODULE, _patch_worker_wrap)


def register() -> Any:
    """vLLM ``general_plugins`` entry point: install when the OpenRLHF CPU mode is on and there
    is no CUDA device (vLLM loads it in every process, on GPUs too)."""
    from .switch import enabled, has_cuda

    if enabled() and not has_cuda():
        install()
    return None
