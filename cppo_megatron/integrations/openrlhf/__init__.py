"""CPPO for OpenRLHF 0.11.2 (Ray PPO/GRPO pipeline; DeepSpeed, no Megatron backend).

- ``hook``: prunes rollout samples at the start of ``RemoteExperienceMaker.make_experience_batch``
  and makes OpenRLHF's advantage step use the full-group statistics recorded before pruning.
- ``train``: ``python -m cppo_megatron.integrations.openrlhf.train`` runs ``train_ppo_ray`` with the hook.
- ``recipe``: YAML recipes (``recipes/openrlhf``) -> launcher arguments (``cppo-megatron openrlhf``).
- ``patching``: the same hook as a source patch (``cppo-megatron patch openrlhf``).
- ``pinned``: the pinned version, the drift guard over the hooked source, OpenRLHF's parser
  (the launcher checks every flag against it; ``cppo-megatron patch openrlhf`` reports drift).

Layout: the GPU path at the top (``hook``, ``train``, ``worker``, ``preflight``, ``recipe``,
``reward``, ``metrics``, ``checkpoint``, ``patching``, ``pinned``, ``observers``) with its features
beside it (``filtering``: DAPO's filter; ``selective``: GRESO); ``diagnostics/`` for verification
(the audit, imported only under ``CPPO_OPENRLHF_AUDIT``); ``cpu/`` for the CPU mode.

Nothing here imports OpenRLHF until a function needs it. docs/integrations/openrlhf.md.
"""

from .pinned import PINNED_VERSION

__all__ = ["PINNED_VERSION"]
