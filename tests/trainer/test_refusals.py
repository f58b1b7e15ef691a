"""The embedded trainer's refusals in this process, by message (the CLI tests run several of them in a
subprocess, which coverage does not measure; scripts/coverage_floor.py found the rest unreached):
recipe files and overrides that cannot load, rules across keys, phases, and exports of what cannot be
exported."""

from __future__ import annotations

import re

import pytest
import torch

from cppo_megatron.trainer.config import RecipeError, load_recipe, replace_recipe
from cppo_megatron.trainer.export import export_run, export_warmup
from cppo_megatron.trainer.step import PhaseTimer
from tests.recipes import recipe_path

TINY = recipe_path("tiny_cpu")


def test_recipe_files_that_cannot_be_read(tmp_path):
    with pytest.raises(RecipeError, match=f"^recipe {tmp_path} is a directory, not a YAML file; pass a recipe YAML"):
        load_recipe(tmp_path)
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  hidden_size: [1,\n")
    with pytest.raises(RecipeError, match=f"^recipe {bad} is not valid YAML \\(line \\d+, column \\d+: .*\\); fix"):
        load_recipe(bad)
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"model: \xff\xfe\n")
    with pytest.raises(RecipeError, match=f"^recipe {binary} is not a UTF-8 text file"):
        load_recipe(binary)
    listed = tmp_path / "list.yaml"
    listed.write_text("- a\n- b\n")
    with pytest.raises(RecipeError, match=f"^recipe {listed} must be a YAML mapping of keys \\(model:, task:, ...\\), "
                                          "got a ListConfig; see recipes/tiny_cpu.yaml$"):
        load_recipe(listed)


def test_overrides_that_cannot_load():
    with pytest.raises(RecipeError, match=re.escape("overrides must look like key=value, got ['train.steps']")):
        load_recipe(TINY, ["train.steps"])
    with pytest.raises(RecipeError, match=r"^an override is not valid YAML \(.*\): \['train.steps=\[1'\]$"):
        load_recipe(TINY, ["train.steps=[1"])
    with pytest.raises(RecipeError, match="^recipe error: Interpolation key 'nope' not found$"):
        load_recipe(TINY, ["train.steps=${nope}"])
    with pytest.raises(RecipeError, match="^recipe key '': Merge error: int is not a subclass of TrainConfig"):
        load_recipe(TINY, ["train=3"])  # a value where the schema has a section


@pytest.mark.parametrize("overrides,message", [
    (["cppo.allocation=false", "train.capacity=2", "rollout.group_size=4"],
     "train.capacity=2 is smaller than one group (rollout.group_size=4) without allocation"),
    (["model.source=hf_dir"], "model.source=hf_dir needs model.path"),
    (["model.num_heads=3"], "model: hidden_size must divide by num_heads and num_heads by num_kv_heads, got 128/3/4"),
])  # fmt: skip
def test_rules_across_keys(overrides, message):
    with pytest.raises(RecipeError, match=f"^{re.escape(message)}$"):
        load_recipe(TINY, overrides)


def test_replacing_an_unknown_key_is_refused():
    with pytest.raises(ValueError, match="^unknown recipe key 'train.stepz'$"):
        replace_recipe(load_recipe(TINY), **{"train.stepz": 3})


def test_a_phase_timer_knows_its_phases():
    entered = []
    timer = PhaseTimer(torch.device("cpu"), on_enter=entered.append)
    with timer.phase("rollout"):
        pass
    timer.add("update", 1.5)
    assert entered == ["rollout"] and timer.seconds["update"] == 1.5 and timer.seconds["rollout"] > 0
    with pytest.raises(ValueError, match="^unknown phase 'warmup'; phases are "):
        timer.add("warmup", 1.0)
    with pytest.raises(ValueError, match="^unknown phase 'warmup'; phases are "):
        with timer.phase("warmup"):
            pass


def test_exports_of_what_cannot_be_exported(tmp_path):
    shards = tmp_path / "run" / "checkpoints" / "step_000001"
    shards.mkdir(parents=True)
    for name in ("trainer.pt", "policy_rank00000.pt", "policy_rank00001.pt"):
        (shards / name).write_bytes(b"")
    with pytest.raises(ValueError, match="is a backend=megatron checkpoint \\(per-rank shards\\); export the run's "):
        export_run(shards, tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="is not a file \\(expected RUN_DIR/warmup.pt, final.pt or"):
        export_run(tmp_path / "run" / "final.pt", tmp_path / "out")
    weights = tmp_path / "lonely" / "final.pt"
    weights.parent.mkdir()
    weights.write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=f"^export-hf: no recipe at {weights.parent / 'recipe.yaml'}; pass"):
        export_run(weights, tmp_path / "out")
    gguf = tmp_path / "gguf.yaml"
    gguf.write_text("model:\n  source: gguf\n  path: smollm2\n")
    with pytest.raises(ValueError, match="^export-hf: model.source='gguf' in .*: only from-scratch models"):
        export_run(weights, tmp_path / "out", recipe_path=gguf)
    with pytest.raises(ValueError, match="its warm-up is disabled; the start model would be random$"):
        export_warmup(TINY, tmp_path / "model", overrides=("warmup.enabled=false",))
