"""Diagnostics are installed only when asked for: a fresh veRL process (the plugin loaded by
``import verl``, as in every Ray worker) gets the estimator, the hook and the features' seams;
the audit, the key trace and the wall clock only under their variables."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cppo_megatron.integrations.verl import diagnostics, observers

PROBE = """
import json, sys
import verl  # loads the plugin through veRL's entry point
from omegaconf import DictConfig
from cppo_megatron.integrations import importhook, wrap
from cppo_megatron.integrations.verl import observers
print(json.dumps({
    "callbacks": sorted({fn.__module__.rsplit(".", 1)[1] + "." + fn.__qualname__
                         for fns in importhook._AFTER.values() for fn in fns}),
    "diagnostics": sorted(m.rsplit(".", 1)[1] for m in sys.modules
                          if m.startswith("cppo_megatron.integrations.verl.diagnostics.")),
    "observers": observers.HUB.subscribed(),
    "keytrace_on_omegaconf": wrap.is_wrapped(DictConfig.__dict__["__getattr__"],
                                             "cppo_megatron.integrations.verl.diagnostics.keytrace"),
}))
"""
# what a CPPO run needs, in every veRL process (VERL_PLATFORM unset: no CPU mode)
GPU_PATH = ["async_modes._patch", "early_stop._patch_agent_loop", "early_stop._patch_trainer", "hook._patch_module",
            "selective._patch", "signal._patch"]
AUDIT = "cppo_megatron.integrations.verl.diagnostics.audit"


def probe(tmp_path, **switches: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in diagnostics.SWITCHES and k != "VERL_PLATFORM"
           and not k.startswith("VERL_USE_EXTERNAL")}
    env.update({k: str(tmp_path / v) for k, v in switches.items()})
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.verl
def test_a_default_process_imports_and_installs_no_diagnostic(tmp_path):
    assert probe(tmp_path) == {"callbacks": GPU_PATH, "diagnostics": [], "observers": {"prune": [], "record": []},
                               "keytrace_on_omegaconf": False}


@pytest.mark.verl
def test_the_audit_switch_installs_the_audit_and_nothing_else(tmp_path):
    got = probe(tmp_path, CPPO_VERL_AUDIT="audit")
    assert got["diagnostics"] == ["audit", "audit_vllm"]
    # the recorders on veRL's passes and vLLM's sync, vLLM's counters for early stopping's records
    assert got["callbacks"] == sorted(GPU_PATH + ["audit._patch", "audit._record_placement", "audit_vllm._patch",
                                                  "early_stop._patch_server"])
    assert got["observers"] == {"prune": [f"{AUDIT}.prune_record"], "record": [f"{AUDIT}.record"]}
    assert got["keytrace_on_omegaconf"] is False


@pytest.mark.verl
def test_the_key_trace_and_clock_switches_install_those_two(tmp_path):
    got = probe(tmp_path, CPPO_VERL_KEYS="keys", CPPO_VERL_CLOCK="clock")
    assert got["diagnostics"] == ["clock", "keytrace"]
    assert got["keytrace_on_omegaconf"] is True  # omegaconf's readers carry the trace
    assert got["callbacks"] == sorted(GPU_PATH + ["clock._patch", "clock._patch_v1", "keytrace._wrap_base_config",
                                                  "keytrace._wrap_converters", "keytrace._wrap_instantiate"])
    assert got["observers"] == {"prune": [], "record": []}


def test_requested_names_the_switches_set_in_order(monkeypatch):
    for env in diagnostics.SWITCHES:
        monkeypatch.delenv(env, raising=False)
    assert diagnostics.requested() == []
    monkeypatch.setenv(diagnostics.CLOCK_ENV, "/x")
    monkeypatch.setenv(diagnostics.AUDIT_ENV, "")  # empty: off, as each module reads it
    assert diagnostics.requested() == [diagnostics.CLOCK_ENV]
    monkeypatch.setenv(diagnostics.AUDIT_ENV, "/y")
    assert diagnostics.requested() == [diagnostics.AUDIT_ENV, diagnostics.CLOCK_ENV]


def test_observers_hand_on_in_order_and_refuse_what_is_not_callable():
    seen: list = []

    def first(d):
        seen.append(("first", d))

    def second(d):
        seen.append(("second", d))

    def sink(kind, role="trainer", **fields):
        seen.append((kind, role, fields))

    assert not observers.HUB.recording()
    observers.HUB.record("selective", step=1)  # nobody listens: nothing happens
    observers.HUB.on_prune(first)
    observers.HUB.on_prune(second)
    observers.HUB.on_prune(first)  # idempotent
    observers.HUB.on_record(sink)
    observers.HUB.on_record(sink)  # idempotent
    try:
        here = f"{__name__}.test_observers_hand_on_in_order_and_refuse_what_is_not_callable.<locals>"
        assert observers.HUB.subscribed() == {"prune": [f"{here}.first", f"{here}.second"], "record": [f"{here}.sink"]}
        assert observers.HUB.recording()
        observers.HUB.prune_decided("decision")  # type: ignore[arg-type]
        observers.HUB.record("early_stop", role="agent_loop", step=2)
        assert seen == [("first", "decision"), ("second", "decision"), ("early_stop", "agent_loop", {"step": 2})]
        with pytest.raises(TypeError, match="observers.on_prune: 3 is not callable"):
            observers.HUB.on_prune(3)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="observers.on_record: None is not callable"):
            observers.HUB.on_record(None)  # type: ignore[arg-type]
    finally:
        for fn in (first, second, sink):
            observers.HUB.remove(fn)
    observers.HUB.remove(sink)  # not subscribed: nothing
    assert observers.HUB.subscribed() == {"prune": [], "record": []} and not observers.HUB.recording()
