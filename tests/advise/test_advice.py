"""advise's numbers by value: the warm-up rule, the median split per host, S_max and the step
times per P, the generation-bound flag, async (overlapped) and CPPO-run logs, the recipe sizing of
allocation's batch, and the command line (one line and exit 2 on a log without timings)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cppo_megatron.advise import GENERATION_BOUND, advise_rates, format_advice, phase_split, read_recipe, read_run
from cppo_megatron.advise.logs import RunLog
from cppo_megatron.cli import main

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "examples" / "advise"
VERL_RECIPE = REPO / "recipes" / "verl" / "tiny_cpu_grpo.yaml"


def test_the_published_verl_split_hand_written():
    """examples/advise/verl_fully_async_32xH20.log, hand-written in veRL's console format from veRL's
    fully-async doc, Qwen2.5-Math-7B DAPO on 32 H20, colocated sync: a step of 790 s, 357 s generating,
    old log-prob 108 s, update 270 s (/work/shared/docs/platform-notes.md, "Where users spend a step");
    the other 55 s (advantages, weight sync) are not prunable. Step 1 is a slower warm-up."""
    split = phase_split(read_run(DATA / "verl_fully_async_32xH20.log"))
    assert split.steps_used == (2, 3, 4, 5) and split.steps_skipped == (1,)
    assert (split.step_s, split.generation_s, split.prunable_s, split.fixed_s) == (790.0, 357.0, 378.0, 412.0)
    rows = {r.P: r for r in advise_rates(split)}
    # S_max(P) = 790 / (412 + (1 - P) 378): 1.31x, 1.56x, 1.72x, 1.81x
    assert rows[0.875].s_max == pytest.approx(790 / (412 + 0.125 * 378))  # 1.7202
    assert [round(r.s_max, 2) for r in rows.values()] == [1.31, 1.56, 1.72, 1.81]
    assert rows[0.875].step_noalloc_s == pytest.approx(459.25) and rows[0.875].step_alloc_s == pytest.approx(3674.0)
    assert rows[0.875].speedup_per_prompt == pytest.approx(rows[0.875].s_max)
    assert rows[0.875].allocation == "unsized" and rows[0.875].prompts is None
    assert rows[0.875].change == ("cppo-megatron verl RECIPE algorithm.adv_estimator=cppo cppo.pruning_rate=0.875 "
                                  "cppo.allocation=true")
    text = format_advice(split, list(rows.values()))
    assert "generation 357 s (45%)" in text and "WARNING" not in text
    assert "skipped step 1 (the first step pays" in text and "  0.875   1.72x           1.72x          459 s" in text


def test_a_generation_bound_run_is_flagged():
    """OpenRLHF's README: ~80% of a step is generation."""
    steps = tuple((s, {"timing/generation": 80.0, "timing/make_experience": 5.0, "timing/ppo_train": 15.0,
                       "timing/broadcast": 0.0, "timing/step_total": 100.0}) for s in range(1, 4))
    split = phase_split(RunLog("openrlhf", "x.log", "console", steps))
    rows = advise_rates(split)
    assert split.generation_share == GENERATION_BOUND
    text = format_advice(split, rows)
    assert "WARNING: generation is 80% of a step" in text and "at most 1.23x (P=0.9375)" in text
    assert "selective rollout (cppo.selective.enabled=true" in text and "stopping unpromising completions early" in text
    assert rows[0].change == "cppo-megatron openrlhf RECIPE --cppo.pruning_rate 0.5 --cppo.allocation true"


