"""The speedup bench and the study run end to end on a micro recipe and write
well-formed outputs (the real runs are long and live in docs/benchmarks.md)."""

import argparse
import csv
import json

import pytest

from cppo_megatron.bench import speedup, study, study_table
from cppo_megatron.cli import main
from tests.doc_keys import missing_keys
from tests.recipes import MICRO, recipe_path

FAST = [o for o in MICRO if not o.startswith(("warmup.enabled", "train.steps", "cppo.pruning_rate"))] + [
    "warmup.max_steps=3",
    "warmup.eval_problems=10",
]


def _args(module, argv):
    p = argparse.ArgumentParser()
    module.configure(p)
    return p.parse_args(argv)


def test_speedup_bench_interleaves_runs_and_reports_the_bound(tmp_path):
    out = tmp_path / "sp"
    assert main(["bench", "speedup", recipe_path("tiny_cpu"), *FAST, "--rates", "0.5", "--steps", "1",
                 "--repeats", "2", "--out", str(out)]) == 0
    data = json.loads((out / "speedup.json").read_text())
    rows = data["rows"]
    # GRPO once, P=0.5 with and without allocation, and GRPO at allocation's batch (the equal-batch baseline)
    assert [r["run"] for r in rows] == ["GRPO", "CPPO P=0.5 alloc", "CPPO P=0.5 no-alloc", "GRPO at P=0.5's batch"]
    t_gen, t_rest = data["phase_split"]["t_gen_per_prompt_s"], data["phase_split"]["t_rest_per_prompt_s"]
    grpo, alloc, noalloc, same = rows
    for r in rows:
        assert r["steps measured"] == 2  # one step in each of two interleaved rounds
        if r is not same:
            expect = (t_gen + t_rest) / (t_gen + (1 - r["P"]) * t_rest)
            assert r["bound"] == pytest.approx(expect)
            assert r["of bound"] == pytest.approx(r["speedup"] / r["bound"])
    assert alloc["prompts/step"] == 2 * grpo["prompts/step"]  # allocation doubles prompts at P=0.5
    assert noalloc["trained/step"] == grpo["trained/step"] / 2
    # the same-batch GRPO draws allocation's prompts and trains every completion of them
    assert same["P"] == 0.0 and same["prompts/step"] == alloc["prompts/step"]
    assert same["trained/step"] == 2 * grpo["trained/step"] and same["bound"] is None
    assert same["speedup"] == pytest.approx(grpo["ms/prompt"] / same["ms/prompt"])  # the batching gain
    # allocation against it, with the bound from that run's own split (read back from its metrics)
    split = data["phase_split_same_batch"]["0.5"]
    assert split["t_step_per_prompt_s"] == pytest.approx(same["ms/prompt"] / 1e3)
    assert alloc["speedup same batch"] == pytest.approx(split["t_step_per_prompt_s"] * 1e3 / alloc["ms/prompt"])
    assert alloc["bound same batch"] == pytest.approx(speedup.speedup_bound(0.5, split["t_gen_per_prompt_s"],
                                                                            split["t_rest_per_prompt_s"]))
    assert noalloc["speedup same batch"] is None  # its generation batch is GRPO's
    assert any(n.startswith("P=0.5 with allocation: GRPO at its 8 prompts a step") for n in data["notes"])
    assert (out / "speedup.md").exists() and (out / "speedup.png").exists()
    assert missing_keys(data, "speedup.json") == []  # every key docs/benchmarks.md documents
    assert "step_seconds" not in data  # the docs say it comes from train's summary.json instead


