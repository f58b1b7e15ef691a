"""The recipe-level CPPO configuration.

``CPPOConfig`` — the one CPPO settings object, every field documented in its metadata —
is defined in the core (``cppo_megatron.core.settings``), next to the functions that take
it, so that the core depends on nothing above it. This module re-exports it with its
choice lists and field helpers (``from cppo_megatron.config import CPPOConfig`` keeps
working) and adds what only the hosts need: the name veRL selects the estimator by, and
the list of field names the integrations validate against::

    cfg = CPPOConfig(pruning_rate=0.875)
    cfg = CPPOConfig.from_dict({"keep_per_group": 2, "scope": "batch"})
    schema = OmegaConf.structured(CPPOConfig)          # type-checked YAML / dotlist merges
    cfg = CPPOConfig.from_omegaconf(OmegaConf.merge(schema, user_yaml))
"""

from __future__ import annotations

from .core.settings import (
    ADV_NORMS,
    CHECKS,
    DEFAULT_PRUNING_RATE,
    FIELD_NAMES,
    KEEP_MASS_METRICS,
    MAGNITUDE_METRICS,
    METRICS,
    SCOPES,
    SELECTIVE_PARAMETERS,
    CPPOConfig,
    document_fields,
    field_help,
    setting,
)

__all__ = [
    "ADV_NORMS",
    "CHECKS",
    "CPPOConfig",
    "DEFAULT_PRUNING_RATE",
    "ESTIMATOR_NAME",
    "FIELD_NAMES",
    "KEEP_MASS_METRICS",
    "MAGNITUDE_METRICS",
    "METRICS",
    "SCOPES",
    "SELECTIVE_PARAMETERS",
    "document_fields",
    "field_help",
    "setting",
]

# the algorithm.adv_estimator value that selects CPPO in veRL
ESTIMATOR_NAME = "cppo"
