"""Shipped recipes by name (cppo_megatron/recipes.py, `cppo-megatron recipes`): which file a name
picks for each command, what the listing says of each recipe, and every command that takes a
recipe file taking a name too (from a directory with no recipes/). The wheel's packaged copy:
tests/test_wheel.py."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

from cppo_megatron import cli, recipes

ROOT = Path(__file__).resolve().parents[1]
R = ROOT / "recipes"


def test_root_is_the_clones_recipes_without_a_packaged_copy():
    assert not recipes.PACKAGED.exists()  # a clone carries none (setup.py makes it in a wheel only)
    assert recipes.root() == R


@pytest.mark.parametrize("arg, host, want", [
    ("qwen2.5-7b-math-megatron-cppo", "verl", "verl/qwen2.5-7b-math-megatron-cppo.yaml"),
    ("qwen2.5-7b-math-megatron-cppo.yaml", "verl", "verl/qwen2.5-7b-math-megatron-cppo.yaml"),
    ("recipes/verl/cpu_toy.yaml", "verl", "verl/cpu_toy.yaml"),  # a clone's path, given elsewhere
    ("tiny_cpu_cppo", "verl", "verl/tiny_cpu_cppo.yaml"),  # the host's folder, not openrlhf's
    ("tiny_cpu_cppo", "openrlhf", "openrlhf/tiny_cpu_cppo.yaml"),
    ("cpu_toy", "openrlhf", "openrlhf/cpu_toy.yaml"),
    ("reward_math.py", "openrlhf", "openrlhf/reward_math.py"),
    ("tiny_cpu", "train", "tiny_cpu.yaml"),
    ("verl/tiny_cpu_grpo", None, "verl/tiny_cpu_grpo.yaml"),  # qualified: any command
    ("qwen2.5-14b-math-megatron-grpo", None, "verl/qwen2.5-14b-math-megatron-grpo.yaml"),  # unique: any folder
])
def test_resolve_picks_the_file(arg, host, want, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no recipes/ here: the name decides
    assert recipes.resolve(arg, host) == R / want


def test_resolve_errors_and_files_first(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"'tiny_cpu_cppo' is ambiguous: verl/tiny_cpu_cppo, openrlhf/tiny_cpu_cppo"):
        recipes.resolve("tiny_cpu_cppo")
    with pytest.raises(FileNotFoundError, match="no shipped recipe of that name.*`cppo-megatron recipes` lists them"):
        recipes.resolve("tiny_cpu", "verl")  # the embedded trainer's recipe is no veRL recipe
    with pytest.raises(ValueError, match="host 'deepspeed'"):
        recipes.resolve("x", "deepspeed")
    mine = tmp_path / "tiny_cpu.yaml"
    mine.write_text("seed: 1\n")
    assert recipes.resolve("tiny_cpu.yaml", "train") == Path("tiny_cpu.yaml")  # an existing file wins
    to_path = recipes.arg_type("train")
    assert to_path("tiny_cpu.yaml") == "tiny_cpu.yaml" and to_path("tiny_cpu_grpo") == str(R / "tiny_cpu_grpo.yaml")
    assert to_path("no_such") == "no_such"  # left to the command's loader, which names it
    assert recipes.arg_type("train", "verl")("tiny_cpu_megatron_cppo") == str(R / "verl/tiny_cpu_megatron_cppo.yaml")


def test_catalogue_describes_each_recipe():
    rows = {(r.host, r.name): r for r in recipes.catalogue()}
    assert len(rows) == len([p for p in R.rglob("*.yaml")])
    r = rows["verl", "qwen2.5-14b-math-megatron-cppo"]
    assert (r.kind, r.model, r.layout, r.cluster) == (
        "recipe", "Qwen/Qwen2.5-14B-Instruct", "Megatron TP4 x PP2 x DP2, vllm rollout", "2 nodes x 8 GPUs")
    r = rows["verl", "qwen2.5-1.5b-gsm8k-cppo"]
    assert (r.layout, r.cluster) == ("FSDP DP2, vllm rollout", "1 node x 2 GPUs")
    r = rows["verl", "tiny_cpu_megatron_cppo"]  # merged over the recipe it builds on (tiny_cpu_megatron_grpo)
    assert (r.model, r.layout, r.cluster) == ("tiny Qwen2 (warm-up export)", "Megatron TP2 x PP1 x DP2, vllm rollout",
                                              "CPU, 4 worker processes")
    r = rows["verl", "cpu_toy"]
    assert r.kind == "override" and r.layout.startswith("--cpu override: Megatron TP2 x PP1 x DP2")
    r = rows["openrlhf", "qwen2.5-7b-math-cppo"]
    assert (r.model, r.layout, r.cluster) == ("Qwen/Qwen2.5-7B-Instruct", "DeepSpeed ZeRO-3 x 3, vLLM 1 x TP1", "4 GPUs")
    r = rows["train", "tiny_cpu_megatron_pp2"]
    assert r.layout == "Megatron TP1 x PP2 x DP (--nproc / 2)" and r.model.startswith("qwen2 h128 x4 layers")
    assert [r.name for r in recipes.catalogue("openrlhf")] == sorted(p.stem for p in (R / "openrlhf").glob("*.yaml"))


def test_recipes_command(capsys):
    assert cli.main(["recipes"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["NAME", "HOST", "MODEL", "LAYOUT", "CLUSTER"]
    rows = [line for line in out[1:] if line.strip() and not line.startswith(" ") and " files in " not in line]
    assert len(rows) == len(list((REPO / "recipes").rglob("*.yaml")))
    assert cli.main(["recipes", "--host", "verl", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {r["host"] for r in rows} == {"verl"} and Path(rows[0]["path"]).is_file()
    assert cli.main(["recipes", "--show", "cpu_toy", "--host", "verl"]) == 0
    assert capsys.readouterr().out.startswith(f"# {R / 'verl/cpu_toy.yaml'}\ndescription:")
    assert cli.main(["recipes", "--show", "tiny_cpu_cppo"]) == 2  # ambiguous without --host: one line, exit 2
    assert "ambiguous" in capsys.readouterr().err


def test_commands_take_a_name(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", "tiny_cpu", "--print-recipe", "cppo.pruning_rate=0.5"]) == 0
    assert json.loads(capsys.readouterr().out)["cppo"]["pruning_rate"] == 0.5
    for name, argv in {"study": ["study", "tiny_cpu", "--seeds", "1"], "bench": ["bench", "speedup", "tiny_cpu"],
                       "export-hf": ["export-hf", "ckpt", "out", "--recipe", "tiny_cpu"]}.items():
        _, args = cli.parse_command(argv[0], argv[1:])
        assert args.recipe == str(R / "tiny_cpu.yaml"), name
    _, args = cli.parse_command("bench", ["verl", "tiny_cpu_grpo"])
    assert args.recipe == str(R / "verl/tiny_cpu_grpo.yaml")
    _, args = cli.parse_command("openrlhf", ["tiny_cpu_cppo", "--cpu", "cpu_toy"])
    assert (args.recipe, args.cpu) == (str(R / "openrlhf/tiny_cpu_cppo.yaml"), str(R / "openrlhf/cpu_toy.yaml"))


def test_verl_entry_point_takes_names(tmp_path, monkeypatch):
    pytest.importorskip("verl")
    from cppo_megatron.integrations.verl.main import recipe_args
    from cppo_megatron.integrations.verl.overrides import file_overrides

    monkeypatch.chdir(tmp_path)
    args = recipe_args(["qwen2.5-7b-math-megatron-cppo", "trainer.nnodes=2"], file_overrides("cpu_toy"))
    assert args[:2] == [f"--config-path={R / 'verl'}", "--config-name=qwen2.5-7b-math-megatron-cppo"]
    assert "++trainer.device='cpu'" in args and args[-1] == "trainer.nnodes=2"
    assert recipe_args(["trainer.nnodes=2", "+x=1"]) == ["trainer.nnodes=2", "+x=1"]  # overrides stay overrides
    with pytest.raises(FileNotFoundError, match="veRL recipe 'no_such' not found"):
        recipe_args(["no_such"])


def test_openrlhf_dry_run_by_name(tmp_path, monkeypatch, capsys):
    if importlib.util.find_spec("openrlhf") is None:
        pytest.skip("OpenRLHF is not installed here")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["openrlhf", "qwen2.5-1.5b-gsm8k-cppo", "--dry-run"]) == 0
    assert f"--reward.remote_url {R / 'openrlhf'}/reward_math.py" in capsys.readouterr().out
