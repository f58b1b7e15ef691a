"""The study on a veRL recipe (bench/verl_study.py), without starting veRL: which arm gets
which config, the interleaved order, reading a run's policies at wall-clock marks through the
shared evaluator, and the verdict on constructed results. The real study is in
docs/benchmarks.md; the clock's pieces inside the rollout server and the trainer are tested in
tests/integrations/verl/test_clock.py."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from cppo_megatron.bench import heldout, study, study_table, verl_study
from tests.doc_keys import missing_keys

ROOT = Path(__file__).resolve().parents[2]
GRPO_RECIPE = str(ROOT / "recipes" / "verl" / "tiny_cpu_grpo.yaml")


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    study.configure(p)
    return p.parse_intermixed_args(argv)


def test_verl_recipes_are_told_from_embedded_ones():
    assert verl_study.is_verl_recipe(GRPO_RECIPE)
    assert verl_study.is_verl_recipe(ROOT / "recipes" / "verl" / "tiny_cpu_cppo.yaml")
    assert not verl_study.is_verl_recipe(ROOT / "recipes" / "tiny_cpu.yaml")
    assert not verl_study.is_verl_recipe(ROOT / "recipes" / "verl" / "no_such.yaml")


def test_default_arms_their_configs_and_the_rotated_seed_major_order():
    args = verl_study._verl_args(parse([GRPO_RECIPE, "--seeds", "3"]))
    runs = verl_study.interleave(study_table.grid(args))
    assert [study_table.run_id(r) for r in runs] == [
        "p0_grpo_alloc_s0", "p0.875_smallest_alloc_s0", "p0.875_smallest_noalloc_s0",
        "p0.875_smallest_alloc_s1", "p0.875_smallest_noalloc_s1", "p0_grpo_alloc_s1",
        "p0.875_smallest_noalloc_s2", "p0_grpo_alloc_s2", "p0.875_smallest_alloc_s2",
    ]
    by_id = {study_table.run_id(r): verl_study.arm_overrides(r) for r in runs}
    seed1 = ["cppo.seed=1", "data.seed=1", "actor_rollout_ref.rollout.seed=1", "actor_rollout_ref.actor.data_loader_seed=1"]
    assert by_id["p0_grpo_alloc_s1"] == ["algorithm.adv_estimator=cppo", "cppo.pruning_rate=0.0", "cppo.allocation=true",
                                         "cppo.metric=smallest", "cppo.use_abs=true", *seed1]
    assert by_id["p0.875_smallest_alloc_s1"][1:3] == ["cppo.pruning_rate=0.875", "cppo.allocation=true"]
    assert by_id["p0.875_smallest_noalloc_s1"][1:3] == ["cppo.pruning_rate=0.875", "cppo.allocation=false"]
    assert by_id["p0.875_smallest_noalloc_s2"][-4:] == [s.replace("=1", "=2") for s in seed1]


def test_generation_arms_the_five_of_the_study_and_what_each_sets_in_verl(tmp_path):
    """--generation all,selective,dapo --exclude p0_grpo_alloc_selective: GRPO, DAPO (GRPO + veRL's
    filter), CPPO, CPPO + selective rollout, DAPO + CPPO; each arm's veRL keys, and V1 for all."""
    args = verl_study._verl_args(parse([GRPO_RECIPE, "--seeds", "1", "--rates", "0,0.875", "--allocation", "on",
                                        "--generation", "all,selective,dapo", "--exclude", "p0_grpo_alloc_selective"]))
    runs = study_table.grid(args)
    assert [study_table.run_id(r) for r in runs] == [
        "p0_grpo_alloc_s0", "p0_grpo_alloc_dapo_s0",
        "p0.875_smallest_alloc_s0", "p0.875_smallest_alloc_selective_s0", "p0.875_smallest_alloc_dapo_s0"]
    tail = {study_table.run_id(r): verl_study.arm_overrides(r)[9:] for r in runs}
    assert tail == {"p0_grpo_alloc_s0": [], "p0.875_smallest_alloc_s0": [],
                    "p0_grpo_alloc_dapo_s0": verl_study.DAPO_OVERRIDES,
                    "p0.875_smallest_alloc_dapo_s0": verl_study.DAPO_OVERRIDES,
                    "p0.875_smallest_alloc_selective_s0": ["cppo.selective.enabled=true"]}
    assert verl_study.DAPO_OVERRIDES[:2] == ["algorithm.filter_groups.enable=true",
                                             "algorithm.filter_groups.metric=reward"]
    o = verl_study.run_overrides(tmp_path / "r", tmp_path / "m", tmp_path / "d", "x", use_v1=True)
    assert "trainer.use_v1=true" in o and "trainer.use_v1=false" not in o
    with pytest.raises(ValueError, match=r"--exclude \['p0_nope'\]: not an arm.*p0_grpo_alloc_selective"):
        study_table.grid(verl_study._verl_args(parse([GRPO_RECIPE, "--generation", "all,selective",
                                                      "--exclude", "p0_nope"])))


