"""Install a host's verification instrumentation by environment switch, never by default.

Each host keeps its diagnostics in ``integrations/<host>/diagnostics/`` and names there which
variable turns on which of its modules (``SWITCHES``: variable -> module names, in installation
order). A module named there has ``install() -> bool`` (whether it installed anything). Nothing
is imported until its switch is set. Imports nothing of ours.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping

__all__ = ["install", "requested"]


def requested(switches: Mapping[str, tuple[str, ...]]) -> list[str]:
    """The variables of ``switches`` set (non-empty) in this process's environment, in their order."""
    return [env for env in switches if os.environ.get(env)]


def install(package: str, switches: Mapping[str, tuple[str, ...]]) -> list[str]:
    """Import and install the modules of ``package`` whose switch is set (idempotent as their
    ``install()`` is); returns the names of those that installed, ``[]`` with no switch set."""
    installed = []
    for env in requested(switches):
        for name in switches[env]:
            module = importlib.import_module(f"{package}.{name}")
            if module.install():
                installed.append(name)
    return installed
