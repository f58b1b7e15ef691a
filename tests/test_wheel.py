"""The wheel carries its recipes and runs them by name with no clone in sight.

Builds the wheel (``pip wheel --no-deps --no-build-isolation``), installs it into a fresh venv
that reaches the test environment's third-party packages (veRL, hydra, torch, ...) through one
``.pth`` line — but not its editable cppo_megatron: ``.pth`` files of a directory added that way
are not run, so the editable finder stays off — and runs the CLI from a directory outside the
clone: ``recipes``, ``verl --check``, dry runs of packaged cluster recipes by name (veRL, OpenRLHF,
the embedded trainer). Cost: ~15 s to build and install, ~10 s per veRL command (imports).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel_env(tmp_path_factory):
    """(venv python, its bin directory, the wheel, a working directory outside the clone)."""
    tmp = tmp_path_factory.mktemp("wheel")
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                          "-w", str(tmp / "dist"), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = (tmp / "dist").glob("cppo_megatron-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    out = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                          "--no-index", str(wheel)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    site = Path(subprocess.check_output([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        text=True).strip())
    (site / "zz_test_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    work = tmp / "elsewhere"
    work.mkdir()
    return python, venv / "bin", wheel, work


def _run(wheel_env, *argv, timeout=600):
    python, bindir, _, work = wheel_env
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VERL_USE_EXTERNAL_MODULES", "VIRTUAL_ENV")}
    env["PATH"] = f"{bindir}{os.pathsep}{env.get('PATH', '')}"
    cmd = [str(python), *argv[1:]] if argv[0] == "python" else [str(bindir / argv[0]), *argv[1:]]
    return subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=timeout)


def _repository_recipes() -> set[str]:
    """recipes/ as the repository has it (YAML recipes, override files, reward functions)."""
    return {str(p.relative_to(ROOT / "recipes")) for p in (ROOT / "recipes").rglob("*")
            if p.is_file() and p.suffix in (".yaml", ".yml", ".py") and "__pycache__" not in p.parts}


def test_installed_wheel_has_no_clone_on_its_path_and_carries_the_recipes(wheel_env):
    _, _, wheel, _ = wheel_env
    names = zipfile.ZipFile(wheel).namelist()
    packaged = {n[len("cppo_megatron/_recipes/"):] for n in names if n.startswith("cppo_megatron/_recipes/")}
    assert packaged == _repository_recipes()
    assert {"verl/qwen2.5-7b-math-megatron-cppo.yaml", "verl/cpu_toy.yaml", "openrlhf/reward_math.py"} <= packaged
    out = _run(wheel_env, "python", "-c",
               "import json, cppo_megatron, cppo_megatron.recipes as r\n"
               "from cppo_megatron.integrations.verl.cpu.prepare import RECIPES_DIR, _warmup_recipe\n"
               "print(json.dumps({'file': cppo_megatron.__file__, 'root': str(r.root()), 'prepare': str(RECIPES_DIR),"
               " 'warmup': str(_warmup_recipe('tiny_cpu.yaml'))}))")
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    venv = str(wheel_env[1].parent)
    assert got["file"].startswith(venv) and not got["file"].startswith(str(ROOT)), got
    assert got["root"] == got["prepare"] == str(Path(got["file"]).parent / "_recipes")
    assert got["warmup"] == str(Path(got["root"]) / "tiny_cpu.yaml")  # the CPU recipes' cppo_cpu.warmup_recipe


def test_recipes_lists_one_line_per_packaged_recipe(wheel_env):
    out = _run(wheel_env, "cppo-megatron", "recipes")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["NAME", "HOST", "MODEL", "LAYOUT", "CLUSTER"]
    row = next(line for line in lines if line.startswith("qwen2.5-7b-math-megatron-cppo "))
    assert " verl " in row and "Qwen/Qwen2.5-7B-Instruct" in row and "Megatron TP4 x PP1 x DP2" in row and "1 node x 8 GPUs" in row
    row = next(line for line in lines if line.startswith("qwen2.5-14b-math-megatron-cppo "))
    assert "Megatron TP4 x PP2 x DP2" in row and "2 nodes x 8 GPUs" in row
    row = next(line for line in lines if line.startswith("qwen2.5-7b-math-cppo "))
    assert " openrlhf " in row and "DeepSpeed ZeRO-3 x 3, vLLM 1 x TP1" in row and "4 GPUs" in row
    shipped = len(list((ROOT / "recipes").rglob("*.yaml")))
    assert f"{shipped} files in {wheel_env[1].parent}" in out.stdout  # read from the installed package


def test_verl_check_from_the_wheel(wheel_env):
    out = _run(wheel_env, "cppo-megatron", "verl", "--check")
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["plugin_loaded"] and report["estimator"] and report["drift"] == [] and report["cpu_mode_drift"] == []


def test_dry_run_of_a_packaged_cluster_recipe_by_name(wheel_env):
    out = _run(wheel_env, "cppo-megatron", "verl", "qwen2.5-7b-math-megatron-cppo", "--cppo-dry-run")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("CPPO allocation=True: keep 2 of G=16; data.train_batch_size 32 -> 256 prompts")
    assert "experiment_name: qwen2.5-7b-math-megatron-cppo" in out.stdout
    # the 14B recipe at toy size, with the packaged override file by name
    out = _run(wheel_env, "cppo-megatron", "verl", "qwen2.5-14b-math-megatron-cppo", "--cpu", "cpu_toy", "--cppo-dry-run")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "overrides from " in out.stdout and "data.train_batch_size 4 -> 32 prompts" in out.stdout
    assert "pipeline_model_parallel_size: 2" in out.stdout


def test_openrlhf_and_train_recipes_by_name(wheel_env):
    pytest.importorskip("openrlhf", exc_type=ImportError)
    out = _run(wheel_env, "cppo-megatron", "openrlhf", "qwen2.5-7b-math-cppo", "--dry-run")
    assert out.returncode == 0, out.stderr[-3000:]
    reward = next(tok for tok in out.stdout.split() if tok.endswith("reward_math.py"))
    assert reward.startswith(str(wheel_env[1].parent)) and Path(reward).is_file()  # the packaged reward function
    out = _run(wheel_env, "cppo-megatron", "train", "tiny_cpu", "--print-recipe")
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout)["cppo"]["pruning_rate"] == 0.875