def test_generation_counts_read_the_rollout_servers_counters_and_the_skipped_prompts():
    """Prompts consumed = completions generated / G + prompts skipped; tokens per step from the
    cumulative counter at the last sync of a step <= the one asked."""
    syncs = [{"step": 0, "elapsed": 0.0, "requests": 0, "tokens": 0},
             {"step": 1, "elapsed": 5.0, "requests": 64, "tokens": 300},
             {"step": 2, "elapsed": 9.0, "requests": 160, "tokens": 700},   # DAPO refill: 6 prompts of G=16
             {"step": 3, "elapsed": 14.0, "requests": 224, "tokens": 1000}]
    metrics = {1: {}, 2: {"selective/prompts_skipped": 3.0}, 3: {"selective/prompts_skipped": 1.0}}
    got = verl_study.generation_counts(syncs, metrics, 2, 16)
    assert got == {"completions": 160, "tokens": 700, "skipped": 3.0, "prompts": 13.0, "tokens_per_step": 350.0}
    assert verl_study.generation_counts(syncs, metrics, 3, 16)["prompts"] == 224 / 16 + 4
    assert verl_study.generation_counts([{"step": 1, "elapsed": 1.0}], metrics, 1, 16) is None  # old logs
    # early stopping: each 16-token segment is a request; the completions are what the steps started
    es = {1: {"early_stop/started": 32.0}, 2: {"early_stop/started": 32.0}, 3: {}}
    got = verl_study.generation_counts(syncs, es, 2, 16)
    assert got == {"completions": 64, "tokens": 700, "skipped": 0.0, "prompts": 4.0, "tokens_per_step": 350.0}
    assert verl_study.generation_counts(syncs, es, 3, 16)["completions"] == 224  # a step without: the server's
    with pytest.raises(ValueError, match="group_size must be >= 1"):
        verl_study.generation_counts(syncs, metrics, 1, 0)


def test_every_run_is_a_legacy_loop_run_without_validation_inside_its_budget(tmp_path):
    o = verl_study.run_overrides(tmp_path / "r", tmp_path / "m", tmp_path / "d", "p0_grpo_alloc_s0")
    assert f"cppo_cpu.model_dir={tmp_path / 'm'}" in o and f"cppo_cpu.data_dir={tmp_path / 'd'}" in o
    for want in ("trainer.use_v1=false", "trainer.val_before_train=false", "trainer.test_freq=-1",
                 "trainer.save_freq=-1", f"trainer.total_training_steps={verl_study.STEP_LIMIT}"):
        assert want in o


