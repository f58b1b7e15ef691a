"""Fixtures both hosts' tests use (``openrlhf/``, ``verl/``), each host's part named by a fixture
of its own conftest.

pytest loads this file for every test under ``tests/integrations``, in each environment
scripts/test.sh runs there (.venv, .venv-vllm, .venv-bridge, .venv-verl-vllm): it imports nothing
but pytest at module level, and nothing of a host until a test asks for a fixture.
"""

from __future__ import annotations

import pytest


@pytest.fixture
def audit_on(host_audit, monkeypatch):
    """Audit mode in this process, as the host's own start-up installs it: the host's variable
    (``CPPO_VERL_AUDIT``, ``CPPO_OPENRLHF_AUDIT``) set to the directory given and the host's audit
    subscribed to its GPU path's observers (unsubscribed after the test). Returns ``on(directory)``.

    ``host_audit`` (the host folder's conftest) gives ``(observers, audit)``: the host's observer
    module and its ``diagnostics.audit``; each host keeps its own hub, so one host's audit never
    hears the other's decisions."""
    observers, audit = host_audit

    def on(directory) -> None:
        monkeypatch.setenv(audit.ENV, str(directory))
        audit.observe()

    yield on
    observers.HUB.remove(audit.prune_record)
    observers.HUB.remove(audit.record)
