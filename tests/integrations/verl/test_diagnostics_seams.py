"""The veRL diagnostics install their recorders through ``integrations/wrap.wrap_methods``: over
stand-ins of veRL's modules, each wraps every method it names once, leaves other modules alone,
and refuses a veRL whose method moved with its own words (``cppo audit`` / ``cppo clock``)."""

from __future__ import annotations

import types

import pytest

from cppo_megatron.integrations import wrap
from cppo_megatron.integrations.verl.diagnostics import CHANGED, audit, audit_vllm, clock

GONE = r"is gone; veRL changed \(pinned 0\.9\.1\)$"


def stand_in(target: tuple[str, str], methods) -> types.ModuleType:
    """A module named ``target[0]`` holding a class ``target[1]`` that defines ``methods``."""
    module = types.ModuleType(target[0])
    body = {name: (lambda self, *a, **k: None) for name in methods}
    setattr(module, target[1], type(target[1], (), body))
    return module


def wrapped_once(cls, methods, tag) -> bool:
    return all(wrap.is_wrapped(cls.__dict__[m], tag) and not wrap.is_wrapped(getattr(cls.__dict__[m], wrap.ORIGINAL))
               for m in methods)


AUDIT_VLLM = {audit_vllm.ADAPTER: ["update_weights"],
              audit_vllm.EXTENSION: ["_update_weights", "update_weights_from_ipc"]}
CLOCK = {clock.LEGACY: (clock._patch, ["_get_gen_batch"]), clock.V1: (clock._patch_v1, ["on_step_begin"])}


def test_the_words_end_as_every_verl_seam_refusal_does():
    assert CHANGED == "veRL changed (pinned 0.9.1)"


@pytest.mark.parametrize("target", list(audit._WRAPPERS), ids=lambda t: t[1])
def test_the_audit_wraps_each_recorded_method_once(target):
    methods = list(audit._WRAPPERS[target])
    module = stand_in(target, methods)
    audit._patch(module)
    audit._patch(module)  # a re-import: nothing more
    assert wrapped_once(getattr(module, target[1]), methods, audit.WRAP_TAG)


@pytest.mark.parametrize("target", list(audit._WRAPPERS), ids=lambda t: t[1])
def test_the_audit_names_a_method_veRL_moved(target):
    methods = list(audit._WRAPPERS[target])
    module = stand_in(target, methods[1:])  # the first one gone
    with pytest.raises(RuntimeError, match=rf"^cppo audit: {target[0]}\.{target[1]}\.{methods[0]} {GONE}"):
        audit._patch(module)


def test_the_audit_leaves_other_modules_alone():
    module = stand_in(("verl.somewhere_else", "PPOTrainer"), ["_update_actor"])
    audit._patch(module)
    assert not wrap.is_wrapped(module.PPOTrainer.__dict__["_update_actor"])


@pytest.mark.parametrize("target", list(AUDIT_VLLM), ids=lambda t: t[1])
def test_the_vllm_audit_wraps_the_sync_or_names_what_moved(target):
    methods = AUDIT_VLLM[target]
    module = stand_in(target, methods)
    audit_vllm._patch(module)
    audit_vllm._patch(module)
    assert wrapped_once(getattr(module, target[1]), methods, audit_vllm.WRAP_TAG)
    with pytest.raises(RuntimeError, match=rf"^cppo audit: {target[0]}\.{target[1]}\.{methods[-1]} {GONE}"):
        audit_vllm._patch(stand_in(target, methods[:-1]))
    with pytest.raises(RuntimeError, match=rf"^cppo audit: {target[0]}\.{target[1]}\.{methods[0]} {GONE}"):
        audit_vllm._patch(types.ModuleType(target[0]))  # the class itself gone


@pytest.mark.parametrize("target", list(CLOCK), ids=lambda t: t[1])
def test_the_clock_wraps_the_step_start_or_names_what_moved(target):
    patch, methods = CLOCK[target]
    module = stand_in(target, methods)
    patch(module)
    patch(module)
    assert wrapped_once(getattr(module, target[1]), methods, clock.WRAP_TAG)
    with pytest.raises(RuntimeError, match=rf"^cppo clock: {target[0]}\.{target[1]}\.{methods[0]} {GONE}"):
        patch(stand_in(target, []))