@pytest.mark.parametrize("argv,match", [
    (["--clock", "cpu"], "--clock cpu"),
    (["--full"], "--full"),
    (["--metrics", "importance"], "not available in veRL"),
    (["trainer.use_v1=true"], "sets it per arm"),
    (["cppo.pruning_rate=0.5"], "sets it per arm"),
    (["cppo.selective.enabled=true"], "--generation for selective rollout"),
    (["algorithm.filter_groups.enable=true"], "--generation for selective rollout and the DAPO filter"),
])
def test_options_the_veRL_study_cannot_honour_are_refused(argv, match):
    with pytest.raises(ValueError, match=match):
        verl_study._verl_args(parse([GRPO_RECIPE, *argv]))


def test_a_wrong_arm_name_fails_before_the_recipe_is_composed_or_a_start_model_built(tmp_path, monkeypatch):
    """`run` checks --exclude before composing the recipe (and before cpu mode's warm-up builds a
    missing start model, minutes of work): the tripwires at our own boundary are never reached."""
    def tripwire(*a, **k):
        raise AssertionError("reached past the arm check")
    monkeypatch.setattr(verl_study, "compose", tripwire)
    monkeypatch.setattr("cppo_megatron.integrations.verl.cpu.prepare.ensure_inputs", tripwire)
    with pytest.raises(ValueError, match=r"--exclude \['p0_nope'\]: not an arm"):
        verl_study.run(parse([GRPO_RECIPE, "--generation", "all,selective", "--exclude", "p0_nope",
                              "--out", str(tmp_path / "out")]))
    assert not (tmp_path / "out").exists()


def test_the_study_composes_a_cpu_recipe_on_the_rollout_that_keeps_its_policies(capsys):
    """``study_config``: the recipe's vLLM rollout is switched to ``hf`` (said in one line); a user's
    own rollout choice and a GPU recipe are refused. Composing only: nothing is started."""
    pytest.importorskip("verl")

    def config(recipe: str, *overrides: str):
        return verl_study.study_config(verl_study._verl_args(parse([recipe, *overrides])), recipe)

    cfg, overrides = config(GRPO_RECIPE, "data.seed=3")
    assert overrides == ["actor_rollout_ref.rollout.name=hf", "data.seed=3"]
    assert cfg.actor_rollout_ref.rollout.name == "hf" and cfg.data.seed == 3
    assert "generating with the `hf` rollout instead of the recipe's `vllm`" in capsys.readouterr().out
    named = "actor_rollout_ref.rollout.name=hf"  # the user's own choice of `hf`: kept, nothing to switch
    assert config(GRPO_RECIPE, named)[1] == [named] and not capsys.readouterr().out
    with pytest.raises(ValueError, match=r"needs actor_rollout_ref.rollout.name=hf: its rollout server keeps"):
        config(GRPO_RECIPE, "actor_rollout_ref.rollout.name=vllm")
    with pytest.raises(ValueError, match=r"qwen2.5-1.5b-gsm8k-grpo.yaml: the veRL study runs CPU-mode recipes"):
        config(str(ROOT / "recipes" / "verl" / "qwen2.5-1.5b-gsm8k-grpo.yaml"))


@pytest.mark.parametrize("flag", [["--seeds", "0"], ["--budget", "0"], ["--evals", "0"]])
def test_a_nonpositive_size_fails_before_anything_is_composed(flag, monkeypatch):
    def tripwire(*a, **k):
        raise AssertionError("reached past the size check")
    monkeypatch.setattr(verl_study, "compose", tripwire)
    with pytest.raises(ValueError, match=r"--seeds, --budget, --evals must be positive, got"):
        verl_study.run(parse([GRPO_RECIPE, *flag]))