def test_warm_up_rule_and_skip():
    def run(times):
        return RunLog("trainer", "m.jsonl", "jsonl", tuple((i + 1, {"time/step": t, "time/update": t / 2})
                                                           for i, t in enumerate(times)))
    assert phase_split(run([9, 5, 5, 5, 5, 5])).steps_skipped == (1,)
    # the next leading steps still over 1.5x the median of the rest go too, up to a quarter of the steps
    s = phase_split(run([20, 9, 8, 5, 5, 5, 5, 5, 5, 5, 5, 5]))
    assert s.steps_skipped == (1, 2, 3) and s.step_s == 5 and "skipped steps 1-3" in s.skip_note
    assert phase_split(run([20, 9, 8, 5, 5, 5, 5, 5])).steps_skipped == (1, 2)  # 8 // 4
    assert phase_split(run([20, 9])).steps_skipped == (1,)
    assert phase_split(run([20, 5, 5, 5, 5, 5, 5, 5])).steps_skipped == (1,)  # step 2 is not slow: the rule stops
    one = phase_split(run([7]))
    assert one.steps_used == (1,) and one.step_s == 7 and "only one timed step" in one.skip_note
    assert phase_split(run([9, 5, 5]), skip=0).step_s == 5 and phase_split(run([9, 5, 5]), skip=2).step_s == 5
    with pytest.raises(ValueError, match="--skip 3 leaves none of the 3 timed steps"):
        phase_split(run([9, 5, 5]), skip=3)


def test_checkpoint_time_is_taken_out_of_the_step_and_other_hosts_timers():
    steps = tuple((s, {"timing_s/step": 12.0 if s == 3 else 8.0, "timing_s/save_checkpoint": 4.0 if s == 3 else 0.0,
                       "timing_s/gen": 4.0, "timing_s/ref": 1.0, "timing_s/values": 0.5, "timing_s/update_critic": 0.5,
                       "timing_s/update_actor": 1.0}) for s in range(1, 5))
    split = phase_split(RunLog("verl", "x", "jsonl", steps))
    assert split.step_s == 8.0 and split.prunable_s == 3.0 and split.phases["timing_s/ref"] == 1.0


def test_an_async_run_overlaps_generation_and_training():
    """OpenRLHF's async trainer: step_total is the iteration's wall time, shorter than its parts."""
    steps = tuple((s, {"timing/generation": 10.0, "timing/make_experience": 3.0, "timing/ppo_train": 6.0,
                       "timing/broadcast": 1.0, "timing/step_total": 11.0}) for s in range(1, 4))
    split = phase_split(RunLog("openrlhf", "x", "console", steps))
    assert split.overlapped
    rows = {r.P: r for r in advise_rates(split, [0.5, 0.875])}
    # the longer path: max(generation 10, 11 - P x 9)
    assert rows[0.5].step_noalloc_s == 10.0 and rows[0.5].speedup_per_prompt == pytest.approx(1.1)
    assert "generation overlaps training" in format_advice(split, list(rows.values()))


def test_a_cppo_run_log_is_scaled_to_the_full_batch():
    steps = tuple((s, {"time/step": 3.0, "time/rollout": 2.0, "time/update": 0.5, "cppo/num_completions": 256.0,
                       "cppo/num_kept": 32.0, "cppo/num_groups": 16.0}) for s in range(1, 4))
    split = phase_split(RunLog("trainer", "x", "jsonl", steps))
    assert split.pruned_fraction == 0.125 and split.prunable_s == 4.0 and split.step_s == 6.5
    assert (split.prompts_per_step, split.group_size) == (16.0, 16.0)
    rows = advise_rates(split, [0.875])
    assert rows[0].prompts == 128 and rows[0].generated == 2048 and rows[0].trained == 256
    assert "this log is a CPPO run (it trained 12.5% of its completions)" in format_advice(split, rows)


def test_bad_rates_and_a_log_without_step_times():
    split = phase_split(RunLog("trainer", "x", "jsonl", ((1, {"time/step": 1.0}), (2, {"time/step": 1.0}))))
    for bad in ([0.0], [1.0], [True], []):
        with pytest.raises(ValueError, match="pruning rate"):
            advise_rates(split, bad)
    with pytest.raises(ValueError, match="no step logged time/step"):
        phase_split(RunLog("trainer", "x", "jsonl", ((1, {"time/rollout": 1.0}),)))
    with pytest.raises(ValueError, match="median step time is 0"):
        phase_split(RunLog("trainer", "x", "jsonl", ((1, {"time/step": 0.0}),)))


