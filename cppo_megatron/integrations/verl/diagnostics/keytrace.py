"""Key trace: which config keys a veRL run actually read, where, and with which value.

``CPPO_VERL_KEYS=DIR`` (exported to every Ray process by ``cppo-megatron verl``, like the audit
mode) makes every process that imports veRL append one JSON line to ``DIR/keys-<pid>.jsonl``
the first time a piece of code reads a config key:

    {"key": "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size", "value": "2",
     "site": "verl/workers/engine/megatron/transformer_impl.py:123", "how": "dataclass",
     "process": "ray::WorkerDict.init_model"}

What counts as a read:

- ``how: "config"``: a leaf (or a list) taken from an OmegaConf ``DictConfig`` by attribute,
  ``[]``, ``.get`` or ``.pop`` — veRL's trainer and workers read most keys this way;
- ``how: "dataclass"``: a field read on one of veRL's config dataclasses (``BaseConfig``) that
  ``omega_conf_to_dataclass`` built from a config node: the dataclass is tagged with the node's
  key, so ``actor_config.megatron.tensor_model_parallel_size`` is recorded under
  ``actor_rollout_ref.actor.megatron.tensor_model_parallel_size`` (copies made with
  ``deepcopy`` or pickling keep the tag);
- ``how: "whole"``: a mapping handed on as a whole (``OmegaConf.to_container`` of a node, e.g.
  ``ray_kwargs.ray_init`` to ``ray.init``, or a dict-valued dataclass field such as
  ``override_transformer_config``): every key under it is read by whoever receives it.

Reads inside the conversions themselves (``to_container``, ``to_object``, ``merge``, hydra's
``instantiate``) are not recorded one by one: a conversion reads every key and proves only that
the key is accepted (a dataclass without the field would have raised). ``site`` is the first
frame outside omegaconf, hydra, dataclasses, veRL's config helpers and this module; reads from
``cppo_megatron`` are recorded too (the report keeps them apart). What the trace cannot see: a
key read from a copy that lost its place in the tree (``OmegaConf.create(node)`` then reads),
and reads in processes that never import veRL. Off (the default) it installs nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

from ...importhook import after_import
from ...wrap import wrap
from . import KEYS_ENV

__all__ = ["ENV", "enabled", "install", "read"]

ENV = KEYS_ENV
TAG = "_cppo_key_path"  # instance attribute on veRL config dataclasses: the config key they came from
WRAP_TAG = __name__  # marks our layers on omegaconf's, hydra's and veRL's readers (integrations/wrap.py)
FIELDS = "_cppo_field_names"  # on a config dataclass: its field names, cached
_local = threading.local()
_seen: set[tuple[str, str, str]] = set()
_lock = threading.Lock()
# frames that belong to the config machinery, not to the code reading a key
_SKIP_PARTS = (os.sep + "omegaconf" + os.sep, os.sep + "hydra" + os.sep, os.sep + "dataclasses.py",
               os.sep + "functools.py", os.sep + "_collections_abc.py", os.sep + "copy.py",
               os.path.join("verl", "base_config.py"), os.path.join("verl", "utils", "config.py"))
# veRL modules that import omega_conf_to_dataclass by name (each gets the tagging wrapper)
CONVERTERS = (
    "verl.utils.config", "verl.utils", "verl.trainer.main_ppo", "verl.trainer.ppo.ray_trainer",
    "verl.trainer.ppo.v1.trainer_base", "verl.trainer.ppo.v1.trainer_separate_async",
    "verl.workers.engine_workers", "verl.workers.config.distillation", "verl.workers.rollout.base",
    "verl.workers.rollout.replica", "verl.experimental.agent_loop.agent_loop",
    "verl.experimental.teacher_loop.teacher_manager", "verl.experimental.teacher_loop.teacher_model",
    "verl.utils.skip.skip_manager",
)


def enabled() -> bool:
    return bool(os.environ.get(ENV))


class _quiet:
    """Inside a bulk conversion: the per-key reads it makes are not the reader's."""

    def __enter__(self):
        _local.depth = getattr(_local, "depth", 0) + 1

    def __exit__(self, *exc):
        _local.depth -= 1
        return False


def _active() -> bool:
    return getattr(_local, "depth", 0) == 0


def _site() -> str:
    """``package/path.py:LINE`` of the first frame outside the config machinery and this file."""
    here = os.path.abspath(__file__)
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if os.path.abspath(name) != here and not any(p in name for p in _SKIP_PARTS):
            for marker in (os.sep + "site-packages" + os.sep, os.sep + "cppo_megatron" + os.sep):
                if marker in name:
                    tail = name.split(marker, 1)[1]
                    name = ("cppo_megatron" + os.sep + tail) if marker.endswith("cppo_megatron" + os.sep) else tail
                    break
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def _process() -> str:
    try:
        return Path("/proc/self/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")[:80]
    except OSError:
        return os.path.basename(sys.argv[0] if sys.argv else "?")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _note(key: str, value: Any, how: str) -> None:
    root = os.environ.get(ENV)
    if not root or not key:
        return
    site = _site()
    ident = (key, site, how)
    with _lock:
        if ident in _seen:
            return
        _seen.add(ident)
    line = json.dumps({"key": key, "value": _short(value), "site": site, "how": how, "process": _process(),
                       "pid": os.getpid()})
    Path(root).mkdir(parents=True, exist_ok=True)
    with open(Path(root) / f"keys-{os.getpid()}.jsonl", "a") as f:
        f.write(line + "\n")