def test_time_to_target_and_the_default_target():
    curve = [[0.0, 0.2, 0.0], [30.0, 0.25, 16.0], [60.0, 0.31, 32.0], [90.0, 0.29, 48.0]]
    assert verl_study.time_to_target(curve, 0.3) == 60.0
    assert verl_study.time_to_target(curve, 0.2) == 0.0
    assert verl_study.time_to_target(curve, 0.5) is None
    table = [{"final acc (mean)": 0.40}, {"final acc (mean)": 0.30}]
    assert verl_study.default_target(0.20, table) == 0.25  # halfway to the lowest arm
    table = [{"final acc (mean)": 0.40}, {"final acc (mean)": 0.18}]
    assert verl_study.default_target(0.20, table) == 0.30  # one arm lost ground: halfway to the best
    # every arm gained a little: halfway (0.2475) rounds down below the start (0.246); the target is the
    # first 0.01 step above the start instead, which no arm has reached at 0 s (the veRL generation study)
    assert verl_study.default_target(0.246, [{"final acc (mean)": 0.249}, {"final acc (mean)": 0.28}]) == 0.25
    assert verl_study.default_target(0.25, [{"final acc (mean)": 0.2502}]) == 0.26


# ------------------------------------------------------------------------------ one run, read back
def fake_run(out: Path, spec: dict, syncs: list[tuple[int, float]], budget: float, marks: list[float],
             per_step: dict, weights=lambda g: {"w": torch.tensor([float(g)])}) -> dict:
    """A run directory as a real run leaves it: clock files (``weights(step)``, by default the
    step number) and veRL metrics."""
    from cppo_megatron.integrations.verl.diagnostics import clock

    run_id = study_table.run_id(spec)
    run_dir = out / "runs" / run_id
    cfg = clock.write_settings(run_dir / "clock", budget, marks)
    fake = {"t": 0.0}
    snaps = clock.Snapshots(cfg, clock=lambda: fake["t"])
    loaded = {"s": weights(0)}
    for i, (g, t) in enumerate(syncs):
        fake["t"] = t
        snaps.before_update(lambda: loaded["s"], g)
        loaded["s"] = weights(g)
        snaps.after_update(lambda: loaded["s"], g, {"generate_s": 0.5 * i})
    step_s = per_step["step"] if isinstance(per_step["step"], list) else [per_step["step"]] * len(syncs)
    with open(run_dir / "metrics.jsonl", "w") as f:
        for i, (g, _) in enumerate(syncs[1:]):
            f.write(json.dumps({"step": g, "data": {"timing_s/step": step_s[i], "timing_s/gen": per_step["gen"],
                                                    "timing_s/update_actor": per_step["update"],
                                                    "cppo/num_groups": per_step["prompts"],
                                                    "cppo/num_completions": per_step["prompts"] * 16,
                                                    "cppo/num_kept": 256.0}}) + "\n")
    return {"run": run_id, "spec": spec, "wall_s": budget + 60, "load_mean": 3.0, "load_max": 5.0}


class StepEvaluator:
    """Accuracy = 0.2 + 0.01 x the step whose weights are in the file (start: 0.2)."""

    def __init__(self) -> None:
        self.files: list[Path] = []

    def accuracy(self, weights=None):
        step = 0.0 if weights is None else float(torch.load(weights)["w"][0])
        if weights is not None:
            self.files.append(Path(weights))
        return {"accuracy": 0.2 + 0.01 * step, "stderr": 0.01, "problems": 100}


