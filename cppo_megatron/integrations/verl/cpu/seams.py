"""The three places where veRL 0.9.1 assumes an accelerator, each fixed from outside and only
when the platform is ``cpu`` (docs/integrations/verl.md, "The veRL 0.9.1 lines the CPU mode
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
   pinning needs an accelerator, so on CPU the policy is built with ``pin_memory=False``.

Each fix is installed when its module is imported (``importhook``) and checks the platform
at call time, so nothing changes for a run on GPUs. ``drift.py`` hashes the veRL functions the
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


def install() -> None:
    """Install the three fixes (idempotent); each takes effect only on the cpu platform."""
    after_import(FSDP_MODULE, _patch_fsdp)
    after_import(DIST_MODULE, _patch_process_group)
    for name in DIST_USERS:
        after_import(name, _patch_users)