# ------------------------------------------------------------------------------ recipes
QWEN_05B = {"model_type": "qwen2", "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
            "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": True,
            "max_position_embeddings": 32768}


def _model_dir(tmp_path) -> Path:
    d = tmp_path / "qwen05b"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(QWEN_05B))
    return d


def test_verl_recipe_sizes_allocations_batch_against_vllms_pool(tmp_path):
    """Qwen2.5-0.5B's shape, 512 + 1024 tokens: KV per sequence 2 x 24 layers x 2 KV heads x 64 x 1536 x 2 B
    = 18.9 MB; vLLM's pool 0.5 x 80 GB less 0.99 GB of bf16 weights holds ~2,000, max_num_seqs 256."""
    model = _model_dir(tmp_path)
    over = [f"actor_rollout_ref.model.path={model}", "data.max_prompt_length=512", "data.max_response_length=1024"]
    eight = read_recipe(str(VERL_RECIPE), [*over, "trainer.n_gpus_per_node=8"])
    assert (eight.host, eight.prompts, eight.group_size) == ("verl", 16, 16)
    fit = eight.fit(2048)  # P = 0.875: 128 prompts x 16, over 8 replicas
    assert fit.need_gb == pytest.approx(256 * 2 * 24 * 2 * 64 * 1536 * 2 / 1e9)
    assert fit.pool_gb == pytest.approx((40e9 - 494_032_768 * 2) / 1e9)
    assert (fit.concurrent, fit.waves, fit.fits) == (256, 1, True)
    one = read_recipe(str(VERL_RECIPE), [*over, "trainer.n_gpus_per_node=1"])
    assert (one.fit(2048).waves, one.fit(2048).fits) == (8, False)
    # 1 GB less 0.99 GB of weights cannot hold one 18.9 MB sequence: the run cannot start
    small = read_recipe(str(VERL_RECIPE), [*over, "trainer.n_gpus_per_node=1"], device_gb=2.0)
    assert (small.fit(256).concurrent, small.fit(256).waves, small.fit(256).fits) == (0, 0, False)
    split = phase_split(read_run(DATA / "verl_cpu_grpo_metrics.jsonl"))
    rows = {r.P: r for r in advise_rates(split, [0.5, 0.875], eight)}
    assert rows[0.875].allocation == "yes" and rows[0.875].generated == 2048 and rows[0.875].trained == 256
    rows1 = {r.P: r for r in advise_rates(split, [0.875], one)}
    assert rows1[0.875].allocation == "yes, in 8 waves" and rows1[0.875].change.endswith("cppo.allocation=true")
    none = advise_rates(split, [0.875], small)[0]
    assert none.allocation == "no: does not fit" and "not even one sequence" in none.reason
    hf = read_recipe(str(VERL_RECIPE), [*over, "actor_rollout_ref.rollout.name=hf"])
    assert hf.fit(2048) is None and "only a vLLM or SGLang rollout is sized" in hf.why
    hub = read_recipe(str(VERL_RECIPE), ["actor_rollout_ref.model.path=Qwen/Qwen2.5-7B-Instruct"])
    assert "not a local directory" in hub.why
    assert advise_rates(split, [0.5], hub)[0].reason.startswith("cannot size the rollout: the model")


def test_openrlhf_recipe(tmp_path):
    model = _model_dir(tmp_path)
    recipe = tmp_path / "orl.yaml"
    recipe.write_text(json.dumps({"cppo": {"pruning_rate": 0.875}, "cpu": {"model_dir": str(model)}, "openrlhf": {
        "actor.model_name_or_path": "${CPPO_CPU_MODEL_DIR}", "rollout.batch_size": 32,
        "rollout.n_samples_per_prompt": 8, "vllm.num_engines": 2, "vllm.tensor_parallel_size": 2,
        "data.max_len": 1024}}))
    facts = read_recipe(str(recipe))
    assert (facts.host, facts.prompts, facts.group_size) == ("openrlhf", 32, 8)
    fit = facts.fit(512)  # 256 per engine, each a TP 2 shard
    per_seq = 2 * 24 * 2 * 64 * 1024 * 2 / 2
    assert fit.need_gb == pytest.approx(256 * per_seq / 1e9) and fit.waves == 1
    assert fit.pool_gb == pytest.approx((0.95 * 80e9 - 494_032_768 * 2 / 2) / 1e9)
    recipe.write_text(json.dumps({"openrlhf": {"actor.model_name_or_path": "Qwen/Qwen2.5-7B"}}))
    assert "not a local directory" in read_recipe(str(recipe)).why