def test_a_run_is_read_at_its_wall_clock_marks(tmp_path):
    spec = {"kind": "rl", "P": 0.875, "metric": "smallest", "allocation": True, "seed": 1, "keep_mass": None}
    # steps end at 7, 15, 22, 31 s (the last one, after the 30 s budget, is not used)
    result = fake_run(tmp_path, spec, [(0, 0.0), (1, 7.0), (2, 15.0), (3, 22.0), (4, 31.0)], 30.0, [10.0, 20.0, 30.0],
                      {"step": [30.0, 7.0, 8.0, 9.0], "gen": 6.0, "update": 1.0, "prompts": 128.0})
    ev = StepEvaluator()
    row = verl_study.evaluate_run(result, tmp_path, ev, ev.accuracy(None), 16)
    # in force: step 1 at 10 s, step 2 at 20 s, step 3 at 30 s
    assert row["curve"] == [[0.0, 0.2, 0.0], [10.0, pytest.approx(0.21), 128.0], [20.0, pytest.approx(0.22), 256.0],
                            [30.0, pytest.approx(0.23), 384.0]]
    assert row["steps"] == 3 and row["steps_run"] == 4
    assert row["accuracy_final"] == pytest.approx(0.23)
    assert (row["prompts_drawn"], row["completions_generated"], row["completions_trained"]) == (384.0, 6144.0, 768.0)
    assert [f.name for f in ev.files] == ["policy_step00001.pt", "policy_step00002.pt", "policy_step00003.pt"]
    ph = row["phases"]  # medians over steps 2..3: step 1 (start-up costs) and step 4 (past the budget) left out
    assert ph["step_s"] == 7.5 and ph["gen_s"] == 6.0 and ph["update_actor_s"] == 1.0
    assert ph["other_s"] == pytest.approx(0.5) and ph["hf_generate_s"] == pytest.approx(0.5)
    assert ph["gen_ms_per_prompt"] == pytest.approx(1e3 * 6.0 / 128)


def test_run_arms_runs_each_arm_in_order_or_reuses_the_result_a_finished_run_left(tmp_path, monkeypatch):
    """``run_arms`` with ``--reuse``: an arm whose ``result.json`` exists is read back, not run;
    every arm is graded at the marks and written to ``study.csv`` (without the phase split)."""
    import csv
    import time

    grpo = {"kind": "rl", "P": 0.0, "metric": "grpo", "allocation": True, "seed": 0, "keep_mass": None}
    cppo = {**grpo, "P": 0.875, "metric": "smallest"}
    marks = [10.0, 20.0, 30.0]
    per_step = {"step": 7.0, "gen": 6.0, "update": 1.0, "prompts": 16.0}
    finished = fake_run(tmp_path, grpo, [(0, 0.0), (1, 7.0), (2, 15.0)], 30.0, marks, per_step)
    (tmp_path / "runs" / finished["run"] / "result.json").write_text(json.dumps(finished))
    calls = []

    def run_one(recipe, user_overrides, spec, out, model_dir, data_dir, budget, marks, timeout_s, use_v1=False):
        calls.append((study_table.run_id(spec), recipe, user_overrides, budget, timeout_s, use_v1))
        return fake_run(out, spec, [(0, 0.0), (1, 7.0), (2, 15.0), (3, 22.0)], budget, marks, per_step)

    monkeypatch.setattr(verl_study, "run_one", run_one)
    ev = StepEvaluator()

    def arms(reuse: bool) -> list[dict]:
        a = argparse.Namespace(reuse=reuse, budget=30.0, run_timeout=60.0)
        return verl_study.run_arms(a, [grpo, cppo], "r.yaml", ["x=1"], out=tmp_path, model_dir=tmp_path / "m",
                                   data_dir=tmp_path / "d", marks=marks, evaluator=ev, start=ev.accuracy(None),
                                   group_size=16, use_v1=True, t0=time.perf_counter())

    rows = arms(reuse=True)
    assert calls == [("p0.875_smallest_alloc_s0", "r.yaml", ["x=1"], 30.0, 60.0, True)]
    assert [(r["run"], r["steps"], r["accuracy_final"]) for r in rows] == [
        ("p0_grpo_alloc_s0", 2, pytest.approx(0.22)), ("p0.875_smallest_alloc_s0", 3, pytest.approx(0.23))]
    with open(tmp_path / "study.csv") as f:
        written = list(csv.DictReader(f))
    assert [r["run"] for r in written] == ["p0_grpo_alloc_s0", "p0.875_smallest_alloc_s0"]
    assert "phases" not in written[0] and "curve" in written[0]
    calls.clear()
    assert [r["run"] for r in arms(reuse=False)] == ["p0_grpo_alloc_s0", "p0.875_smallest_alloc_s0"]
    assert [c[0] for c in calls] == ["p0_grpo_alloc_s0", "p0.875_smallest_alloc_s0"]  # nothing reused


