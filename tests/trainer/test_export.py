"""export-hf: the exported HF directory is the same model with a real tokenizer whose ids
and chat template reproduce the embedded trainer's prompts exactly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from cppo_megatron.tasks import build_task
    from cppo_megatron.trainer.config import load_recipe
    from cppo_megatron.trainer.models import build_model

    r = load_recipe(ROOT / "recipes" / "tiny_cpu.yaml", ["model.hidden_size=32", "model.num_layers=1"])
    model, tok = build_model(r.model, build_task(r.task).alphabet, seed=3)
    with torch.no_grad():  # make the pad row distinctive: the added tokens must copy it
        model.get_input_embeddings().weight[tok.pad_id] = -0.5
    return model, tok


def test_exported_model_and_tokenizer_match_the_trainer(trained, tmp_path):
    from cppo_megatron.trainer.export import export_hf

    model, tok = trained
    res = export_hf(model, tok, tmp_path)
    assert res.added_tokens == ("\n", " ") and res.vocab_size == tok.vocab_size + 2
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    for q in ("47+85=", "10-99=", "3*4="):
        chat = hf_tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True, add_generation_prompt=True)
        ids = chat["input_ids"] if hasattr(chat, "keys") else chat
        assert list(ids) == tok.prompt_ids(q)  # the prompt the warm-up trained on, id for id
        assert hf_tok.encode(q, add_special_tokens=False) == tok.encode(q)
    # veRL's Qwen token handling: "\n" is one token, <|im_end|> exists and is the eos
    assert hf_tok.encode("\n", add_special_tokens=False) == [tok.vocab_size]
    assert hf_tok.convert_tokens_to_ids("<|im_end|>") == tok.eos_id == hf_tok.eos_token_id
    assert hf_tok.pad_token_id == tok.pad_id and hf_tok.bos_token_id == tok.bos_id
    assert hf_tok.decode(tok.encode("123") + [tok.eos_id], skip_special_tokens=True) == "123"
    x = torch.tensor([tok.prompt_ids("47+85=")])
    with torch.no_grad():
        a, b = model(x).logits, hf_model(x).logits
    assert torch.equal(a, b[..., : tok.vocab_size])  # the same network on the old ids
    emb = hf_model.get_input_embeddings().weight
    assert torch.equal(emb[tok.vocab_size:], emb[tok.pad_id].expand(2, -1))  # new rows copy pad's
    assert hf_model.config.eos_token_id == tok.eos_id


def test_export_refuses_mismatched_vocabularies(trained, tmp_path):
    from cppo_megatron.trainer.export import export_hf
    from cppo_megatron.trainer.tokenizer import CharTokenizer

    model, _ = trained
    with pytest.raises(ValueError, match="embedding rows"):
        export_hf(model, CharTokenizer("0123"), tmp_path)
    with pytest.raises(ValueError, match="not ASCII"):
        export_hf(model, CharTokenizer("0123456789+-*×"), tmp_path)


def test_export_hf_command_from_a_run_directory(trained, tmp_path):
    from cppo_megatron.trainer.config import load_recipe, recipe_to_dict

    model, tok = trained
    run = tmp_path / "run"
    run.mkdir()
    r = load_recipe(ROOT / "recipes" / "tiny_cpu.yaml", ["model.hidden_size=32", "model.num_layers=1"])
    from omegaconf import OmegaConf

    (run / "recipe.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(recipe_to_dict(r))))
    torch.save(model.state_dict(), run / "warmup.pt")
    out = subprocess.run([sys.executable, "-m", "cppo_megatron.cli", "export-hf", str(run / "warmup.pt"),
                          str(tmp_path / "hf")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "vocabulary 19" in out.stdout
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert torch.equal(loaded.model.norm.weight, model.model.norm.weight)
    bad = subprocess.run([sys.executable, "-m", "cppo_megatron.cli", "export-hf", str(tmp_path / "nope.pt"),
                          str(tmp_path / "x")], capture_output=True, text=True)
    assert bad.returncode == 2 and "is not a file" in bad.stderr and "Traceback" not in bad.stderr


def test_export_run_takes_a_checkpoint_directory(tmp_path):
    """A trainer checkpoint (checkpoints/step_NNNNNN/) exports the policy it holds."""
    from cppo_megatron.trainer import Trainer
    from cppo_megatron.trainer.config import load_recipe
    from cppo_megatron.trainer.export import export_run
    from tests.recipes import MICRO

    run = tmp_path / "run"
    t = Trainer(load_recipe(ROOT / "recipes" / "tiny_cpu.yaml", MICRO + ["train.steps=1", f"out_dir={run}"]))
    t.run()
    res = export_run(run / "checkpoints" / "step_000001", tmp_path / "hf")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(res.out_dir)
    ours = t.model.state_dict()["model.embed_tokens.weight"]
    assert torch.equal(hf_model.state_dict()["model.embed_tokens.weight"][: ours.shape[0]], ours)


def test_every_byte_has_its_own_byte_level_symbol():
    """The mapping export's tokenizer is built with: the 256 bytes onto tokenizers' 256 byte-level
    symbols, one each, printable ASCII as itself ("\\n" is Ċ, " " is Ġ, as GPT-2's table has them)."""
    from tokenizers.pre_tokenizers import ByteLevel

    from cppo_megatron.trainer.export import _byte_level_char

    symbols = [_byte_level_char(chr(b)) for b in range(256)]
    assert sorted(symbols) == sorted(ByteLevel.alphabet()) and len(set(symbols)) == 256
    assert (symbols[ord("\n")], symbols[ord(" ")], symbols[ord("7")]) == ("Ċ", "Ġ", "7")


def test_export_needs_the_trainers_character_tokenizer(trained, tmp_path):
    from cppo_megatron.trainer.export import export_hf

    model, _ = trained
    with pytest.raises(TypeError, match="^export: expected the trainer's CharTokenizer, got SimpleNamespace$"):
        export_hf(model, SimpleNamespace(vocab_size=19), tmp_path)
    assert not any(tmp_path.iterdir())


def _tiny_model(alphabet, *overrides):
    from cppo_megatron.trainer.config import load_recipe
    from cppo_megatron.trainer.models import build_model

    r = load_recipe(ROOT / "recipes" / "tiny_cpu.yaml", ["model.hidden_size=16", "model.num_layers=1",
                                                          "model.num_heads=2", "model.num_kv_heads=2",
                                                          "model.intermediate_size=32", *overrides])
    return build_model(r.model, alphabet, seed=3)


def test_a_byte_level_model_exports_with_no_added_token(tmp_path):
    """A byte CharTokenizer (alphabet None) already has "\\n" and " ": nothing is added or resized."""
    from cppo_megatron.trainer.export import export_hf

    model, tok = _tiny_model(None)
    res = export_hf(model, tok, tmp_path)
    assert res.added_tokens == () and res.vocab_size == tok.vocab_size == 259
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert hf_tok.encode("a b\n", add_special_tokens=False) == tok.encode("a b\n")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert hf_model.get_input_embeddings().weight.shape[0] == 259
    assert torch.equal(hf_model.get_input_embeddings().weight, model.get_input_embeddings().weight)


def test_an_untied_output_head_gets_the_pad_rows_too(tmp_path):
    """With ``model.tie_embeddings=false`` the head has rows of its own: the added tokens' logits start
    as pad's (its output row copied), as their embeddings copy pad's input row."""
    from cppo_megatron.tasks import build_task
    from cppo_megatron.trainer.config import load_recipe
    from cppo_megatron.trainer.export import export_hf

    alphabet = build_task(load_recipe(ROOT / "recipes" / "tiny_cpu.yaml").task).alphabet
    model, tok = _tiny_model(alphabet, "model.tie_embeddings=false")
    with torch.no_grad():
        model.get_output_embeddings().weight[tok.pad_id] = 0.25
        model.get_input_embeddings().weight[tok.pad_id] = -0.5
    res = export_hf(model, tok, tmp_path)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    head, emb = hf_model.get_output_embeddings().weight, hf_model.get_input_embeddings().weight
    n = len(res.added_tokens)
    assert n == 2 and head.data_ptr() != emb.data_ptr()
    assert torch.equal(head[tok.vocab_size:], torch.full((n, head.shape[1]), 0.25))
    assert torch.equal(emb[tok.vocab_size:], torch.full((n, emb.shape[1]), -0.5))
    assert torch.equal(head[: tok.vocab_size], model.get_output_embeddings().weight)
    assert model.get_output_embeddings().weight.shape[0] == tok.vocab_size  # the caller's model is not resized
