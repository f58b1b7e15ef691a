"""Wrap a host function once, keep its original, restore it on uninstall.

Every seam, hook and recorder of both adapters replaces some host attribute (a veRL method, a
megatron-core function, ``torch.cuda.synchronize``, ...) with a function of ours. This module is
the one place that does it:

- ``wrap(owner, name, make, tag=...)`` replaces ``owner.name`` by ``make(current)`` and marks the
  replacement with the attribute it replaced (``ORIGINAL``) and who installed it (``TAG``). A
  second call with the same tag finds its mark on the chain and changes nothing (imports re-run,
  plugins load twice); different tags stack.
- ``unwrap(owner, name, tag)`` takes exactly that layer out again, wherever it sits on the chain
  (the layers above are rebuilt over what it wrapped).
- ``original(obj)`` follows the marks down to what the host wrote: the drift guard hashes that,
  not our wrapper.
- ``wrapped(owner, name, make, tag=...)``: the same for the duration of a ``with`` block.
- ``replace(owner, name, obj, tag=...)``: ``wrap`` with a stand-in that does not call what it
  replaces (``torch.cuda.synchronize`` by a no-op); the replaced attribute is kept and marked
  all the same.

Imports nothing of ours.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["ORIGINAL", "TAG", "is_wrapped", "layer", "original", "replace", "unwrap", "wrap", "wrap_methods",
           "wrapped"]

ORIGINAL = "__cppo_original__"  # on a wrapper: the attribute it replaced
TAG = "__cppo_tag__"  # on a wrapper: the seam that installed it
_MAKE = "__cppo_make__"  # on a wrapper: how it was made (to rebuild it when a layer below goes)
_INHERITED = "__cppo_inherited__"  # on a wrapper: the class it was set on had only inherited the name


def _marks(obj: Any) -> dict[str, Any]:
    # the marks in the object's own __dict__ (not getattr: a class would inherit its base's);
    # a slot wrapper (object.__getattribute__) or a builtin has no __dict__, so no marks
    return getattr(obj, "__dict__", None) or {}


def _chain(obj: Any):
    while obj is not None:
        yield obj
        obj = _marks(obj).get(ORIGINAL) if TAG in _marks(obj) else None


def layer(obj: Any, tag: str) -> Any:
    """The wrapper installed by ``tag`` on ``obj``'s chain, or None."""
    for item in _chain(obj):
        if _marks(item).get(TAG) == tag:
            return item
    return None


def is_wrapped(obj: Any, tag: str | None = None) -> bool:
    """``obj`` is one of our wrappers (installed by ``tag``, or by anyone when ``tag`` is None),
    or stands on top of one."""
    if tag is None:
        return TAG in _marks(obj)
    return layer(obj, tag) is not None


def original(obj: Any) -> Any:
    """What the host wrote under all our wrappers (``obj`` itself when it is not ours)."""
    return list(_chain(obj))[-1] if obj is not None else obj


def _current(owner: Any, name: str) -> Any:
    # a class's own entry as stored (a staticmethod stays one), else what attribute lookup finds
    if isinstance(owner, type) and name in owner.__dict__:
        return owner.__dict__[name]
    return getattr(owner, name)


def _check(owner: Any, name: str, tag: str) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"wrap: attribute name must be a non-empty string, got {name!r}")
    if not isinstance(tag, str) or not tag:
        raise ValueError(f"wrap: tag must name the seam (a non-empty string), got {tag!r}")
    if not hasattr(owner, name):
        raise AttributeError(f"wrap[{tag}]: {owner!r} has no attribute {name!r} to wrap: has the host moved? "
                             "(cppo-megatron verl --check / the drift tests name what changed)")


def wrap(owner: Any, name: str, make: Callable[[Any], Any], *, tag: str) -> bool:
    """Replace ``owner.name`` by ``make(current)``, marked with ``ORIGINAL`` and ``TAG``.

    Returns True when installed now, False when ``tag`` is already on the attribute's chain (a
    double install changes nothing). ``make`` gets the attribute as it is now (possibly another
    seam's wrapper) and must return an object that takes attributes (a function or a class)."""
    _check(owner, name, tag)
    current = _current(owner, name)
    if is_wrapped(current, tag):
        return False
    replacement = make(current)
    if any(replacement is item for item in _chain(current)):
        raise ValueError(f"wrap[{tag}]: make() must return a new object for {name!r}, not the one it wraps")
    setattr(replacement, ORIGINAL, current)
    setattr(replacement, TAG, tag)
    setattr(replacement, _MAKE, make)
    # a class that only inherited the attribute gets it back by deletion on unwrap
    setattr(replacement, _INHERITED, isinstance(owner, type) and name not in owner.__dict__)
    setattr(owner, name, replacement)
    return True


def wrap_methods(module: Any, target: tuple[str, str], makers: dict[str, Callable[[Any], Any]], *, tag: str,
                 changed: str, who: str = "cppo") -> None:
    """``wrap`` each method ``makers`` names on the class ``target[1]`` of the host's imported ``module``
    (``target[0]``, its dotted name) with its maker. A class or method no longer there, defined on the
    class itself, is a RuntimeError naming it and ``changed`` (which host version the seam was pinned
    at), before anything is wrapped past it; ``who`` begins the message (``"cppo audit"``: which
    part of ours relied on it)."""
    if not makers:
        raise ValueError(f"wrap_methods[{tag}]: no methods to wrap on {target[0]}.{target[1]}; name at least one")
    cls = getattr(module, target[1], None)
    for name, make in makers.items():
        if cls is None or name not in cls.__dict__:
            raise RuntimeError(f"{who}: {target[0]}.{target[1]}.{name} is gone; {changed}")
        wrap(cls, name, make, tag=tag)


def replace(owner: Any, name: str, obj: Any, *, tag: str) -> bool:
    """``wrap`` with ``obj`` itself as the layer (``obj`` carries the marks: one owner per object)."""
    return wrap(owner, name, lambda _current: obj, tag=tag)


def unwrap(owner: Any, name: str, *, tag: str) -> bool:
    """Take the layer ``tag`` installed on ``owner.name`` out of the chain; False when it is not
    there. Layers above it are rebuilt over what it wrapped (their ``make`` runs again), since a
    wrapper holds the function it wraps in its closure."""
    _check(owner, name, tag)
    above: list[Any] = []
    for item in _chain(_current(owner, name)):
        if _marks(item).get(TAG) != tag:
            above.append(item)
            continue
        if item.__dict__.get(_INHERITED):
            delattr(owner, name)
        else:
            setattr(owner, name, item.__dict__[ORIGINAL])
        for layer_ in reversed(above):
            wrap(owner, name, layer_.__dict__[_MAKE], tag=layer_.__dict__[TAG])
        return True
    return False


@contextlib.contextmanager
def wrapped(owner: Any, name: str, make: Callable[[Any], Any], *, tag: str) -> Iterator[bool]:
    """``wrap`` inside the block, ``unwrap`` when it exits (also on an exception). Yields whether
    this block installed the layer: inside an outer block with the same tag it is already there,
    and only the outer one takes it out."""
    installed = wrap(owner, name, make, tag=tag)
    try:
        yield installed
    finally:
        if installed:
            unwrap(owner, name, tag=tag)