# ------------------------------------------------------------------------------ the verdict
def rows_for(arm: dict, accs: list[float]) -> list[dict]:
    out = []
    for seed, acc in enumerate(accs):
        spec = {**arm, "seed": seed, "kind": "rl", "keep_mass": None}
        out.append({"run": study_table.run_id(spec), **spec, "steps": 10, "accuracy_start": 0.2, "accuracy_final": acc,
                    "eval_stderr": 0.01, "prompts_drawn": 100.0, "completions_generated": 1600.0,
                    "completions_trained": 1000.0, "accuracy_at_grpo_prompts": None, "prompts_at_grpo_prompts": None,
                    "curve": [[0.0, 0.2, 0.0], [30.0, acc, 100.0]], "load_mean": 4.0,
                    "phases": {"step_s": 4.0, "gen_s": 3.0}})
    return out


GRPO = {"P": 0.0, "metric": "grpo", "allocation": True}
ALLOC = {"P": 0.875, "metric": "smallest", "allocation": True}
NOALLOC = {"P": 0.875, "metric": "smallest", "allocation": False}


def test_verdict_names_no_winner_within_the_seed_spread():
    rows = rows_for(GRPO, [0.40, 0.42, 0.44]) + rows_for(ALLOC, [0.50, 0.51, 0.52]) + rows_for(NOALLOC, [0.38, 0.45, 0.50])
    table, _ = study_table.summarize(rows)
    for t in table:
        t["kind"] = "rl"
    notes = verl_study.verdicts(table)
    assert notes[0].startswith("CPPO P=0.875 smallest beats GRPO at equal wall time: 0.510 vs 0.420 (difference +0.090")
    assert notes[1].startswith("CPPO P=0.875 smallest no-alloc vs GRPO at equal wall time: no winner: the difference is "
                               "within the combined seed spread")
    # 0.067 apart, beyond sqrt(0.010^2 + 0.060^2) = 0.061
    assert notes[2] == ("CPPO P=0.875 smallest (allocation) beats P=0.875 smallest no-alloc: 0.510 vs 0.443 "
                        "(difference +0.067, combined seed sd 0.061)")
    verl_study.enrich(table, rows, target=0.45)
    by = {t["config"]: t for t in table}
    assert by["P=0.875 smallest"]["reached"] == "3/3" and by["P=0.875 smallest"]["time to target (s)"] == 30.0
    assert by["P=0 grpo"]["reached"] == "0/3" and by["P=0 grpo"]["time to target (s)"] is None
    assert by["P=0.875 smallest no-alloc"]["reached"] == "2/3"


def test_verdict_trails_and_one_seed():
    rows = rows_for(GRPO, [0.50, 0.51, 0.52]) + rows_for(ALLOC, [0.40, 0.41, 0.42])
    table, _ = study_table.summarize(rows)
    assert verl_study.verdicts(table)[0].startswith("CPPO P=0.875 smallest trails GRPO at equal wall time")
    table, _ = study_table.summarize(rows_for(GRPO, [0.5]) + rows_for(ALLOC, [0.7]))
    assert "no winner: 1 seed(s), the seed spread is unknown" in verl_study.verdicts(table)[0]


