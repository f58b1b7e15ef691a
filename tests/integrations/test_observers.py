"""integrations/observers.py and integrations/diagnostics.py: the hub each host hands its seam's
decision to, and the switch that installs a host's diagnostics; both host-neutral."""

from __future__ import annotations

import sys
import types

import pytest

from cppo_megatron.integrations import diagnostics
from cppo_megatron.integrations.observers import Observers


def test_each_host_has_its_own_hub():
    from cppo_megatron.integrations.openrlhf import observers as orl
    from cppo_megatron.integrations.verl import observers as verl

    seen: list = []
    orl.HUB.on_prune(seen.append)
    try:
        verl.HUB.prune_decided("verl's decision")  # type: ignore[arg-type]
        orl.HUB.prune_decided("openrlhf's decision")  # type: ignore[arg-type]
        assert seen == ["openrlhf's decision"] and verl.HUB.subscribed()["prune"] == []
    finally:
        orl.HUB.remove(seen.append)


def test_a_hub_hands_on_in_order_once_per_subscriber():
    hub: Observers[int] = Observers()
    seen: list = []

    def decided(d):
        seen.append(d)

    def sink(kind, role="trainer", **fields):
        seen.append((kind, role, fields))

    hub.on_prune(decided)
    hub.on_prune(decided)  # idempotent
    assert not hub.recording()
    hub.record("filter", role="generator", n=1)  # nobody listens: nothing
    hub.on_record(sink)
    hub.prune_decided(7)
    hub.record("filter", role="generator", n=1)
    assert seen == [7, ("filter", "generator", {"n": 1})] and hub.recording()
    with pytest.raises(TypeError, match="observers.on_prune: 'x' is not callable; pass a function of one "):
        hub.on_prune("x")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"observers.on_record: 2 is not callable; pass a function \(kind, "):
        hub.on_record(2)  # type: ignore[arg-type]
    hub.remove(sink)
    hub.remove(sink)  # not subscribed: nothing
    here = f"{__name__}.test_a_hub_hands_on_in_order_once_per_subscriber.<locals>"
    assert hub.subscribed() == {"prune": [f"{here}.decided"], "record": []} and not hub.recording()


def test_the_switch_imports_and_installs_only_what_is_set(monkeypatch):
    installed: list[str] = []
    package = types.ModuleType("hostdiag")
    package.__path__ = []  # type: ignore[attr-defined]
    for name, says in (("a", True), ("b", False), ("c", True)):
        module = types.ModuleType(f"hostdiag.{name}")
        module.install = lambda name=name, says=says: installed.append(name) or says  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, f"hostdiag.{name}", module)
    monkeypatch.setitem(sys.modules, "hostdiag", package)
    switches = {"HOSTDIAG_ONE": ("a", "b"), "HOSTDIAG_TWO": ("c",)}
    monkeypatch.delenv("HOSTDIAG_ONE", raising=False)
    monkeypatch.setenv("HOSTDIAG_TWO", "")  # empty: off
    assert diagnostics.requested(switches) == [] and diagnostics.install("hostdiag", switches) == []
    assert installed == []
    monkeypatch.setenv("HOSTDIAG_ONE", "/d")
    # b's install ran and said it installed nothing: not listed
    assert diagnostics.install("hostdiag", switches) == ["a"] and installed == ["a", "b"]
    monkeypatch.setenv("HOSTDIAG_TWO", "/e")
    assert diagnostics.requested(switches) == ["HOSTDIAG_ONE", "HOSTDIAG_TWO"]
    assert diagnostics.install("hostdiag", switches) == ["a", "c"]
