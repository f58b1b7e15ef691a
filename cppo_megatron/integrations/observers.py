"""Who watches a host's GPU path: one hub per host hands the pruning seam's decision and the
features' named records to whatever diagnostics subscribed (none unless asked for).

The GPU path never imports a diagnostic. It decides (the host's hook, through the core), hands
the decision to its own observers (metrics, selective rollout's history, ...) and then to the
ones subscribed to its host's ``Observers`` (``verl/observers.py``'s and ``openrlhf/observers.py``'s
``HUB``):

- ``on_prune(fn)``: ``fn(decision)`` once per step with the seam's decision (each host defines
  its own: ``verl/observers.py``, ``openrlhf/observers.py``). It must not change which rows are
  kept.
- ``on_record(fn)``: ``fn(kind, role=..., **fields)`` for every named record a feature emits;
  ``recording()`` says whether anyone listens, so a feature skips the work of building a record
  nobody reads.

One hub per host, not one for the package: a process (a test session) may load both adapters,
and one host's audit must not receive the other's decisions. Imports nothing of ours.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

__all__ = ["Observers"]

D = TypeVar("D")


class Observers(Generic[D]):
    """The subscribers of one host's seam (decisions of type ``D``) and of its named records."""

    def __init__(self) -> None:
        self._prune: list[Callable[[D], None]] = []
        self._record: list[Callable[..., None]] = []

    def on_prune(self, fn: Callable[[D], None]) -> None:
        """Subscribe ``fn`` to the seam's decision (idempotent)."""
        if not callable(fn):
            raise TypeError(f"observers.on_prune: {fn!r} is not callable; pass a function of one PruneDecision")
        if fn not in self._prune:
            self._prune.append(fn)

    def on_record(self, fn: Callable[..., None]) -> None:
        """Subscribe ``fn(kind, role=..., **fields)`` to the features' named records (idempotent)."""
        if not callable(fn):
            raise TypeError(f"observers.on_record: {fn!r} is not callable; pass a function (kind, role=..., "
                            "**fields)")
        if fn not in self._record:
            self._record.append(fn)

    def remove(self, fn: Callable[..., None]) -> None:
        """Unsubscribe ``fn`` from both (tests); nothing when it was not subscribed."""
        for subscribers in (self._prune, self._record):
            if fn in subscribers:
                subscribers.remove(fn)

    def subscribed(self) -> dict[str, list[str]]:
        """Who listens, by qualified name: ``{"prune": [...], "record": [...]}`` (what a test checks)."""
        def name(fn: Callable[..., Any]) -> str:
            return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"

        return {"prune": [name(f) for f in self._prune], "record": [name(f) for f in self._record]}

    def prune_decided(self, decision: D) -> None:
        """Hand the seam's decision to every subscriber, in subscription order."""
        for fn in list(self._prune):
            fn(decision)

    def recording(self) -> bool:
        """Whether anyone listens to named records (build a record only then)."""
        return bool(self._record)

    def record(self, kind: str, role: str = "trainer", **fields: Any) -> None:
        """Hand one named record to every subscriber (nothing when none listens)."""
        for fn in list(self._record):
            fn(kind, role=role, **fields)