def test_study_notes_under_the_table():
    """The notes ``report_study`` prints under the table, from a constructed table: the verdicts
    first, then each arm's time to the target, the start model, the load and the cost."""
    rows = [{**r, "phases": {}, "wall_s": 90.0, "load_max": 4.0 + i}
            for i, r in enumerate(rows_for(GRPO, [0.40, 0.42]) + rows_for(ALLOC, [0.50, 0.52]))]
    table, _ = study_table.summarize(rows)
    for t in table:
        t["kind"] = "rl"
    verl_study.enrich(table, rows, target=0.45)
    start = {"accuracy": 0.2, "problems": 100}
    notes = verl_study.study_notes(table, rows, start, 0.45, budget=30.0, evals=2, model_dir=Path("/m"),
                                   info={"sft_steps": 40}, elapsed_s=125.4)
    verdict = verl_study.verdicts(table)
    assert len(verdict) == 1 and notes[:1] == verdict
    assert notes[1:] == [
        "time to accuracy 0.45 (first evaluation point at or above it; points every 15 s): "
        "P=0 grpo not reached (0/2), P=0.875 smallest 30 s (2/2 seeds)",
        "start model: /m (held-out accuracy 0.200 on 100 problems; warm-up 40 SFT steps)",
        "load average during the runs (includes the run's own processes): mean 4.0, max 7.0",
        "the runs took 6 min of wall time in all (each: Ray and worker start-up, the budget, the step in "
        "progress at its end); this command 125 s",
    ]
    # a start model without its warm-up record; the phase split adds a line per arm after the times
    rows = [{**r, "phases": {"step_s": 4.0, "gen_s": 3.0, "old_log_prob_s": 0.2, "ref_s": 0.2, "update_actor_s": 0.4,
                             "update_weights_s": 0.1, "other_s": 0.1, "gen_ms_per_prompt": 30.0}} for r in rows]
    verl_study.enrich(table, rows, target=0.45)
    notes = verl_study.study_notes(table, rows, start, 0.45, budget=30.0, evals=2, model_dir=Path("/m"),
                                   info={}, elapsed_s=125.4)
    assert notes[2:4] == verl_study.why_notes(table)[:2] and len(notes) == 1 + 1 + len(verl_study.why_notes(table)) + 3
    assert notes[2].startswith("P=0 grpo: 4.0 s/step (median) = gen 3.0 s + old log-prob 0.2")
    assert "warm-up ? SFT steps" in notes[-3]


# ------------------------------------------------------------------------------ the evaluator
@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory):
    from cppo_megatron.tasks import build_task
    from cppo_megatron.trainer.config import load_recipe
    from cppo_megatron.trainer.export import export_hf
    from cppo_megatron.trainer.models import build_model

    r = load_recipe(ROOT / "recipes" / "tiny_cpu.yaml", ["model.hidden_size=32", "model.num_layers=1"])
    task = build_task(r.task)
    model, tok = build_model(r.model, task.alphabet, seed=0)
    out = tmp_path_factory.mktemp("hf")
    export_hf(model, tok, out)
    return out, model, tok, task, r


def test_evaluator_grades_like_the_embedded_evaluator_with_verls_prompts(tiny_export, tmp_path):
    from cppo_megatron.rollout import HFEngine
    from cppo_megatron.trainer.evaluate import evaluate

    out, model, tok, task, r = tiny_export
    ev = heldout.Evaluator(out, str(ROOT / "recipes" / "tiny_cpu.yaml"), 50, 6)
    # veRL's prompt ids (chat template over the task prompt) are the embedded trainer's
    assert ev.prompts == [tok.prompt_ids(r.task.prompt_template.format(question=p.question)) for p in task.test[:50]]
    # a model that answers: give the start model's weights a trained look by copying a state
    # with a known answer distribution is not needed; compare on the same weights instead
    state = {k: v + 0.05 * torch.randn_like(v) for k, v in ev.start.items()}
    torch.save(state, tmp_path / "w.pt")
    got = ev.accuracy(tmp_path / "w.pt")
    ref_model = type(ev.model).from_pretrained(out)
    ref_model.load_state_dict(state)
    engine = HFEngine(ref_model, pad_id=tok.pad_id, eos_id=tok.eos_id, device=torch.device("cpu"), shared=True)
    want = evaluate(engine, tok, task, list(task.test[:50]), 6, r.task.prompt_template)
    assert got["accuracy"] == want["eval/accuracy"] and got["problems"] == 50
    assert ev.accuracy(None)["accuracy"] == ev.accuracy(None)["accuracy"]


