"""The public home of the CPPO configuration: ``from cppo_megatron.config import CPPOConfig``.

``CPPOConfig`` — the one CPPO settings object, every field documented in its metadata — is
defined in the core (``cppo_megatron.core.settings``), next to the functions that take it,
so that the core depends on nothing above it. Everything outside the core imports it (and
its choice lists, field helpers and the keep-count rule) from here; this module re-exports
``core.settings`` whole and adds the one name only the hosts need: the estimator name veRL
selects CPPO by. (``cppo_megatron.CPPOConfig`` is the same class; the embedded trainer's
recipe schema, which holds a ``CPPOConfig`` as its ``cppo`` section, is
``cppo_megatron.trainer.config``.)::

    cfg = CPPOConfig(pruning_rate=0.875)
    cfg = CPPOConfig.from_dict({"keep_per_group": 2, "scope": "batch"})
    schema = OmegaConf.structured(CPPOConfig)          # type-checked YAML / dotlist merges
    cfg = CPPOConfig.from_omegaconf(OmegaConf.merge(schema, user_yaml))
"""

from __future__ import annotations

from .core import settings as _settings
from .core.settings import *  # noqa: F403 - a plain re-export: the names and __all__ of core.settings

__all__ = [*_settings.__all__, "ESTIMATOR_NAME"]

# the algorithm.adv_estimator value that selects CPPO in veRL
ESTIMATOR_NAME = "cppo"