# ----------------------------------------------------------------------------- DictConfig reads
def _dictconfig_reader(original):
    @functools.wraps(original)
    def read(self, key, *args, **kwargs):
        value = original(self, key, *args, **kwargs)
        if _active() and isinstance(key, str) and not key.startswith("_"):
            from omegaconf import DictConfig

            if not isinstance(value, DictConfig):  # a container's children record themselves
                try:
                    full = self._get_full_key(key)
                except Exception:  # a node being built or torn down
                    return value
                _note(str(full), value, "config")
        return value

    return read


def _bulk(original):
    """``OmegaConf.to_container`` and friends: the node's keys are handed on as a whole."""

    @functools.wraps(original)
    def bulk(cfg, *args, **kwargs):
        from omegaconf import DictConfig

        if _active() and isinstance(cfg, DictConfig):
            try:
                full = str(cfg._get_full_key(None))
            except Exception:
                full = ""
            if full:  # the whole tree at once (printing it, converting it) reads nothing in particular
                _note(full, "<mapping>", "whole")
        with _quiet():
            return original(cfg, *args, **kwargs)

    return bulk


def _silent(original):
    @functools.wraps(original)
    def silent(*args, **kwargs):
        with _quiet():
            return original(*args, **kwargs)

    return silent


def _static(make):
    """``make`` for a staticmethod entry of a class: wraps its function, stays a staticmethod."""
    return lambda entry: staticmethod(make(entry.__func__))


# ----------------------------------------------------------------------------- dataclass reads
def _tag(obj: Any, path: str, depth: int = 0) -> None:
    """Tag ``obj`` (a config dataclass built from the node at ``path``) and its nested config
    dataclasses with their keys."""
    if depth > 8 or not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        return
    try:
        object.__setattr__(obj, TAG, path)
    except (AttributeError, TypeError):
        return
    for f in dataclasses.fields(obj):
        try:
            value = object.__getattribute__(obj, f.name)
        except AttributeError:
            continue
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            _tag(value, f"{path}.{f.name}", depth + 1)


def _converter(original):
    @functools.wraps(original)
    def omega_conf_to_dataclass(config, *args, **kwargs):
        from omegaconf import DictConfig

        path = ""
        if isinstance(config, DictConfig):
            try:
                path = str(config._get_full_key(None))
            except Exception:
                path = ""
        with _quiet():
            obj = original(config, *args, **kwargs)
        if path:
            _tag(obj, path)
        return obj

    return omega_conf_to_dataclass


def _field_names(cls) -> frozenset:
    names = cls.__dict__.get(FIELDS)
    if names is None:
        names = frozenset(f.name for f in dataclasses.fields(cls)) if dataclasses.is_dataclass(cls) else frozenset()
        try:
            type.__setattr__(cls, FIELDS, names)
        except (AttributeError, TypeError):
            pass
    return names


def _getattribute(original):
    def __getattribute__(self, name):
        value = original(self, name)
        if name[:1] != "_" and _active():
            d = original(self, "__dict__")
            path = d.get(TAG)
            if path is not None and name in _field_names(type(self)):
                if not (dataclasses.is_dataclass(value) and not isinstance(value, type)):
                    _note(f"{path}.{name}", value, "whole" if isinstance(value, (dict, list)) else "dataclass")
        return value

    return __getattribute__


def _wrap_converters(module) -> None:
    # each module that bound the name before verl.utils.config's was wrapped gets its own layer
    if getattr(module, "omega_conf_to_dataclass", None) is not None:
        wrap(module, "omega_conf_to_dataclass", _converter, tag=WRAP_TAG)


def _wrap_instantiate(module) -> None:
    wrap(module, "instantiate", _silent, tag=WRAP_TAG)


def _wrap_base_config(module) -> None:
    wrap(module.BaseConfig, "__getattribute__", _getattribute, tag=WRAP_TAG)


def install() -> bool:
    """Install the trace in this process when ``CPPO_VERL_KEYS`` is set; True when installed."""
    if not enabled():
        return False
    from omegaconf import DictConfig, OmegaConf

    for name in ("__getattr__", "__getitem__", "get", "pop"):
        wrap(DictConfig, name, _dictconfig_reader, tag=WRAP_TAG)
    for name in ("to_container", "to_object"):
        wrap(OmegaConf, name, _static(_bulk), tag=WRAP_TAG)
    for name in ("merge", "create", "structured", "to_yaml", "resolve"):
        wrap(OmegaConf, name, _static(_silent), tag=WRAP_TAG)
    after_import("hydra.utils", _wrap_instantiate)
    after_import("verl.base_config", _wrap_base_config)
    for name in CONVERTERS:
        after_import(name, _wrap_converters)
    return True


def read(root: str | os.PathLike, key_prefix: str | None = None) -> list[dict]:
    """Every record under ``root`` (all processes); only keys under ``key_prefix`` when given."""
    out = []
    for path in sorted(Path(root).glob("keys-*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                if key_prefix is None or rec["key"] == key_prefix or rec["key"].startswith(key_prefix + "."):
                    out.append(rec)
    return out
