"""veRL 0.9.1's Megatron engine through NVIDIA Megatron-Bridge (``vanilla_mbridge: false``, veRL's
default route, ``verl/workers/engine/megatron/transformer_impl.py:339-342``) on CPU.

Megatron-Bridge 0.5.1 runs on Python 3.12 only (its own ``Requires-Python``); the CPU mode's
Python 3.12 environment is built by ``scripts/setup_bridge.sh`` (``requirements/bridge-cpu.txt``).
On top of the seams in ``megatron_engine`` (engine registry, RNG tracker, ``torch.cuda`` calls,
the engine cpu mode, attention masks), the bridge route needs these, each installed on import,
only with ``VERL_PLATFORM=cpu``, and acting only when the platform is ``cpu`` and CUDA is absent:

1. ``te_placeholder_imports``: ``import megatron.bridge`` (veRL: ``verl/models/mcore/bridge.py:17``)
   imports every model bridge, and two modules on that path import Transformer Engine at module
   level: ``megatron/bridge/peft/lora_layers.py:20`` (``class TELinearAdapter(te.Linear)``) and
   ``megatron/bridge/peft/lora.py:22``. Transformer Engine is CUDA-only. While (and only while)
   each of those two modules executes, ``transformer_engine.pytorch`` is a placeholder whose
   classes refuse to be built (TE LoRA adapters cannot run on CPU); every other module those two
   import is imported first, so nothing else ever sees the placeholder, and it is removed from
   ``sys.modules`` afterwards (megatron-core's own ``HAVE_TE`` stays False).
2. ``te_free_provider_spec``: ``GPTModelProvider.transformer_layer_spec`` defaults to
   ``default_layer_spec`` -> ``transformer_engine_layer_spec`` (``megatron/bridge/models/
   gpt_provider.py:51,119``); on CPU ``provide`` builds ``layer_spec.te_free_block_spec`` instead
   (TE's parameter names, so Megatron-Bridge's weight mappings and export are unchanged).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib
import importlib.util
import sys
import types
from collections.abc import Iterator

from ...importhook import after_import, around_import
from ...wrap import wrap

__all__ = ["PROVIDER_MODULE", "TE_IMPORTING_MODULES", "install", "te_placeholder"]

WRAP_TAG = __name__  # marks our layer on GPTModelProvider.provide (integrations/wrap.py)
PLACEHOLDER = "cppo_te_placeholder"  # True on the placeholder transformer_engine modules
PROVIDER_MODULE = "megatron.bridge.models.gpt_provider"
# Megatron-Bridge 0.5.1 modules on `import megatron.bridge`'s path that import TE at module level
TE_IMPORTING_MODULES = ("megatron.bridge.peft.lora_layers", "megatron.bridge.peft.lora")
_TE_NAMES = ("transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.ops")
# what the two modules name of TE at import time (class bases, isinstance targets)
_TE_CLASSES = ("Linear", "LayerNormLinear")
_TE_OPS = ("Sequential", "LayerNorm", "RMSNorm", "Quantize", "MakeExtraOutput", "Linear", "Dropout",
           "ConstantScale", "AddExtraInput")


class _Absent:
    """A Transformer Engine class on a machine without it: naming it works, building it does not."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError(f"cppo cpu mode: transformer_engine.pytorch.{type(self).__name__} is not available on "
                           "CPU (Transformer Engine is CUDA-only); Megatron-Bridge's TE LoRA adapters cannot run here")


def _placeholder_modules() -> dict[str, types.ModuleType]:
    te = types.ModuleType("transformer_engine")
    pt = types.ModuleType("transformer_engine.pytorch")
    ops = types.ModuleType("transformer_engine.pytorch.ops")
    for name in _TE_CLASSES:
        setattr(pt, name, type(name, (_Absent,), {"__module__": "transformer_engine.pytorch"}))
    for name in _TE_OPS:
        setattr(ops, name, type(name, (_Absent,), {"__module__": "transformer_engine.pytorch.ops"}))
    pt.ops = ops  # type: ignore[attr-defined]
    te.pytorch = pt  # type: ignore[attr-defined]
    for m in (te, pt, ops):
        setattr(m, PLACEHOLDER, True)
    return {"transformer_engine": te, "transformer_engine.pytorch": pt, "transformer_engine.pytorch.ops": ops}


def _module_level_imports(module_name: str) -> list[str]:
    """Absolute modules ``module_name`` imports at its top level, TE's excepted."""
    spec = importlib.util.find_spec(module_name)
    if spec is None or not spec.origin:
        return []
    with open(spec.origin) as f:
        tree = ast.parse(f.read())
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return [n for n in names if n.split(".")[0] != "transformer_engine"]


@contextlib.contextmanager
def te_placeholder(module_name: str) -> Iterator[bool]:
    """Around the execution of ``module_name``: its other imports first, then a placeholder
    ``transformer_engine`` in ``sys.modules`` for the module's own ``import transformer_engine...``,
    removed afterwards. Yields whether the placeholder was used (not when TE is installed or the
    CPU mode is not needed)."""
    from .megatron_engine import needed

    if not needed() or importlib.util.find_spec("transformer_engine") is not None:
        yield False
        return
    for dep in _module_level_imports(module_name):
        importlib.import_module(dep)
    saved = {k: sys.modules.get(k) for k in _TE_NAMES}
    sys.modules.update(_placeholder_modules())
    try:
        yield True
    finally:
        for key, value in saved.items():
            if value is None:
                sys.modules.pop(key, None)
            else:
                sys.modules[key] = value


def _te_free_provide(original):
    @functools.wraps(original)
    def provide(self, pre_process=None, post_process=None, vp_stage=None):
        from .megatron_engine import needed

        if needed() and getattr(self.transformer_layer_spec, "__name__", "") in (
                "default_layer_spec", "transformer_engine_layer_spec"):
            from .layer_spec import te_free_block_spec

            def spec(config, vp_stage=None):
                return te_free_block_spec(config, vp_stage=vp_stage)

            self.transformer_layer_spec = spec
        return original(self, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)

    return provide


def _patch_provider(module) -> None:
    cls = getattr(module, "GPTModelProvider", None)
    if cls is None or "provide" not in cls.__dict__:
        raise RuntimeError(f"cppo cpu mode: {PROVIDER_MODULE}.GPTModelProvider.provide is gone "
                           "(pinned Megatron-Bridge 0.5.1)")
    wrap(cls, "provide", _te_free_provide, tag=WRAP_TAG)


# one context factory per module (module-level, so a second install() registers nothing new)
_PLACEHOLDERS = {name: functools.partial(te_placeholder, name) for name in TE_IMPORTING_MODULES}


def install() -> None:
    """Install the bridge route's seams as their modules are imported (idempotent)."""
    for name, make in _PLACEHOLDERS.items():
        around_import(name, make)
    after_import(PROVIDER_MODULE, _patch_provider)
