"""cppo-megatron: completion pruning (CPPO) for GRPO training pipelines.

The core (``cppo_megatron.core``) needs only torch and numpy; framework adapters live in
``integrations/``, ``megatron/``, ``rollout/`` and import their frameworks lazily.
"""

__version__ = "0.1.0"

from .config import CPPOConfig  # noqa: E402

__all__ = ["CPPOConfig", "__version__"]
