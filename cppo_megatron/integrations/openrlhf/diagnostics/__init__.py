"""Verification instrumentation for OpenRLHF runs: installed only when asked for, never by default.

A CPPO run needs none of this; it is imported only when its switch is set in the process's
environment (``cppo-megatron openrlhf`` passes it to every Ray process through the job's runtime
environment and installs it there with the worker setup hook; a run started from the patched
OpenRLHF source installs it where the hook is installed):

- ``CPPO_OPENRLHF_AUDIT=DIR`` (``audit.py``): what each OpenRLHF pass saw, as JSON lines, so a run
  can be checked against the core (the e2e tests' and the CPU mode's checks).
"""

from __future__ import annotations

from ... import diagnostics as switched

__all__ = ["AUDIT_ENV", "SWITCHES", "install", "requested"]

AUDIT_ENV = "CPPO_OPENRLHF_AUDIT"
# switch -> the modules whose ``install()`` it turns on, in installation order
SWITCHES: dict[str, tuple[str, ...]] = {
    AUDIT_ENV: ("audit",),
}


def requested() -> list[str]:
    """The switches set (non-empty) in this process's environment, in ``SWITCHES`` order."""
    return switched.requested(SWITCHES)


def install() -> list[str]:
    """Install the diagnostics whose switch is set (idempotent); returns the modules installed,
    e.g. ``["audit"]`` under ``CPPO_OPENRLHF_AUDIT``, ``[]`` with no switch set."""
    return switched.install(__name__, SWITCHES)