def test_study_command_on_a_verl_recipe_writes_table_figure_and_verdict(tiny_export, tmp_path, monkeypatch):
    """``cppo-megatron study RECIPE.yaml`` end to end, with each veRL run replaced by the run
    directory it would leave (3 arms x 2 seeds): order, evaluation, table, notes, PNG."""
    pytest.importorskip("verl")
    from cppo_megatron.cli import main

    out_model = tiny_export[0]
    start = heldout.Evaluator(out_model, str(ROOT / "recipes" / "tiny_cpu.yaml"), 1, 6).start
    noise = {k: torch.randn_like(v) for k, v in start.items()}
    calls = []

    def run_one(recipe, user_overrides, spec, out, model_dir, data_dir, budget, marks, timeout_s, use_v1=False):
        assert use_v1 is False  # no arm needs V1: the legacy loop, as before
        calls.append(study_table.run_id(spec))
        assert model_dir == out_model.resolve() and budget == 20.0 and marks == [10.0, 20.0]
        steps = 4 if spec["P"] == 0 else 2
        syncs = [(0, 0.0)] + [(g, g * 21.0 / steps) for g in range(1, steps + 1)]
        return fake_run(out, spec, syncs, budget, marks, {"step": 5.0, "gen": 3.0, "update": 1.0, "prompts": 16.0},
                        weights=lambda g: {k: v + 0.02 * g * noise[k] for k, v in start.items()})

    monkeypatch.setattr(verl_study, "run_one", run_one)
    out = tmp_path / "study"
    argv = ["study", GRPO_RECIPE, f"cppo_cpu.model_dir={out_model}", f"cppo_cpu.data_dir={tmp_path / 'data'}",
            "--seeds", "2", "--budget", "20", "--evals", "2", "--eval-problems", "20", "--target", "0.5",
            "--out", str(out)]
    assert main(argv) == 0
    assert calls == ["p0_grpo_alloc_s0", "p0.875_smallest_alloc_s0", "p0.875_smallest_noalloc_s0",
                     "p0.875_smallest_alloc_s1", "p0.875_smallest_noalloc_s1", "p0_grpo_alloc_s1"]
    data = json.loads((out / "study_verl.json").read_text())
    assert missing_keys(data, "study_verl.json") == []  # every key docs/benchmarks.md documents
    assert data["params"]["order"] == calls and data["marks"] == [10.0, 20.0]
    assert {r["config"] for r in data["rows"]} == {"P=0 grpo", "P=0.875 smallest", "P=0.875 smallest no-alloc"}
    assert any(n.startswith("CPPO P=0.875 smallest vs GRPO at equal wall time") or "GRPO at equal wall time" in n
               for n in data["notes"])
    assert any(n.startswith("time to accuracy 0.50") for n in data["notes"])
    assert (out / "study_verl.png").is_file() and (out / "study.csv").is_file()
    assert (tmp_path / "data" / "test.parquet").is_file()  # the data were written once, before the runs


def test_the_early_stopping_arm_sets_its_key_in_verl_and_runs_v1():
    args = verl_study._verl_args(parse([GRPO_RECIPE, "--seeds", "1", "--rates", "0,0.875", "--allocation", "on",
                                        "--generation", "all,early_stop"]))
    runs = study_table.grid(args)
    assert [study_table.run_id(r) for r in runs] == ["p0_grpo_alloc_s0", "p0.875_smallest_alloc_s0",
                                                     "p0.875_smallest_alloc_early_stop_s0"]
    tail = {study_table.run_id(r): verl_study.arm_overrides(r)[9:] for r in runs}
    assert tail["p0.875_smallest_alloc_early_stop_s0"] == ["cppo.early_stop.enabled=true"]
    assert tail["p0.875_smallest_alloc_s0"] == []
