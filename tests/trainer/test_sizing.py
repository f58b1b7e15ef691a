"""``cppo-megatron train RECIPE --nproc N --dry-run``: each rank's memory, by value, and the refusal.

The cluster recipes (sized from ``recipes/models/*.json``, no weights) print the terms
``megatron.memory`` computes for their layout; a layout that cannot fit on its GPUs exits 2 with
the numbers; a real launch is refused up front the same way.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cppo_megatron.cli import main
from cppo_megatron.megatron.memory import shard_parameters
from cppo_megatron.trainer.config import load_recipe
from cppo_megatron.trainer.sizing import estimate, machine_memory_gb

REPO = Path(__file__).resolve().parents[2]

R7 = str(REPO / "recipes" / "qwen2.5-7b-math-megatron.yaml")
A7 = str(REPO / "recipes" / "models" / "qwen2.5-7b-instruct.json")
R15 = str(REPO / "recipes" / "qwen2.5-1.5b-gsm8k-megatron.yaml")
A15 = str(REPO / "recipes" / "models" / "qwen2.5-1.5b-instruct.json")


def _table(out: str) -> dict:
    """rank kind -> {column: GB} from the dry run's table."""
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("rank kind"))
    cols = lines[head].split()[3:]  # after "rank kind ranks"
    rows = {}
    for line in lines[head + 1:]:
        if not line or line.startswith(" "):
            break
        *name, ranks = line.split()[: -len(cols)]
        rows[" ".join(name)] = {"ranks": int(ranks), **dict(zip(cols, map(float, line.split()[-len(cols):])))}
    return rows


def test_7b_recipe_dry_run_by_value(capsys):
    assert main(["train", R7, "--nproc", "8", "--dry-run", "--model-config", A7]) == 0
    out = capsys.readouterr().out
    rows = _table(out)
    assert {k: v["ranks"] for k, v in rows.items()} == {"rank 0": 1, "generating rank": 7}
    n = shard_parameters(_arch7(), tp=4)
    for row in rows.values():
        assert row["weights"] == pytest.approx(2 * n / 1e9, abs=1e-3)  # bf16 shard
        assert row["gradients"] == pytest.approx(4 * n / 1e9, abs=1e-3)  # float32 grad buffer
        assert row["optimizer"] == pytest.approx(12 * n / 2 / 1e9, abs=1e-3)  # master + Adam over DP 2
        assert row["reference"] == pytest.approx(2 * n / 1e9, abs=1e-3)  # beta 0.04
        terms = ("weights", "gradients", "optimizer", "reference", "activations", "engine")
        assert row["total"] == pytest.approx(sum(row[t] for t in terms), abs=5e-3)
    # vLLM's share of the GPU on every rank; rank 0 also the bf16 HF copy (7.62B x 2 B)
    assert rows["generating rank"]["engine"] == pytest.approx(0.25 * 80, abs=1e-3)
    assert rows["rank 0"]["engine"] == pytest.approx(20 + 2 * 7_615_616_512 / 1e9, abs=1e-3)
    assert "fits" in out.splitlines()[-1] and "NOT" not in out


def _arch7():
    import transformers

    data = {k: v for k, v in json.load(open(A7)).items() if not k.startswith("_") and k != "model_type"}
    return transformers.Qwen2Config(**data)


def test_a_layout_that_cannot_fit_is_refused_with_the_numbers(capsys):
    # float32 shards and the plain optimizer: 16 B of state per parameter on every DP rank
    code = main(["train", R7, "--nproc", "8", "--dry-run", "--model-config", A7, "model.dtype=float32",
                 "megatron.distributed_optimizer=false"])
    captured = capsys.readouterr()
    assert code == 2
    assert "does NOT fit" in captured.out
    err = captured.err
    assert "this run does not fit: a rank 0 needs" in err and "but has 80.0 GB" in err
    n = shard_parameters(_arch7(), tp=4)
    assert f"optimizer {8 * n / 1e9:.2f}" in err and f"weights {4 * n / 1e9:.2f}" in err


def test_an_hf_dir_is_sized_from_its_config_json(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({k: v for k, v in json.load(open(A15)).items()
                                                   if not k.startswith("_")}))
    recipe = load_recipe(R15, [f"model.path={model}", "megatron.device_memory_gb=2"])
    assert machine_memory_gb(recipe, 2) == (2.0, "megatron.device_memory_gb")
    assert estimate(recipe, 2, device_gb=2.0).model_parameters == 1_543_714_304
    code = main(["train", R15, "--nproc", "2", "--dry-run", f"model.path={model}", "megatron.device_memory_gb=2"])
    assert code == 2 and "this run does not fit" in capsys.readouterr().err


def test_the_launch_refuses_before_starting_any_process(tmp_path, capsys, monkeypatch):
    import cppo_megatron.trainer.launch as launch

    started = []
    monkeypatch.setattr(launch, "launch", lambda args: started.append(args) or 0)
    code = main(["train", str(REPO / "recipes" / "tiny_cpu_megatron.yaml"), "--nproc", "4",
                 f"out_dir={tmp_path}", "megatron.device_memory_gb=0.1"])
    err = capsys.readouterr().err
    assert code == 2 and not started
    assert "this run does not fit: a rank 0 needs" in err and "but has 0.1 GB (megatron.device_memory_gb" in err


def test_the_tiny_megatron_recipe_fits_here_and_counts_the_hf_engine_only_where_it_generates(capsys):
    assert main(["train", str(REPO / "recipes" / "tiny_cpu_megatron.yaml"), "--nproc", "4", "--dry-run"]) == 0
    rows = _table(capsys.readouterr().out)
    # TP 2 x DP 2: rank 0 and the other DP group's first rank generate; the two TP peers do not
    assert {k: v["ranks"] for k, v in rows.items()} == {"rank 0": 1, "generating rank": 1, "other rank": 2}
    assert rows["other rank"]["engine"] == 0 and rows["rank 0"]["engine"] > 0
    assert rows["rank 0"]["optimizer"] == pytest.approx(2 * rows["rank 0"]["weights"], abs=2e-3)  # fp32 Adam
