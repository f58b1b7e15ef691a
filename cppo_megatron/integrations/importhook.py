"""Run a function right after a given module is imported (or now, if it already is).

One mechanism for both hosts. veRL's plugin is imported by ``import verl`` in every process,
long before veRL imports its trainers, engines or rollout modules; the Ray workers of an
OpenRLHF run import different parts of OpenRLHF (model actors, the vLLM rollout actor, the
driver); and many processes never import some of them. Patching on import keeps the plugins
cheap to load and their seams (CPU modes, hooks, audit recorders) in place whichever process
imports what.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable

__all__ = ["after_import", "around_import", "pending", "remove"]

_AFTER: dict[str, list[Callable]] = {}
_AROUND: dict[str, list[Callable]] = {}


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps the loader of each watched module so its callbacks run around its execution."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _AFTER and fullname not in _AROUND:
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
        contexts = [make() for make in _AROUND.get(module.__name__, ())]
        for ctx in contexts:
            ctx.__enter__()
        try:
            self.inner.exec_module(module)
        finally:
            for ctx in reversed(contexts):
                ctx.__exit__(None, None, None)
        for fn in _AFTER.get(module.__name__, ()):
            fn(module)


_FINDER = _Finder()


def _watch() -> None:
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def after_import(module_name: str, fn: Callable) -> None:
    """Call ``fn(module)`` once ``module_name`` is imported; immediately when it already is.
    ``fn`` must be idempotent: it also runs again if the module is re-imported."""
    if not module_name or not callable(fn):
        raise ValueError(f"after_import: need a module name and a callable, got {module_name!r}, {fn!r}")
    callbacks = _AFTER.setdefault(module_name, [])
    if fn not in callbacks:
        callbacks.append(fn)
    _watch()
    module = sys.modules.get(module_name)
    if module is not None:
        fn(module)


def around_import(module_name: str, make_context: Callable) -> None:
    """Execute ``module_name``'s first import inside the context manager ``make_context()``
    (nothing happens when the module is already imported)."""
    if not module_name or not callable(make_context):
        raise ValueError(f"around_import: need a module name and a callable, got {module_name!r}, {make_context!r}")
    contexts = _AROUND.setdefault(module_name, [])
    if make_context not in contexts:
        contexts.append(make_context)
    _watch()


def pending(fn: Callable) -> list[str]:
    """Module names ``fn`` is registered for (tests)."""
    return [name for name, fns in _AFTER.items() if fn in fns]


def remove(fn: Callable) -> None:
    """Unregister ``fn`` everywhere (tests)."""
    for fns in _AFTER.values():
        if fn in fns:
            fns.remove(fn)
