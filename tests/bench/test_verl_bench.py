"""bench verl without running veRL: the variants' overrides, the per-prompt medians from veRL's
timing keys, and the table (speedup, bound from the GRPO run's own phase split) built from runs
already in --out (--reuse). The runs themselves are real `cppo-megatron verl` processes;
docs/benchmarks.md holds the measured tables (FSDP and Megatron engine)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from cppo_megatron.bench import verl as bench

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "verl" / "tiny_cpu_megatron_grpo.yaml"


def test_variants_run_grpo_through_the_cppo_estimator_at_p0():
    variants = dict(bench._variants(0.875, "both"))
    assert variants["grpo"] == ["algorithm.adv_estimator=cppo", "cppo.pruning_rate=0.0"]
    assert variants["cppo P=0.875 alloc"][1:] == ["cppo.pruning_rate=0.875", "cppo.allocation=True"]
    assert variants["cppo P=0.875 no-alloc"][1:] == ["cppo.pruning_rate=0.875", "cppo.allocation=False"]
    assert [n for n, _ in bench._variants(0.5, "off")] == ["grpo", "cppo P=0.5 no-alloc"]
    # the equal-batch GRPO runs right after CPPO with allocation, through the same estimator at P = 0
    same = bench._variants(0.875, "both", ["data.train_batch_size=128"])
    assert [n for n, _ in same] == ["grpo", "cppo P=0.875 alloc", "grpo same batch", "cppo P=0.875 no-alloc"]
    assert dict(same)["grpo same batch"] == ["algorithm.adv_estimator=cppo", "cppo.pruning_rate=0.0",
                                             "data.train_batch_size=128"]


def test_same_batch_overrides_grow_the_batch_and_the_mini_batch_by_g_over_k():
    # the recipe: 16 prompts x n = 16, mini-batch 16 prompts; P = 0.875 keeps 2 -> 128 prompts, one optimizer step
    assert bench.same_batch_overrides(str(RECIPE), [], 0.875) == [
        "data.train_batch_size=128", "actor_rollout_ref.actor.ppo_mini_batch_size=128"]
    assert bench.same_batch_overrides(str(RECIPE), ["data.train_batch_size=8"], 0.75) == [
        "data.train_batch_size=32", "actor_rollout_ref.actor.ppo_mini_batch_size=64"]
    with pytest.raises(ValueError, match="not a whole number of prompts"):  # P = 0.8 keeps 3: 2 x 16 / 3
        bench.same_batch_overrides(str(RECIPE), ["data.train_batch_size=2"], 0.8)


def _steps(prompts: float, kept: float, gen: float, old: float, update: float, n: int = 4) -> list[dict]:
    """n steps whose whole step is gen + old + update + 1 s of other work; step 1 twice as slow."""
    out = []
    for s in range(1, n + 1):
        f = 2.0 if s == 1 else 1.0
        d = {"timing_s/gen": f * gen, "timing_s/old_log_prob": f * old, "timing_s/update_actor": f * update,
             "cppo/num_groups": prompts, "cppo/num_kept": kept}
        d["timing_s/step"] = d["timing_s/gen"] + d["timing_s/old_log_prob"] + d["timing_s/update_actor"] + f
        out.append({"step": s, "data": d})
    return out


def test_table_from_reused_runs(tmp_path):
    runs = {"grpo": _steps(16, 256, gen=2.0, old=1.0, update=2.0),
            "cppo_P0.875_alloc": _steps(128, 256, gen=14.0, old=1.0, update=2.0),
            "cppo_P0.875_no-alloc": _steps(16, 32, gen=2.0, old=0.25, update=0.25),
            "grpo_same_batch": _steps(128, 2048, gen=14.0, old=8.0, update=16.0)}
    for slug, rows in runs.items():
        d = tmp_path / "verl_runs" / slug
        d.mkdir(parents=True)
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = argparse.Namespace(recipe=str(RECIPE), overrides=[], rate=0.875, allocation="both", steps=4, skip=1,
                              loop="legacy", reuse=True, out=str(tmp_path), no_plot=True, no_same_batch=False,
                              early_stop=False)
    report = bench.run(args)
    rows = {r["run"]: r for r in report.rows}
    # GRPO per prompt: gen 2/16, rest (old + update) 3/16, whole step 6/16 s
    assert report.extras["phase_split"]["t_gen_per_prompt_s"] == pytest.approx(2 / 16)
    assert report.extras["phase_split"]["t_rest_per_prompt_s"] == pytest.approx(3 / 16)
    bound = (2 + 3) / (2 + 3 / 8)  # S_max(0.875) from that split
    grpo, alloc, no_alloc = rows["grpo"], rows["cppo P=0.875 alloc"], rows["cppo P=0.875 no-alloc"]
    assert grpo["ms/prompt"] == pytest.approx(1e3 * 6 / 16) and grpo["speedup"] == 1.0 and grpo["bound"] == 1.0
    assert alloc["prompts/step"] == 128 and alloc["trained/step"] == 256
    assert alloc["ms/prompt"] == pytest.approx(1e3 * 18 / 128) and alloc["speedup"] == pytest.approx((6 / 16) / (18 / 128))
    assert alloc["bound"] == pytest.approx(bound) and alloc["of bound"] == pytest.approx(alloc["speedup"] / bound)
    assert no_alloc["ms/prompt"] == pytest.approx(1e3 * 3.5 / 16) and no_alloc["speedup"] == pytest.approx(6 / 3.5)
    assert no_alloc["ms/prompt update"] == pytest.approx(1e3 * 0.25 / 16)
    assert alloc["ms/prompt gen"] == pytest.approx(1e3 * 14 / 128)
    # against GRPO at the same 128 prompts (a step of 14 + 8 + 16 + 1 s), with the bound from its own split
    same = rows["grpo same batch"]
    assert same["speedup"] == pytest.approx((6 / 16) / (39 / 128)) and same["bound"] is None  # the batching gain
    assert alloc["speedup same batch"] == pytest.approx(39 / 18)
    assert alloc["bound same batch"] == pytest.approx((14 + 24) / (14 + 24 / 8))
    assert alloc["of bound same batch"] == pytest.approx((39 / 18) / (38 / 17))
    assert no_alloc["speedup same batch"] is None and grpo["speedup same batch"] is None
    assert report.extras["phase_split_same_batch"]["t_rest_per_prompt_s"] == pytest.approx(24 / 128)
    assert any(n.startswith("GRPO at allocation's 128 prompts a step: 1.23x GRPO per prompt") for n in report.notes)
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure()
    report.plot(fig)  # the same-batch GRPO's bar says what it is instead of a bound
    assert "1.23x (GRPO, larger batch)" in [t.get_text() for t in fig.axes[0].texts]


def test_summarize_refuses_runs_without_the_cppo_counters():
    rows = [{"step": s, "timing_s/step": 1.0} for s in (1, 2)]
    with pytest.raises(ValueError, match="cppo/num_groups"):
        bench.summarize(rows, skip=1)
    with pytest.raises(ValueError, match="no timed steps"):
        bench.summarize(rows, skip=2)
