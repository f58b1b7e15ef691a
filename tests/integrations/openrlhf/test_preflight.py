"""`cppo-megatron openrlhf`: the preflight of OpenRLHF settings (each bad value -> one line naming the
flag and the fix, exit 2, before Ray), and a training run asked of an environment without vLLM /
DeepSpeed: one line with the command that builds and runs the right environment, or a re-run there
when it exists."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("openrlhf", exc_type=ImportError)

ROOT = Path(__file__).resolve().parents[3]
RECIPE = ROOT / "recipes" / "openrlhf" / "qwen2.5-1.5b-gsm8k-cppo.yaml"
TINY = ROOT / "recipes" / "openrlhf" / "tiny_cpu_cppo.yaml"


def launch(capsys, *argv):
    from cppo_megatron import cli

    rc = cli.main(["openrlhf", *map(str, argv)])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and not line.startswith("warning")]
    return rc, err


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen2", "num_attention_heads": 12,
                                               "num_key_value_heads": 2, "max_position_embeddings": 2048}))
    return d


CASES = {
    "colocate_all": (["--train.colocate_all", "--vllm.num_engines", "3"],
                     ["--train.colocate_all", "(1 x 1 = 1)", "(3 x 1 = 3)", "set --vllm.num_engines 1"]),
    "deepspeed_batch": (["--train.batch_size", "250"],
                        ["--train.batch_size 250", "--train.micro_batch_size 4 x 1", "set --train.batch_size 248"]),
    "vllm_tp_heads": (["--vllm.tensor_parallel_size", "5", "--vllm.num_engines", "1"],
                      ["--vllm.tensor_parallel_size 5", "12 attention heads"]),
    "max_len": (["--data.max_len", "4096"], ["--data.max_len 4096", "max_position_embeddings=2048",
                                             "--data.max_len 2048 or less"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_preflight_stops_the_launcher_with_one_line(case, capsys, model_dir):
    extra, wanted = CASES[case]
    rc, err = launch(capsys, RECIPE, "--dry-run", "--actor.model_name_or_path", model_dir, *extra)
    assert rc == 2, err
    assert len(err) == 1 and err[0].startswith("cppo-megatron openrlhf: error: preflight: "), err
    for text in wanted:
        assert text in err[0], (text, err[0])


def test_shipped_recipe_passes_the_preflight(capsys, model_dir):
    rc, err = launch(capsys, RECIPE, "--dry-run", "--actor.model_name_or_path", model_dir)
    assert rc == 0 and err == [], err


def _cli(tmp_path, venv, *argv):
    env = {**os.environ, "CPPO_VLLM_VENV": str(venv), "PYTHONHASHSEED": "0"}
    return subprocess.run([sys.executable, "-m", "cppo_megatron.cli", "openrlhf", *map(str, argv)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)


@pytest.mark.skipif(all(__import__("importlib").util.find_spec(m) for m in ("vllm", "deepspeed")),
                    reason="this environment has vLLM and DeepSpeed: it trains itself")
def test_without_vllm_one_line_names_the_command_that_builds_the_environment(tmp_path, monkeypatch, capsys,
                                                                               gpu_only_stubs):
    """In-process, the launch stubbed (tests/launch_guard.py: OpenRLHF's train_ppo_ray and the CPU recipe's
    start model): a check that let the run through fails the test instead of building or training. The
    package's placeholders for the GPU-only modules (conftest.py) are lifted for the test: the check sees
    this environment as a user's command does."""
    from cppo_megatron import cli

    from ...launch_guard import forbid

    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if type(f).__name__ != "_GPUOnlyFinder"])
    for name in list(sys.modules):
        if name.split(".")[0] in gpu_only_stubs:
            monkeypatch.delitem(sys.modules, name)
    forbid(monkeypatch, "openrlhf")
    monkeypatch.setenv("CPPO_VLLM_VENV", str(tmp_path / "no-such-venv"))
    monkeypatch.chdir(tmp_path)
    code = cli.main(["openrlhf", str(TINY), "--cppo.pruning_rate", "0.75"])
    stderr = capsys.readouterr().err
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 2 and "Traceback" not in stderr, stderr
    assert len(lines) == 1, lines
    assert lines[0].startswith("cppo-megatron openrlhf: error: OpenRLHF's training loop needs"), lines
    assert (f"run `bash scripts/setup_vllm.sh && .venv-vllm/bin/cppo-megatron openrlhf {TINY} --cppo.pruning_rate "
            f"0.75`") in lines[0], lines[0]
    assert not (tmp_path / "runs").exists()  # stopped before the CPU recipe built its start model


@pytest.mark.skipif(all(__import__("importlib").util.find_spec(m) for m in ("vllm", "deepspeed")),
                    reason="this environment has vLLM and DeepSpeed: it trains itself")
def test_without_vllm_the_command_reruns_in_the_vllm_environment_when_it_exists(tmp_path):
    venv = tmp_path / "venv-vllm"
    (venv / "bin").mkdir(parents=True)
    fake = venv / "bin" / "python"  # stands in for .venv-vllm's interpreter: says how it was called
    fake.write_text("#!/bin/sh\necho \"ran: $*\"\nexit 7\n")
    fake.chmod(0o755)
    toy = ROOT / "recipes" / "openrlhf" / "cpu_toy.yaml"
    out = _cli(tmp_path, venv, RECIPE, "--cpu", toy, "--cppo.pruning_rate", "0.75")
    assert out.returncode == 7, out.stderr  # the vLLM environment's exit status
    assert f"running in {venv}" in out.stdout
    assert f"ran: -m cppo_megatron.cli openrlhf {RECIPE} --cpu {toy} --cppo.pruning_rate 0.75" in out.stdout