def test_speedup_bench_with_selective_rollout_runs_each_rate_with_skipping(tmp_path):
    out = tmp_path / "sps"
    # 24 prompts, 8 drawn per step at P=0.5: the warm-up steps pass over the data twice, so prompts repeat
    assert main(["bench", "speedup", recipe_path("tiny_cpu"), *FAST, "task.train_size=24", "--rates", "0.5",
                 "--allocation", "on", "--selective", "--warmup-steps", "6", "--steps", "2", "--repeats", "1",
                 "--out", str(out)]) == 0
    data = json.loads((out / "speedup.json").read_text())
    assert [(r["P"], r["selective"]) for r in data["rows"]] == [(0.0, False), (0.5, False), (0.0, True), (0.5, True),
                                                                (0.0, False)]  # the last: GRPO at P=0.5's batch
    for r in data["rows"]:
        assert r["steps measured"] == 2 and r["generated/step"] <= r["prompts/step"]
        if not r["selective"]:
            assert r["generated/step"] == r["prompts/step"]
    assert (out / "runs" / "p0.5_alloc_selective" / "recipe.yaml").read_text().count("selective:\n    enabled: true") == 1
    assert any(n.startswith("P=0.5 with allocation + selective rollout:") and "the bound" in n for n in data["notes"])
    assert missing_keys(data, "speedup.json") == []


def _step_record(step_s: float, generated: int, kept: int, skipped: int | None = None) -> dict:
    rec = {"time/step": step_s, "alloc/prompts_drawn": float(generated), "cppo/num_kept": float(kept)}
    rec.update({f"time/{ph}": step_s / 10 for ph in ("rollout", "reward", "cppo", "old_logprob", "ref_logprob",
                                                     "update", "sync")})
    if skipped is not None:
        rec["selective/prompts_drawn"] = float(generated + skipped)
    return rec


def test_speedup_analysis_counts_skipped_prompts_as_consumed():
    records = {
        (0.0, True): [_step_record(1.6, 16, 256), _step_record(1.6, 16, 256)],
        (0.5, True): [_step_record(2.0, 32, 256), _step_record(2.4, 32, 256)],
        (0.5, True, "selective"): [_step_record(2.0, 32, 256, skipped=8), _step_record(2.4, 32, 256, skipped=16)],
    }
    rows, split = speedup.analyse(records, [0.0, 0.5], [True])
    by = {(r["P"], r["selective"]): r for r in rows}
    assert set(by) == {(0.0, False), (0.5, False), (0.5, True)}  # GRPO ran without selective rollout here
    assert by[(0.0, False)]["ms/prompt"] == pytest.approx(100.0)  # 1.6 s / 16 prompts
    assert by[(0.5, False)]["ms/prompt"] == pytest.approx((62.5 + 75.0) / 2)  # 2.0/32, 2.4/32
    sel = by[(0.5, True)]
    # per prompt consumed, skipped ones included: 2.0 / 40 and 2.4 / 48 -> 50 ms both
    assert sel["ms/prompt"] == pytest.approx(50.0) and sel["speedup"] == pytest.approx(2.0)
    assert sel["prompts/step"] == pytest.approx(44.0) and sel["generated/step"] == pytest.approx(32.0)
    # T_gen = rollout + reward = 0.2 x 100 ms, T_rest = 0.3 x 100 ms: S_max(0.5) = 50 / (20 + 15)
    assert sel["bound"] == pytest.approx(50 / 35) and sel["of bound"] == pytest.approx(2.0 / (50 / 35))
    note = speedup._selective_notes(rows)
    assert note == ["P=0.5 with allocation + selective rollout: 12 of 44 prompts per step skipped (median), "
                    "speedup 2.00x vs S_max 1.43x: beyond the bound"]


