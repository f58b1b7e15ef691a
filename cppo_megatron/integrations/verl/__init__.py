"""CPPO as a veRL 0.9.1 plugin.

Importing this module (veRL does it for every process through the ``verl.plugins`` entry
point, or through ``VERL_USE_EXTERNAL_MODULES=cppo_megatron.integrations.verl``):

- registers the advantage estimator ``cppo`` (``algorithm.adv_estimator=cppo``), which uses
  the full-group statistics recorded at pruning time;
- hooks ``_balance_batch`` of the V1 ``PPOTrainer`` and the legacy ``RayPPOTrainer`` as
  their modules are imported; the hook acts only when the estimator is ``cppo``;
- logs ``signal/*`` (groups with equal rewards, completion lengths, tokens generated, generation's
  share of the step) in every run (``signal.py``);
- with ``cppo.selective.enabled=true``, hooks V1's ``_fetch_one_gen_batch``, ``_save_checkpoint``
  and ``_load_checkpoint`` (``selective.py``: skip prompts before generation);
- registers the ``cppo_early_stop`` agent loop and, with ``cppo.early_stop.enabled=true``, keeps the
  predictor in V1's checkpoints (``early_stop.py``, ``early_stop_loop.py``: stop completions inside
  the rollout);
- nothing else: the verification instrumentation (``diagnostics/``: audit, key trace, wall clock)
  is installed only in a process whose environment asks for it (``CPPO_VERL_AUDIT``,
  ``CPPO_VERL_KEYS``, ``CPPO_VERL_CLOCK``).

Layout: the GPU path at the top (``hook``, ``estimator``, ``stats``, ``runconfig``, ``layout``,
``preflight``, ``main``, ``observers``, ...) with its features beside it (``selective``, ``dapo``,
``early_stop*``); ``diagnostics/`` for verification; ``cpu/`` for the CPU mode.

Run: ``python -m cppo_megatron.integrations.verl.main [veRL overrides] cppo.pruning_rate=0.875``.
See docs/integrations/verl.md.
"""

from __future__ import annotations

from .estimator import ESTIMATOR_NAME, compute_cppo_outcome_advantage, register_estimator
from .hook import install, is_installed
from .runconfig import AllocationPlan, apply_allocation, cppo_config_from, is_cppo, prepare

SUPPORTED_VERL = "0.9.1"

__all__ = [
    "ESTIMATOR_NAME",
    "SUPPORTED_VERL",
    "AllocationPlan",
    "apply_allocation",
    "compute_cppo_outcome_advantage",
    "cppo_config_from",
    "install",
    "is_cppo",
    "is_installed",
    "load",
    "prepare",
    "register_estimator",
]


def load() -> list[str]:
    """Install what a CPPO run needs (idempotent): the estimator, the pruning hook, ``signal/*``,
    the ``separate_async`` fix, selective rollout's and early stopping's seams, and, with
    ``VERL_PLATFORM=cpu``, the CPU mode. Diagnostics (audit, key trace, wall clock:
    ``diagnostics/``) are imported and installed only when their variable is set
    (``CPPO_VERL_AUDIT``, ``CPPO_VERL_KEYS``, ``CPPO_VERL_CLOCK``). Returns the diagnostics
    installed (``[]`` by default)."""
    from . import async_modes, cpu, diagnostics, early_stop, selective, signal

    register_estimator()
    install()
    signal.install()  # signal/gen_share in veRL's timing metrics (signal/* at the hook's seam)
    async_modes.install()  # separate_async: veRL's mini-batch assert in CPPO's units
    selective.install()  # cppo.selective.enabled: V1's dataloader fetch and checkpoints
    early_stop.install()  # cppo.early_stop: the agent loop's registry entry, V1's checkpoints
    cpu.enable()
    return diagnostics.install() if diagnostics.requested() else []


load()
