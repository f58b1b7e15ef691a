"""`cppo-megatron gpu-check --device cpu --quick` end to end (what a GPU machine runs, scaled
down, so the command cannot rot before a GPU sees it), plus the pass/fail logic on fakes."""

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="needs the megatron extra")
pytest.importorskip("transformers", reason="needs the train extra")

from cppo_megatron.bench import gpu_check as gc  # noqa: E402
from cppo_megatron.cli import main  # noqa: E402

pytestmark = pytest.mark.megatron
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One real quick run on CPU, TP 2 / PP 2 through torchrun included."""
    out = tmp_path_factory.mktemp("gpu_check")
    # CI runs three test streams on two cores: the budgets (which a GPU run keeps at 1x) get
    # room for that load; test_overrunning_the_budget_fails_the_check pins the enforcement.
    cmd = [sys.executable, "-m", "cppo_megatron.cli", "gpu-check", "--device", "cpu", "--quick", "--parallel", "2",
           "--budget-scale", "4", "--out", str(out)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - t0
    data = json.loads((out / "gpu_check.json").read_text()) if (out / "gpu_check.json").exists() else None
    return proc, data, out, wall


def _check(data, name):
    return next(c for c in data["checks"] if c["name"] == name)


def test_quick_cpu_run_passes_every_check(quick_run):
    proc, data, out, wall = quick_run
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert [c["name"] for c in data["checks"]] == list(gc.CHECKS)
    for c in data["checks"]:
        assert c["passed"] and not c["failures"] and c["error"] is None, c
        assert 0 < c["seconds"] <= c["budget_s"]
        assert c["peak_memory_mib"] > 0 and c["memory_kind"]
    assert data["passed"] is True and data["settings"]["device"] == "cpu" and data["settings"]["quick"]
    assert set(data["peak_memory_mib"]) == set(gc.CHECKS)
    # a progress line per check, then the verdict
    for i, name in enumerate(gc.CHECKS, 1):
        assert f"gpu-check [{i}/4] {name}: PASS" in proc.stdout
    assert "gpu-check: PASSED (4/4 checks)" in proc.stdout
    md = (out / "gpu_check.md").read_text()
    assert md.startswith("# cppo-megatron gpu-check (CPU, quick): PASSED")
    assert md.count("| pass |") == 4
    # ~45 s on an idle 2-core machine (+ ~25 s for the torchrun part); wall time is not asserted
    # here (tests check behaviour; a loaded CI machine takes 3x longer)
    print(f"the quick CPU check took {wall:.0f} s")


def test_environment_numbers(quick_run):
    env = _check(quick_run[1], "environment")["numbers"]
    assert env["cuda_available"] is False and env["gloo_available"] is True and env["bf16_supported"] is True
    for name in ("torch", "numpy", "omegaconf", "transformers", "megatron-core"):
        assert not str(env["backends"][name]).startswith("no:"), env["backends"]


def test_core_device_result_identical_to_cpu(quick_run):
    core = _check(quick_run[1], "core")["numbers"]
    assert core["completions"] == 10**5 and core["group_size"] == 16 and core["pruning_rate"] == 0.875
    for flag in ("advantages_identical", "kept_identical", "pruned_identical", "allocation_identical",
                 "balance_identical", "advantages_on_device"):
        assert core[flag] is True, flag
    assert core["advantages_max_abs_diff"] == 0.0
    assert core["kept"] == 10**5 // 16 * 2  # keep 2 of 16 per group
    assert core["prompts_planned"] == 10**5 // 16  # capacity = survivors -> every group's prompt
    assert core["cpu_seconds"] > 0 and core["device_seconds"] > 0
    assert 1.0 <= core["balance_imbalance"] < 1.01


def test_megatron_matches_hf_within_tolerance(quick_run):
    meg = _check(quick_run[1], "megatron")["numbers"]
    tol = meg["tolerances"]
    runs = {"world size 1": meg["world_size_1"], **meg["parallel"]}
    assert set(meg["parallel"]) == {"tp2_pp1 rank 0", "tp2_pp1 rank 1", "tp1_pp2 rank 0", "tp1_pp2 rank 1"}
    assert meg["parallel_peak_memory_mib"] > 0
    for name, r in runs.items():
        assert r["tokens_compared"] == sum(L - 1 for L in gc.megatron_sizes(True)["lengths"])
        assert r["logprob_max_abs_diff_fp32"] < 1e-5, name  # CPU float32: far inside the stated 1e-3
        assert 0 < r["logprob_max_abs_diff_bf16"] <= tol["bf16_logprob_max_abs"], name
        assert r["logprob_mean_abs_diff_bf16"] <= tol["bf16_logprob_mean_abs"], name
        assert r["grad_norm"] == pytest.approx(r["hf_grad_norm"], rel=1e-5), name
        assert r["loss"] == pytest.approx(r["hf_loss"], rel=1e-4, abs=1e-6), name
        assert r["post_step_loss"] < r["loss"], name
        # every layout agrees with world size 1 (the same model, batch and step)
        assert r["grad_norm"] == pytest.approx(meg["world_size_1"]["grad_norm"], rel=1e-5), name


def test_trainer_speedup_rows(quick_run):
    tr = _check(quick_run[1], "trainer")["numbers"]
    rows = {r["run"]: r for r in tr["rows"]}
    assert list(rows) == ["GRPO", "CPPO P=0.875 alloc", "CPPO P=0.875 no-alloc", "GRPO at P=0.875's batch"]
    grpo, alloc, noalloc, same = rows.values()
    assert grpo["prompts/step"] == tr["capacity"] / tr["group_size"]
    assert alloc["prompts/step"] == 8 * grpo["prompts/step"] and alloc["trained/step"] == grpo["trained/step"]
    assert noalloc["prompts/step"] == grpo["prompts/step"] and noalloc["trained/step"] == grpo["trained/step"] / 8
    g, r = tr["t_gen_ms_per_prompt"], tr["t_rest_ms_per_prompt"]
    assert tr["bound"] == pytest.approx((g + r) / (g + 0.125 * r))
    assert tr["speedup_alloc"] == pytest.approx(grpo["ms/prompt"] / alloc["ms/prompt"])
    assert tr["of_bound_noalloc"] == pytest.approx(tr["speedup_noalloc"] / tr["bound"])
    # GRPO at allocation's batch: the same prompts, every completion trained; allocation against it with its own bound
    assert same["prompts/step"] == alloc["prompts/step"] and same["trained/step"] == 8 * grpo["trained/step"]
    assert tr["batching_gain"] == pytest.approx(grpo["ms/prompt"] / same["ms/prompt"])
    assert tr["speedup_alloc_same_batch"] == pytest.approx(same["ms/prompt"] / alloc["ms/prompt"])
    g2, r2 = tr["t_gen_ms_per_prompt_same_batch"], tr["t_rest_ms_per_prompt_same_batch"]
    assert tr["bound_same_batch"] == pytest.approx((g2 + r2) / (g2 + 0.125 * r2))
    assert tr["of_bound_alloc_same_batch"] == pytest.approx(tr["speedup_alloc_same_batch"] / tr["bound_same_batch"])
    assert same["bound"] is None and noalloc["speedup same batch"] is None
    ro = tr["rollout_ms_per_prompt"]
    assert tr["rollout_per_prompt_alloc_over_grpo"] == pytest.approx(ro["cppo_alloc"] / ro["grpo"])
    assert all(math.isfinite(x) and x > 0 for x in ro.values())
    assert tr["model"]["params"] > 10_000 and tr["steps_per_run_per_round"] * tr["rounds"] == alloc["steps measured"]
    assert not (quick_run[2] / "trainer" / "warmup").exists()  # the start weights are not left behind


# ----------------------------------------------------------------------------- the verdict logic
def _settings(tmp_path, **kw):
    return gc.GpuCheckSettings(device="cpu", quick=True, out=str(tmp_path), **kw)


def test_a_failing_check_does_not_stop_the_others(tmp_path):
    def ok(s, ctx):
        return {"x": 1.0}, []

    def boom(s, ctx):
        raise RuntimeError("the device fell over")

    def missed(s, ctx):
        return {"diff": 0.5}, ["diff 0.5 exceeds 1e-3"]

    funcs = {"environment": ok, "core": boom, "megatron": missed, "trainer": ok}
    lines = []
    results, total = gc.run_gpu_check(_settings(tmp_path), log=lines.append, funcs=funcs)
    assert [(r.name, r.passed) for r in results] == [("environment", True), ("core", False), ("megatron", False),
                                                     ("trainer", True)]
    assert results[1].error == "RuntimeError: the device fell over" and "Traceback" in results[1].traceback
    assert results[2].failures == ("diff 0.5 exceeds 1e-3",) and results[2].numbers == {"diff": 0.5}
    assert any("core: FAIL" in line and "the device fell over" in line for line in lines)
    gc.write_outputs(results, _settings(tmp_path), total)
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert data["passed"] is False and [c["passed"] for c in data["checks"]] == [True, False, False, True]
    assert "**FAILED**: diff 0.5 exceeds 1e-3" in (tmp_path / "gpu_check.md").read_text()


def test_overrunning_the_budget_fails_the_check(tmp_path):
    def slow(s, ctx):
        time.sleep(0.15)
        return {}, []

    s = _settings(tmp_path, budget_scale=0.001, only=("core",))  # budget 0.06 s
    (r,), _ = gc.run_gpu_check(s, log=lambda m: None, funcs={"core": slow})
    assert not r.passed and "over its budget" in r.failures[0]


def _good_megatron_result():
    return {"logprob_max_abs_diff_fp32": 2e-4, "logprob_max_abs_diff_bf16": 0.05, "logprob_mean_abs_diff_bf16": 0.005,
            "loss": 0.2, "hf_loss": 0.20001, "grad_norm": 3.0, "hf_grad_norm": 3.0005, "post_step_loss": 0.1,
            "hf_post_step_loss": 0.1003}


@pytest.mark.parametrize("key,value,message", [
    ("logprob_max_abs_diff_fp32", 2e-3, "logprob_max_abs_diff_fp32"),
    ("logprob_max_abs_diff_bf16", 0.2, "logprob_max_abs_diff_bf16"),
    ("logprob_mean_abs_diff_bf16", float("nan"), "logprob_mean_abs_diff_bf16"),
    ("hf_grad_norm", 3.1, "grad norm"),
    ("hf_loss", 0.21, "update loss"),
    ("hf_post_step_loss", 0.2, "post-step loss"),
    ("post_step_loss", 0.3, "did not lower the loss"),
])
def test_judge_megatron_names_each_missed_tolerance(key, value, message):
    assert gc.judge_megatron(_good_megatron_result()) == []
    bad = {**_good_megatron_result(), key: value}
    if key == "post_step_loss":
        bad["hf_post_step_loss"] = 0.3  # agrees with HF but the step raised the loss
    failures = gc.judge_megatron(bad, "tp2")
    assert len(failures) == 1 and failures[0].startswith("tp2: ") and message in failures[0], failures


def test_bad_options_exit_2(capsys):
    assert main(["gpu-check", "--device", "cuda", "--out", "unused"]) == 2  # this machine has no GPU
    assert "sees no CUDA device: use --device cpu" in capsys.readouterr().err
    assert main(["gpu-check", "--only", "core,gpu", "--out", "unused"]) == 2
    assert "checks must be among" in capsys.readouterr().err
