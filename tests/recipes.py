"""The recipe overrides every trainer test shares, in one place, and paths that do not
depend on the directory pytest runs from."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"


def recipe_path(name: str) -> str:
    """``recipes/<name>`` (``.yaml`` added when missing), absolute."""
    return str(RECIPES / (name if name.endswith(".yaml") else f"{name}.yaml"))


# a micro model and task: a 2-step run takes seconds on one CPU thread
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

# backend=megatron layouts on 4 gloo processes (the micro model has 2 KV heads, 2 layers)
LAYOUTS = {
    "tp2-dp2": ["backend=megatron", "megatron.tp=2", "megatron.pp=1"],
    "pp2-dp2": ["backend=megatron", "megatron.tp=1", "megatron.pp=2"],
}
