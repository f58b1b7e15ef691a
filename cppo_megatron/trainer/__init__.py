"""The embedded single-machine GRPO/CPPO trainer (``cppo-megatron train RECIPE.yaml``)."""

from .config import Recipe, load_recipe, validate_recipe
from .loop import Trainer

__all__ = ["Recipe", "Trainer", "load_recipe", "validate_recipe"]
