"""Verification instrumentation for veRL runs: installed only when asked for, never by default.

A CPPO run needs none of this; the plugin's ``load()`` imports these modules only when one of
their switches is set in the process's environment (``cppo-megatron verl`` exports them to every
Ray process; with veRL's own entry point export them yourself, e.g. through
``ray_kwargs.ray_init.runtime_env.env_vars``):

- ``CPPO_VERL_AUDIT=DIR`` (``audit.py``, ``audit_vllm.py``): what each veRL pass saw, as JSON
  lines, so a run can be checked against the core (the e2e tests' and the CPU mode's checks);
- ``CPPO_VERL_KEYS=DIR`` (``keytrace.py``; ``keyreport.py`` reads the trace): which config keys
  a run read, where, and with which value;
- ``CPPO_VERL_CLOCK=DIR`` (``clock.py``): a wall-clock budget and policy snapshots at fixed
  times, for ``cppo-megatron study``'s equal-time comparison.

``drift.py`` (hashes of the veRL functions the plugin relies on) installs nothing; it is what
``cppo-megatron verl --check`` runs.
"""

from __future__ import annotations

from ... import diagnostics as switched

__all__ = ["AUDIT_ENV", "CHANGED", "CLOCK_ENV", "KEYS_ENV", "SWITCHES", "install", "requested"]

AUDIT_ENV = "CPPO_VERL_AUDIT"
KEYS_ENV = "CPPO_VERL_KEYS"
CLOCK_ENV = "CPPO_VERL_CLOCK"
CHANGED = "veRL changed (pinned 0.9.1)"  # the end of a "<seam> is gone" refusal (integrations/wrap.wrap_methods)
# switch -> the modules whose ``install()`` it turns on, in installation order
SWITCHES: dict[str, tuple[str, ...]] = {
    AUDIT_ENV: ("audit", "audit_vllm"),
    KEYS_ENV: ("keytrace",),
    CLOCK_ENV: ("clock",),
}


def requested() -> list[str]:
    """The switches set (non-empty) in this process's environment, in ``SWITCHES`` order."""
    return switched.requested(SWITCHES)


def install() -> list[str]:
    """Install the diagnostics whose switch is set (idempotent); returns the modules installed,
    e.g. ``["audit", "audit_vllm"]`` under ``CPPO_VERL_AUDIT``, ``[]`` with no switch set."""
    return switched.install(__name__, SWITCHES)
