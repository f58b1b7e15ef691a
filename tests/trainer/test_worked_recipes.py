"""The worked-arithmetic testbed's embedded-trainer recipes (recipes/worked_cpu*.yaml): they load,
their positions cover prompt + every token a rollout may write, each CPPO recipe has a GRPO
twin that differs only in P (and where it writes), and both run steps at micro size."""

import json
from pathlib import Path

import pytest

from cppo_megatron.tasks import build_task
from cppo_megatron.trainer import Trainer
from cppo_megatron.trainer.config import load_recipe, recipe_to_dict
from cppo_megatron.trainer.preflight import check_inputs
from tests.recipes import recipe_path

TWINS = [("worked_cpu", "worked_cpu_grpo"), ("worked_cpu_megatron", "worked_cpu_megatron_grpo")]

# micro model, the recipe's task and lengths: a 2-step run in seconds
MICRO = ["threads=1", "model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=2",
         "model.intermediate_size=64", "task.train_size=400", "task.test_size=40", "rollout.group_size=4",
         "train.capacity=16", "train.steps=2", "train.max_time_s=0", "eval.every=0", "eval.num_problems=16",
         "warmup.enabled=false", "log.progress=false", "log.tensorboard=false", "log.plots=false",
         "log.checkpoint_every=0"]


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


@pytest.mark.parametrize("cppo, grpo", TWINS)
def test_twins_differ_only_in_the_pruning_rate(cppo, grpo):
    a, b = (_flat(recipe_to_dict(load_recipe(recipe_path(n)))) for n in (cppo, grpo))
    diff = {k for k in a if a[k] != b[k]}
    assert diff == {"cppo.pruning_rate", "out_dir"}
    assert a["cppo.pruning_rate"] == 0.875 and b["cppo.pruning_rate"] == 0.0


def test_the_two_wave_recipe_is_the_grpo_twin_with_two_waves():
    """worked_cpu_two_wave.yaml: worked_cpu_grpo.yaml (P = 0) with cppo.two_wave on, k = G / 4."""
    a, b = (_flat(recipe_to_dict(load_recipe(recipe_path(n)))) for n in ("worked_cpu_two_wave", "worked_cpu_grpo"))
    diff = {k for k in a if a[k] != b[k]}
    assert diff == {"cppo.two_wave.enabled", "cppo.two_wave.first_wave", "out_dir"}
    assert a["cppo.two_wave.first_wave"] == 4 == a["rollout.group_size"] // 4 and a["cppo.pruning_rate"] == 0.0


@pytest.mark.parametrize("name", [n for pair in TWINS for n in pair])
def test_positions_cover_prompt_and_every_new_token(name):
    r = load_recipe(recipe_path(name))
    assert r.task.name == "worked_arithmetic"
    inputs = check_inputs(r)
    assert not inputs.warnings
    task = inputs.task
    longest_prompt = max(len(inputs.tokenizer.prompt_ids(p.question)) for p in list(task.train) + list(task.test))
    assert longest_prompt + r.rollout.max_new_tokens <= r.model.max_position
    assert inputs.fit.longest_answer < r.rollout.max_new_tokens  # room beyond the longest reference


@pytest.mark.parametrize("name", TWINS[0])
def test_recipe_runs_two_steps(name, tmp_path):
    recipe = load_recipe(recipe_path(name), [*MICRO, f"out_dir={tmp_path}"])
    summary = Trainer(recipe).run()
    assert summary["steps"] == 2
    rows = [json.loads(x) for x in (Path(tmp_path) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("kind") == "step"]
    assert len(steps) == 2
    for s in steps:
        assert s["rollout/completions"] == s["alloc/prompts_drawn"] * 4
        assert 1 <= s["rollout/mean_length"] <= recipe.rollout.max_new_tokens
        # signal/*: every generated group, the same figures rollout/* reports
        assert s["signal/completions"] == s["rollout/completions"] and s["signal/groups"] == s["alloc/prompts_drawn"]
        assert s["signal/mean_length"] == s["rollout/mean_length"] and s["signal/generated_tokens"] == s["rollout/tokens"]
        assert s["signal/zero_variance_share"] == pytest.approx(s["signal/all_correct_share"] + s["signal/all_wrong_share"])
        assert s["signal/gen_share"] == pytest.approx((s["time/rollout"] + s["time/reward"]) / s["time/step"])


def test_the_task_has_the_regime_of_the_issue():
    """Median reference completion >= 40 tokens, a difficulty mix from 2 to 6 terms."""
    r = load_recipe(recipe_path("worked_cpu"))
    task = build_task(r.task)
    lengths = sorted(len(task.sft_target(p)) + 1 for p in task.train)
    assert lengths[len(lengths) // 2] >= 40
    assert {p.meta["level"][0] for p in task.train} == {2, 3, 4, 5, 6}


@pytest.mark.parametrize("name", TWINS[1])
def test_megatron_recipes_fit_four_processes(name, capsys):
    """The Megatron twins' launch-time sizing (``--dry-run``: no process is started)."""
    from cppo_megatron.cli import main

    assert main(["train", recipe_path(name), "--nproc", "4", "--dry-run"]) == 0
    assert "fits" in capsys.readouterr().out


def test_megatron_twins_match_the_single_process_ones():
    hf, meg = (_flat(recipe_to_dict(load_recipe(recipe_path(n)))) for n in ("worked_cpu", "worked_cpu_megatron"))
    assert {k for k in hf if hf[k] != meg[k]} == {"out_dir", "backend", "megatron.tp"}
