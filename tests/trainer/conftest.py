import pytest

from cppo_megatron.trainer.config import load_recipe

MICRO = [
    "threads=1",
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.num_heads=2",
    "model.num_kv_heads=2",
    "model.intermediate_size=64",
    "model.max_position=32",
    "task.train_size=400",
    "task.test_size=50",
    "rollout.group_size=4",
    "rollout.max_new_tokens=4",
    "train.capacity=16",
    "train.steps=2",
    "eval.every=0",
    "eval.num_problems=20",
    "warmup.enabled=false",
    "log.progress=false",
    "log.tensorboard=false",
    "log.plots=false",
    "log.checkpoint_every=0",
    "cppo.pruning_rate=0.5",
]


@pytest.fixture
def micro_recipe(tmp_path):
    def make(*overrides):
        return load_recipe(None, MICRO + [f"out_dir={tmp_path / 'run'}", *overrides])

    return make
