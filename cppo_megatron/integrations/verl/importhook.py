"""Run a function right after a given module is imported (or now, if it already is).

The plugin is imported by ``import verl`` in every process, long before veRL imports its
trainers, engines or rollout modules — and many processes (Ray workers) never import some of
them. Patching on import keeps the plugin cheap to load and its seams in place whichever
process imports what.
"""

from __future__ import annotations

import importlib.abc
import sys
from typing import Callable

__all__ = ["after_import", "pending"]

_CALLBACKS: dict[str, list[Callable]] = {}


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps the loader of each watched module so its callbacks run after it executes."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _CALLBACKS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _Loader(spec.loader)
                return spec
        return None


class _Loader(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        for fn in _CALLBACKS.get(module.__name__, ()):
            fn(module)


_FINDER = _Finder()


def after_import(module_name: str, fn: Callable) -> None:
    """Call ``fn(module)`` once ``module_name`` is imported; immediately when it already is.
    ``fn`` must be idempotent: it also runs again if the module is re-imported."""
    if not module_name or not callable(fn):
        raise ValueError(f"after_import: need a module name and a callable, got {module_name!r}, {fn!r}")
    callbacks = _CALLBACKS.setdefault(module_name, [])
    if fn not in callbacks:
        callbacks.append(fn)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    module = sys.modules.get(module_name)
    if module is not None:
        fn(module)


def pending(fn: Callable) -> list[str]:
    """Module names ``fn`` is registered for (tests)."""
    return [name for name, fns in _CALLBACKS.items() if fn in fns]


def remove(fn: Callable) -> None:
    """Unregister ``fn`` everywhere (tests)."""
    for fns in _CALLBACKS.values():
        if fn in fns:
            fns.remove(fn)
