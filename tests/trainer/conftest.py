import pytest

from cppo_megatron.trainer.config import load_recipe
from tests.recipes import MICRO

__all__ = ["MICRO", "micro_recipe"]



@pytest.fixture
def micro_recipe(tmp_path):
    def make(*overrides):
        return load_recipe(None, MICRO + [f"out_dir={tmp_path / 'run'}", *overrides])

    return make
