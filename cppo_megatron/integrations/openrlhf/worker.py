"""The one Ray ``worker_process_setup_hook`` of an OpenRLHF run started by our launcher.

Each part is a no-op unless its environment variable is set: the CPU mode
(``CPPO_OPENRLHF_CPU``), the diagnostics (``CPPO_OPENRLHF_AUDIT``: ``diagnostics/``, imported only
then), the JSONL metrics (``CPPO_OPENRLHF_METRICS``) and the CPPO hook (``CPPO_OPENRLHF_CONFIG``).
"""

from __future__ import annotations

__all__ = ["HOOK", "setup"]

HOOK = "cppo_megatron.integrations.openrlhf.worker.setup"


def setup() -> None:
    from . import cpu, diagnostics, hook, metrics

    cpu.install()
    diagnostics.install()  # what CPPO_OPENRLHF_AUDIT asks for; nothing is imported without it
    metrics.install()
    hook.setup_ray_worker()