def test_study_writes_csv_rows_for_every_run_and_a_control(tmp_path):
    out = tmp_path / "st"
    assert main(["study", recipe_path("tiny_cpu"), *FAST, "--rates", "0,0.5", "--metrics", "smallest,largest",
                 "--seeds", "2", "--budget", "0.5", "--clock", "cpu", "--evals", "2", "--out", str(out)]) == 0
    with (out / "study.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    # per seed: GRPO once, P=0.5 x 2 metrics, one supervised control
    assert len(rows) == 2 * (1 + 2 + 1)
    assert {r["metric"] for r in rows} == {"grpo", "smallest", "largest", "sft"}
    for r in rows:
        curve = json.loads(r["curve"])
        assert 0.0 <= float(r["accuracy_final"]) <= 1.0 and curve[-1][1] == float(r["accuracy_final"])
        if r["kind"] == "rl":
            assert float(r["completions_generated"]) >= float(r["completions_trained"]) > 0
    summary = json.loads((out / "study.json").read_text())
    assert any("GRPO at equal time" in n for n in summary["notes"])
    assert missing_keys(summary, "study.json") == []  # every key docs/benchmarks.md documents
    assert set(rows[0]) == set(summary["runs"][0])  # study.csv: the keys of runs[]
    assert any("control" in n for n in summary["notes"])


def test_bad_rates_are_errors():
    with pytest.raises(ValueError, match=r"--rates must be in \[0, 1\)"):
        speedup._rates("0.5,1.0")
    with pytest.raises(ValueError, match="--metrics: unknown"):
        study_table.grid(_args(study, ["r.yaml", "--metrics", "median"]))


def test_study_runs_importance_and_keep_mass_and_reads_equal_prompts(tmp_path):
    out = tmp_path / "st2"
    assert main(["study", "recipes/tiny_cpu.yaml", *FAST, "--rates", "0,0.5", "--metrics", "smallest,importance,keep_mass",
                 "--keep-mass", "0.8", "--seeds", "1", "--budget", "0.5", "--clock", "cpu", "--evals", "1", "--no-control",
                 "--out", str(out)]) == 0
    with (out / "study.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert [r["run"] for r in rows] == ["p0_grpo_alloc_s0", "p0.5_smallest_alloc_s0", "p0.5_importance_alloc_s0",
                                        "keepmass0.8_alloc_s0"]
    grpo_prompts = float(rows[0]["prompts_drawn"])
    for r in rows[1:]:
        # each pruned run was evaluated when its prompts first reached GRPO's final count
        assert float(r["prompts_at_grpo_prompts"]) >= grpo_prompts
        assert float(r["prompts_drawn"]) >= float(r["prompts_at_grpo_prompts"])
        assert 0.0 <= float(r["accuracy_at_grpo_prompts"]) <= 1.0
    notes = json.loads((out / "study.json").read_text())["notes"]
    # one seed: the verdict against CPPO names no winner and says why
    assert any(n.startswith("P=0.5 importance vs CPPO P=0.5 smallest at equal time: no winner") for n in notes)
    assert any(n.startswith("keep_mass f=0.8") for n in notes)
    assert any("at equal prompts drawn" in n for n in notes)


def test_study_crosses_generation_modes_and_reports_tokens_and_time_to_target(tmp_path):
    out = tmp_path / "st3"
    assert main(["study", "recipes/tiny_cpu.yaml", *FAST, "--rates", "0,0.5", "--metrics", "smallest",
                 "--generation", "all,selective,dapo", "--seeds", "1", "--budget", "0.5", "--clock", "cpu",
                 "--evals", "1", "--no-control", "--target", "0.0", "--out", str(out)]) == 0
    with (out / "study.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert [r["run"] for r in rows] == ["p0_grpo_alloc_s0", "p0_grpo_alloc_selective_s0", "p0_grpo_alloc_dapo_s0",
                                        "p0.5_smallest_alloc_s0", "p0.5_smallest_alloc_selective_s0",
                                        "p0.5_smallest_alloc_dapo_s0"]
    for r in rows:
        # the arm ran with its generation mode: only selective runs count skipped prompts
        assert (r["prompts_skipped"] != "") == (r["generation"] == "selective")
        assert float(r["gen_tokens_per_step"]) > 0
        metrics = [json.loads(line) for line in (out / "runs" / r["run"] / "metrics.jsonl").open()]
        logged = [m for m in metrics if "rollout/tokens" in m]
        assert float(r["gen_tokens_per_step"]) == pytest.approx(
            sum(m["rollout/tokens"] for m in logged) / int(r["steps"]))
        assert any("selective/prompts_drawn" in m for m in metrics) == (r["generation"] == "selective")
    summary = json.loads((out / "study.json").read_text())
    configs = [t["config"] for t in summary["rows"]]
    assert configs == ["P=0 grpo", "P=0 grpo + selective rollout", "P=0 grpo + DAPO filter", "P=0.5 smallest",
                       "P=0.5 smallest + selective rollout", "P=0.5 smallest + DAPO filter"]
    assert all(t["reached"] == "1/1" and t["time to target (s)"] == 0.0 for t in summary["rows"])  # target 0
    notes = summary["notes"]
    assert any(n.startswith("P=0.5 smallest + selective rollout vs P=0.5 smallest at equal time: no winner") and
               "generation tokens per step" in n for n in notes)
    assert any(n.startswith("P=0.5 smallest + DAPO filter vs P=0 grpo + DAPO filter at equal time") for n in notes)
    assert any(n.startswith("time to 0.00 held-out accuracy") for n in notes)
    assert missing_keys(summary, "study.json") == []


def test_unknown_generation_mode_is_an_error():
    with pytest.raises(ValueError, match=r"--generation: unknown \['greso'\]; choose from \['all', 'selective', 'dapo', "
                                         r"'early_stop', 'two_wave'\]"):
        study_table.grid(_args(study, ["r.yaml", "--generation", "all,greso"]))


def test_the_two_wave_arm_runs_at_p0_as_the_grpo_baseline_and_beside_cppo():
    """Two waves need no pruning (NEEDS_PRUNING leaves it out): at P = 0 it is GRPO + two waves."""
    runs = study_table.grid(_args(study, ["r.yaml", "--rates", "0,0.875", "--metrics", "smallest", "--generation",
                                          "all,two_wave,early_stop", "--seeds", "1", "--no-control"]))
    assert [study_table.arm_name(r) for r in runs] == [
        "p0_grpo_alloc", "p0_grpo_alloc_two_wave", "p0.875_smallest_alloc", "p0.875_smallest_alloc_two_wave",
        "p0.875_smallest_alloc_early_stop"]
    assert study_table.GENERATION["two_wave"][0] == {"cppo.two_wave.enabled": True}


def _summary_row(p, metric, mean, sd, seeds):
    return {"P": p, "metric": metric, "allocation": True if p else None, "seeds": seeds,
            "final acc (mean)": mean, "seed spread (sd)": sd}


def test_study_names_a_winner_only_beyond_the_seed_spread_of_two_or_more_seeds():
    grpo = _summary_row(0.0, "grpo", 0.458, 0.078, 3)
    # the documented study: +0.139 against a combined sd of 0.082 -> a winner
    verdict, diff, noise = study_table.compare(_summary_row(0.875, "smallest", 0.597, 0.025, 3), grpo)
    assert verdict == "beats" and diff == pytest.approx(0.139) and noise == pytest.approx((0.078**2 + 0.025**2) ** 0.5)
    assert study_table.compare(grpo, _summary_row(0.875, "smallest", 0.597, 0.025, 3))[0] == "trails"
    # within the combined spread: no winner, either way round
    close = _summary_row(0.5, "smallest", 0.530, 0.05, 3)
    assert study_table.compare(close, grpo)[0].startswith("no winner: the difference is within")
    # one seed: sd unknown (nan), so no winner however large the difference
    one = [_summary_row(0.0, "grpo", 0.30, float("nan"), 1), _summary_row(0.875, "smallest", 0.60, float("nan"), 1)]
    notes = study_table.findings(one)
    assert notes == ["CPPO P=0.875 with allocation vs GRPO at equal time: no winner: 1 seed(s), the seed spread is "
                     "unknown (run --seeds 2 or more): 0.600 vs 0.300 (difference +0.300, combined seed sd unknown)"]


def test_study_ordering_finding_distinguishes_means_from_spread():
    rows = lambda sd, seeds: [_summary_row(0.875, m, a, sd, seeds)  # noqa: E731
                              for m, a in (("smallest", 0.597), ("random", 0.535), ("largest", 0.440))]
    assert study_table.findings(rows(0.01, 3))[0].endswith("holds, each gap beyond the combined seed spread")
    assert study_table.findings(rows(0.05, 3))[0].endswith("holds in the means only: a gap is within the combined seed spread")
    assert study_table.findings(rows(float("nan"), 1))[0].endswith("is not tested: 1 seed, the seed spread is unknown "
                                                              "(run --seeds 2 or more)")


def test_speedup_bench_with_early_stopping_runs_each_rate_stopping_inside_the_engine(tmp_path):
    out = tmp_path / "spe"
    es = ["rollout.max_new_tokens=8", "cppo.early_stop.segment_tokens=2", "cppo.early_stop.min_examples=1",
          "cppo.early_stop.success_threshold=0.05", "cppo.early_stop.min_confidence=0.5"]
    assert main(["bench", "speedup", recipe_path("tiny_cpu"), *FAST, *es, "--rates", "0.75", "--allocation", "on",
                 "--early-stop", "--no-same-batch", "--warmup-steps", "2", "--steps", "1", "--repeats", "2",
                 "--out", str(out)]) == 0
    data = json.loads((out / "speedup.json").read_text())
    assert [(r["P"], r["early_stop"]) for r in data["rows"]] == [(0.0, False), (0.75, False), (0.75, True)]
    plain, stopping = data["rows"][1], data["rows"][2]
    assert stopping["prompts/step"] == plain["prompts/step"] and stopping["bound"] == plain["bound"]
    assert 0 <= stopping["stopped share"] <= 1 and stopping["tokens/prompt"] > 0 and plain["stopped share"] == 0
    assert (out / "runs" / "p0.75_alloc_early_stop" / "recipe.yaml").read_text().count("enabled: true") == 1
    assert any(n.startswith("P=0.75 with allocation + early stopping:") for n in data["notes"])
    assert missing_keys(data, "speedup.json") == []


def test_study_with_early_stopping_runs_it_beside_cppo_and_logs_the_predictors_auc(tmp_path):
    out = tmp_path / "st4"
    es = ["rollout.max_new_tokens=8", "cppo.early_stop.segment_tokens=2", "cppo.early_stop.min_examples=1",
          "cppo.early_stop.success_threshold=0.05", "cppo.early_stop.explore_share=0.5"]
    assert main(["study", "recipes/tiny_cpu.yaml", *FAST, *es, "--rates", "0,0.5", "--metrics", "smallest",
                 "--generation", "all,early_stop", "--seeds", "1", "--budget", "1.5", "--clock", "cpu",
                 "--evals", "1", "--no-control", "--out", str(out)]) == 0
    with (out / "study.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    # GRPO with early stopping is no arm: at P = 0 nothing would be stopped
    assert [r["run"] for r in rows] == ["p0_grpo_alloc_s0", "p0.5_smallest_alloc_s0", "p0.5_smallest_alloc_early_stop_s0"]
    runs = {r["run"]: r for r in json.loads((out / "study.json").read_text())["runs"]}
    es_run = runs["p0.5_smallest_alloc_early_stop_s0"]
    assert es_run["stopped_share"] is not None and es_run["auc_per_step"] and runs["p0.5_smallest_alloc_s0"][
        "auc_per_step"] is None
    configs = [t["config"] for t in json.loads((out / "study.json").read_text())["rows"]]
    assert configs == ["P=0 grpo", "P=0.5 smallest", "P=0.5 smallest + early stopping"]


def test_an_unknown_exclude_is_refused_before_the_warm_up_writes_anything(tmp_path, capsys):
    """the arms are checked before the supervised warm-up (minutes on the worked testbed): a typo
    in --exclude fails at once, names the arms, and leaves no output folder behind"""
    out = tmp_path / "study"
    assert main(["study", recipe_path("tiny_cpu"), "--rates", "0,0.875", "--metrics", "smallest",
                 "--exclude", "p0_nope", "--no-control", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert ("--exclude ['p0_nope']: not an arm of this study; "
            "its arms are ['p0_grpo_alloc', 'p0.875_smallest_alloc']") in err
    assert not out.exists()
