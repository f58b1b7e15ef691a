"""bench openrlhf without running OpenRLHF: the variants' flags, the per-prompt medians from
OpenRLHF's timing keys, and the recipe copy each run gets (the runs themselves are real
`cppo-megatron openrlhf` processes; docs/benchmarks.md holds a measured table)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from cppo_megatron.bench import openrlhf as bench

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "openrlhf" / "tiny_cpu_cppo.yaml"


def test_variants_shrink_the_update_batch_only_without_allocation():
    recipe = yaml.safe_load(RECIPE.read_text())
    variants = dict(bench._variants(0.875, "both", recipe))
    assert variants["grpo"] == ["--cppo.pruning_rate", "0.0"]
    assert variants["cppo P=0.875 alloc"] == ["--cppo.pruning_rate", "0.875", "--cppo.allocation", "true"]
    # 256 x 2/16 = 32 survivors per step; the 64-sample train micro-batch shrinks to 32, the rollout one (32) stays
    assert variants["cppo P=0.875 no-alloc"] == ["--cppo.pruning_rate", "0.875", "--cppo.allocation", "false",
                                                 "--train.batch_size", "32", "--train.micro_batch_size", "32"]
    # the equal-batch GRPO: 16 x 16/2 = 128 prompts a step, all 2048 completions in one optimizer step
    same = bench._variants(0.875, "both", recipe, same_batch=True)
    assert [n for n, _ in same] == ["grpo", "cppo P=0.875 alloc", "grpo same batch", "cppo P=0.875 no-alloc"]
    assert dict(same)["grpo same batch"] == ["--cppo.pruning_rate", "0.0", "--rollout.batch_size", "128",
                                             "--train.batch_size", "2048"]
    assert [n for n, _ in bench._variants(0.875, "off", recipe, same_batch=True)] == ["grpo", "cppo P=0.875 no-alloc"]


def test_summarize_takes_medians_per_prompt_after_skipping():
    rows = [{"step": s, "timing/step_total": 10.0 * s, "timing/generation": 4.0 * s, "timing/ppo_train": 1.0,
             "cppo/num_groups": 2.0, "cppo/num_kept": 8.0} for s in range(1, 5)]
    out = bench.summarize(rows, skip=1)
    assert out["steps"] == 3 and out["prompts_per_step"] == 2.0 and out["trained_per_step"] == 8.0
    assert out["s_per_prompt"] == pytest.approx(15.0)  # median of 10, 15, 20
    assert out["generation_s_per_prompt"] == pytest.approx(6.0) and out["broadcast_s_per_prompt"] == 0.0
    with pytest.raises(ValueError, match="no timed steps"):
        bench.summarize(rows, skip=4)
    with pytest.raises(ValueError, match="cppo/num_groups"):
        bench.summarize([{"step": 1, "timing/step_total": 1.0}, {"step": 2, "timing/step_total": 1.0}], skip=1)


def test_each_run_gets_a_recipe_copy_with_its_run_dir_and_length(tmp_path):
    path = bench._recipe_for(str(RECIPE), tmp_path / "run", 6, tmp_path, "grpo")
    data = yaml.safe_load(path.read_text())
    assert data["cpu"]["run_dir"] == str(tmp_path / "run") and data["cpu"]["max_steps"] == 6
    assert data["cpu"]["eval_before_train"] is False
    assert data["openrlhf"]["reward.remote_url"] == str(RECIPE.parent / "reward_arithmetic.py")
    with pytest.raises(ValueError, match="cppo section"):
        bench._recipe_for(str(ROOT / "recipes" / "openrlhf" / "tiny_cpu_grpo.yaml"), tmp_path, 6, tmp_path, "x")