def test_trainer_recipe_uses_the_sizing_estimate():
    from cppo_megatron.trainer.config import load_recipe, replace_recipe
    from cppo_megatron.trainer.sizing import estimate

    path = str(REPO / "recipes" / "tiny_cpu.yaml")
    facts = read_recipe(path, ["rollout.max_batch_sequences=512"])
    assert (facts.host, facts.prompts, facts.group_size) == ("trainer", 16, 16)
    fit = facts.fit(2048)
    assert (fit.concurrent, fit.waves) == (512, 4)  # generate calls of rollout.max_batch_sequences
    want = estimate(replace_recipe(load_recipe(path, []), **{"rollout.max_batch_sequences": 512}), 1)
    assert fit.need_gb == pytest.approx(want.largest.total / 1e9)
    assert facts.fit(256).concurrent == 256 and facts.fit(256).waves == 1
    huge = read_recipe(path, ["megatron.device_memory_gb=0.001"])
    row = advise_rates(phase_split(RunLog("trainer", "x", "jsonl", ((1, {"time/step": 1.0}),))), [0.875], huge)[0]
    assert row.allocation == "no: does not fit" and row.change.endswith("cppo.allocation=false")
    with pytest.raises(ValueError, match="--device-gb must be > 0"):
        read_recipe(path, device_gb=0)
    with pytest.raises(FileNotFoundError):
        read_recipe("no_such_recipe.yaml")


# ------------------------------------------------------------------------------ the command
def test_cli_prints_the_advice_and_writes_json(tmp_path, capsys):
    out = tmp_path / "advice.json"
    assert main(["advise", str(DATA / "verl_cpu_grpo_console.log"), "--rates", "0.5,0.875", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "advise: " in text and "(veRL, console log): steps 2-4, 3 step(s)" in text
    data = json.loads(out.read_text())
    assert [r["P"] for r in data["rates"]] == [0.5, 0.875] and data["split"]["steps_used"] == [2, 3, 4]
    assert data["split"]["step_s"] == pytest.approx(6.138, abs=1e-3) and data["recipe"] is None


def test_cli_with_a_recipe(tmp_path, capsys):
    bad = tmp_path / "list.yaml"
    bad.write_text("- a\n- b\n")
    assert main(["advise", str(DATA / "verl_cpu_grpo_metrics.jsonl"), "--recipe", str(bad)]) == 2
    assert "is not a YAML mapping" in capsys.readouterr().err
    model = _model_dir(tmp_path)
    assert main(["advise", str(DATA / "verl_cpu_grpo_metrics.jsonl"), "--rates", "0.875", "--recipe", str(VERL_RECIPE),
                 "--override", f"actor_rollout_ref.model.path={model}", "--override", "trainer.n_gpus_per_node=1"]) == 0
    text = capsys.readouterr().out
    assert "recipe " in text and "16 prompts x G=16 per step" in text
    assert "P=0.875: allocation yes, in 8 waves:" in text and "wrote" not in text


def test_cli_refuses_with_one_line_and_exit_2(tmp_path, capsys):
    (tmp_path / "plain.log").write_text("INFO starting\nINFO done\n")
    assert main(["advise", str(tmp_path / "plain.log")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("cppo-megatron advise: error: ") and "no step timings found" in err[0]
    assert main(["advise", str(DATA / "verl_cpu_grpo_console.log"), "--rates", "0.5,x"]) == 2
    assert "--rates must be comma-separated" in capsys.readouterr().err
    assert main(["advise", str(DATA / "verl_cpu_grpo_console.log"), "--skip", "-1"]) == 2
    assert main(["advise", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
