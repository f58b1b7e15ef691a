"""The four places where veRL 0.9.1 assumes an accelerator, each fixed from outside and only
when the platform is ``cpu`` (docs/records/verl_cpu_mode.md, "The veRL 0.9.1 lines the CPU mode
answers"; paths relative to the ``verl`` package):

1. engines: veRL registers its FSDP engines for devices cuda/npu only
   (``workers/engine/fsdp/transformer_impl.py:1143`` and ``:1594``; ``EngineRegistry`` looks
   them up by ``get_device_name()``, ``workers/engine/base.py:399-430``); the same classes
   are registered for ``cpu``;
2. process group: ``initialize_global_process_group_ray`` (``utils/distributed.py:83``, called
   at ``workers/engine_workers.py:89``) builds the backend string
   ``"cpu:gloo,{device}:{backend}"`` (``utils/distributed.py:89``), which torch rejects for
   device cpu ("Duplicate device type cpu"); on CPU it becomes plain ``"gloo"``;
3. the forward-only (reference) FSDP2 engine is hard-coded to
   ``CPUOffloadPolicy(pin_memory=True)`` (``workers/engine/fsdp/transformer_impl.py:462``):
   pinning needs an accelerator, so on CPU the policy is built with ``pin_memory=False``;
4. ``separate_async`` keeps the old policy for a cycle of local updates by copying the actor's
   shards "to CPU" (``fsdp2_sharded_save_to_cpu``, ``utils/fsdp_utils.py:1167`` and ``:1180``:
   ``tensor.detach().cpu()``; restored by ``experimental/separation/engine_workers.py:140``). On a
   CPU tensor ``.cpu()`` is the tensor itself, so the "copy" follows every update and the restore
   brings back the current weights, not the old policy's: the second local update's old-policy
   pass then runs on the updated weights (measured: ``training/rollout_probs_diff_max`` 0.05 at
   staleness 0). On CPU the saved shards are cloned.

Each fix is installed when its module is imported (``importhook``) and checks the platform
at call time, so nothing changes for a run on GPUs. ``diagnostics/drift.py`` hashes the veRL functions the
fixes rely on (``initialize_global_process_group_ray``, ``EngineRegistry.get_engine_cls``,
``FSDPEngine._build_fsdp_module``), so a changed veRL fails a test instead of a run.
"""

from __future__ import annotations

import functools

from ...importhook import after_import
from ...wrap import wrap

__all__ = ["FSDP_ENGINES", "install", "on_cpu"]

WRAP_TAG = __name__  # marks our layers on veRL's functions (integrations/wrap.py)
# veRL 0.9.1's FSDP engine classes, by registry model type
FSDP_ENGINES = {"language_model": "FSDPEngineWithLMHead", "value_model": "FSDPEngineWithValueHead"}
FSDP_MODULE = "verl.workers.engine.fsdp.transformer_impl"
DIST_MODULE = "verl.utils.distributed"
FSDP_UTILS = "verl.utils.fsdp_utils"
DIST_USERS = ("verl.workers.engine_workers",)  # modules that imported the function by name


def on_cpu() -> bool:
    from verl.utils.device import get_device_name

    return get_device_name() == "cpu"


def _register_engines(module) -> None:
    from verl.workers.engine.base import EngineRegistry

    for model_type, clsname in FSDP_ENGINES.items():
        cls = getattr(module, clsname, None)
        if cls is None:
            raise RuntimeError(f"cppo cpu mode: {FSDP_MODULE}.{clsname} is gone; veRL changed (pinned 0.9.1)")
        registry = EngineRegistry._engines.get(model_type, {})
        for backend in ("fsdp", "fsdp2"):
            if "cpu" not in registry.get(backend, {}):
                EngineRegistry.register(model_type=model_type, backend=[backend], device=["cpu"])(cls)


def _gloo_process_group(original):
    @functools.wraps(original)
    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        if backend is None and on_cpu():
            backend = "gloo"
        return original(timeout_second=timeout_second, backend=backend)

    return initialize_global_process_group_ray


def _patch_process_group(module) -> None:
    if getattr(module, "initialize_global_process_group_ray", None) is None:
        raise RuntimeError(f"cppo cpu mode: {module.__name__}.initialize_global_process_group_ray is gone; "
                           "veRL changed")
    wrap(module, "initialize_global_process_group_ray", _gloo_process_group, tag=WRAP_TAG)


def _patch_users(module) -> None:
    _patch_process_group(__import__(DIST_MODULE, fromlist=["x"]))
    # a module that bound the name before veRL's was wrapped gets its own layer over it
    if getattr(module, "initialize_global_process_group_ray", None) is not None:
        wrap(module, "initialize_global_process_group_ray", _gloo_process_group, tag=WRAP_TAG)


def _unpinned_offload(original):
    @functools.wraps(original)
    def CPUOffloadPolicy(*args, **kwargs):  # noqa: N802 - stands in for the class veRL calls
        if on_cpu():
            kwargs["pin_memory"] = False
        return original(*args, **kwargs)

    return CPUOffloadPolicy


def _patch_fsdp(module) -> None:
    _register_engines(module)
    if getattr(module, "CPUOffloadPolicy", None) is not None:
        wrap(module, "CPUOffloadPolicy", _unpinned_offload, tag=WRAP_TAG)


def _copied_save(original):
    @functools.wraps(original)
    def fsdp2_sharded_save_to_cpu(model, *args, **kwargs):
        state, spec = original(model, *args, **kwargs)
        if on_cpu():  # `.cpu()` of a CPU tensor aliases it: take the copy veRL means to take
            state = {name: (tensor.clone(), shard_spec) for name, (tensor, shard_spec) in state.items()}
        return state, spec

    return fsdp2_sharded_save_to_cpu


def _patch_fsdp_utils(module) -> None:
    if getattr(module, "fsdp2_sharded_save_to_cpu", None) is None:
        raise RuntimeError(f"cppo cpu mode: {FSDP_UTILS}.fsdp2_sharded_save_to_cpu is gone; "
                           "veRL changed (pinned 0.9.1)")
    wrap(module, "fsdp2_sharded_save_to_cpu", _copied_save, tag=WRAP_TAG)


def install() -> None:
    """Install the four fixes (idempotent); each takes effect only on the cpu platform."""
    after_import(FSDP_MODULE, _patch_fsdp)
    after_import(FSDP_UTILS, _patch_fsdp_utils)
    after_import(DIST_MODULE, _patch_process_group)
    for name in DIST_USERS:
        after_import(name, _patch_users)
