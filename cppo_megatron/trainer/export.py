"""Export an embedded-trainer model (a warm-up or any checkpoint) as an HF model directory
that other frameworks load with ``from_pretrained``: config, safetensors weights and a real
HF tokenizer (``tokenizer.json`` + chat template).

The embedded trainer's from-scratch models use ``CharTokenizer`` (one token per character,
ids 0-2 for pad/bos/eos). The exported tokenizer is a byte-level BPE without merges whose
ids equal the character tokenizer's, so the trained embedding rows keep their meaning:

    id 0 <|endoftext|> (pad, unk)   id 1 <|im_start|> (bos)   id 2 <|im_end|> (eos)
    id 3.. the alphabet, in order    then Ċ ("\\n") and Ġ (" ") when the alphabet lacks them

Why those names: transformers loads a ``qwen2`` model directory's tokenizer as the byte-level
``Qwen2Tokenizer``, and veRL's agent loop (Qwen token handling) requires "\\n" to be exactly one
token and ``<|im_end|>`` to exist. The chat template renders ``bos + message contents``, the
exact prompt the embedded trainer trained on (``CharTokenizer.prompt_ids``).

The rows added for Ċ/Ġ copy the pad row: pad is never a training target, so its logit was
pushed down by every softmax and the new tokens start as unlikely as pad is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .tokenizer import SPECIALS, CharTokenizer

__all__ = ["EXPORT_SPECIALS", "ExportResult", "char_to_hf_tokenizer", "export_hf", "export_run", "export_warmup"]

# CharTokenizer's pad, bos, eos in that order (ids 0, 1, 2)
EXPORT_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"
_NEEDED = ("\n", " ")  # veRL's Qwen handling needs "\n" as one token; " " keeps spaces encodable


@dataclass(frozen=True)
class ExportResult:
    """What ``export_hf`` wrote: the directory, the tokenizer's size, the ids added beyond the
    source vocabulary (their embedding rows copy pad's), and the parameter count."""

    out_dir: Path
    vocab_size: int
    added_tokens: tuple[str, ...]
    num_parameters: int


def _byte_level_char(ch: str) -> str:
    """The byte-level BPE symbol of a character of code 0-255 (GPT-2's bytes-to-unicode table, whose
    256 symbols are ``tokenizers``' ``ByteLevel.alphabet()``: tests/trainer/test_export.py checks the
    mapping is onto it). ``char_to_hf_tokenizer`` refuses any other character before it gets here."""
    b = ord(ch)
    if 33 <= b <= 126:
        return ch
    # GPT-2's mapping: bytes outside the printable ranges become chr(256 + n) in byte order
    printable = set(range(33, 127)) | set(range(161, 173)) | set(range(174, 256))
    n = sum(1 for x in range(b) if x not in printable)
    return ch if b in printable else chr(256 + n)


def char_to_hf_tokenizer(tok: CharTokenizer):
    """An HF ``PreTrainedTokenizerFast`` whose ids match ``tok``'s, plus the added symbols.

    Returns (hf_tokenizer, added) where ``added`` lists the characters appended after the
    source vocabulary. Only ASCII alphabets map one character to one byte-level token; a byte
    CharTokenizer (alphabet None) maps byte b to its byte-level symbol.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if not isinstance(tok, CharTokenizer):
        raise TypeError(f"export: expected the trainer's CharTokenizer, got {type(tok).__name__}")
    chars = tok.itos[len(SPECIALS):]
    for c in chars:
        if len(c) != 1 or ord(c) > 255 or (not tok.byte_level and ord(c) > 127):
            raise ValueError(f"export: alphabet character {c!r} is not ASCII; only ASCII alphabets map to one "
                             "token each")
    vocab = {s: i for i, s in enumerate(EXPORT_SPECIALS)}
    for c in chars:
        vocab[_byte_level_char(c)] = len(vocab)
    added = []
    for c in _NEEDED:
        sym = _byte_level_char(c)
        if sym not in vocab:
            vocab[sym] = len(vocab)
            added.append(c)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=EXPORT_SPECIALS[0]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in EXPORT_SPECIALS])
    hf = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=EXPORT_SPECIALS[0],
        unk_token=EXPORT_SPECIALS[0],
        bos_token=EXPORT_SPECIALS[1],
        eos_token=EXPORT_SPECIALS[2],
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf, tuple(added)


def export_hf(model, tok, out_dir: str | Path, *, provenance: dict | None = None) -> ExportResult:
    """Write ``model`` (an HF ``*ForCausalLM`` built by the embedded trainer) and an HF version
    of ``tok`` (a ``CharTokenizer``) to ``out_dir``; returns an ``ExportResult``.

    The model is copied (the caller's is not resized). With ``provenance`` a
    ``cppo_export.json`` records where the weights came from.
    """
    import copy

    out = Path(out_dir)
    hf_tok, added = char_to_hf_tokenizer(tok)
    if model.get_input_embeddings().weight.shape[0] != tok.vocab_size:
        raise ValueError(
            f"export: the model has {model.get_input_embeddings().weight.shape[0]} embedding rows but the "
            f"tokenizer {tok.vocab_size} tokens; was the checkpoint built for another alphabet?"
        )
    m = copy.deepcopy(model).cpu().float()
    new_size = tok.vocab_size + len(added)
    if added:
        emb = m.get_input_embeddings().weight.data
        rows = emb[tok.pad_id].unsqueeze(0).expand(len(added), -1)
        m.resize_token_embeddings(new_size, mean_resizing=False)
        with torch.no_grad():
            m.get_input_embeddings().weight[tok.vocab_size:] = rows
            head = m.get_output_embeddings()
            if head is not None and head.weight.data_ptr() != m.get_input_embeddings().weight.data_ptr():
                head.weight[tok.vocab_size:] = head.weight[tok.pad_id]
    m.config.vocab_size = new_size
    m.config.pad_token_id, m.config.bos_token_id, m.config.eos_token_id = tok.pad_id, tok.bos_id, tok.eos_id
    m.generation_config.pad_token_id = tok.pad_id
    m.generation_config.bos_token_id = tok.bos_id
    m.generation_config.eos_token_id = tok.eos_id
    out.mkdir(parents=True, exist_ok=True)
    m.save_pretrained(out, safe_serialization=True)
    hf_tok.save_pretrained(out)
    if provenance is not None:
        (out / "cppo_export.json").write_text(json.dumps(provenance, indent=2, sort_keys=True) + "\n")
    return ExportResult(out, new_size, added, sum(p.numel() for p in m.parameters()))


def export_run(checkpoint: str | Path, out_dir: str | Path, *, recipe_path: str | Path | None = None) -> ExportResult:
    """Export a run's weights (``RUN_DIR/warmup.pt``, ``final.pt`` or a checkpoint directory
    ``checkpoints/step_NNNNNN``) using the run's ``recipe.yaml`` (or ``recipe_path``) to
    rebuild the model and tokenizer it was trained with."""
    from ..tasks import build_task
    from .config import load_recipe
    from .models import build_model

    ckpt = Path(checkpoint)
    if ckpt.is_dir() and (ckpt / "trainer.pt").is_file():  # a checkpoint directory (checkpoint.py)
        if (ckpt / "policy_rank00001.pt").exists():
            raise ValueError(f"export-hf: {ckpt} is a backend=megatron checkpoint (per-rank shards); export the "
                             "run's final.pt or warmup.pt, which hold the full HF weights")
        ckpt = ckpt / "policy_rank00000.pt"
    if not ckpt.is_file():
        raise FileNotFoundError(f"export-hf: {ckpt} is not a file (expected RUN_DIR/warmup.pt, final.pt or "
                                "RUN_DIR/checkpoints/step_NNNNNN)")
    rpath = Path(recipe_path) if recipe_path else ckpt.parent / "recipe.yaml"
    for up in (ckpt.parent.parent, ckpt.parent.parent.parent):  # checkpoints/step_N(/policy_rank0.pt)
        if not rpath.is_file() and not recipe_path and (up / "recipe.yaml").is_file():
            rpath = up / "recipe.yaml"
    if not rpath.is_file():
        raise FileNotFoundError(f"export-hf: no recipe at {rpath}; pass --recipe RECIPE.yaml (the run's recipe)")
    recipe = load_recipe(rpath)
    if recipe.model.source != "config":
        raise ValueError(
            f"export-hf: model.source={recipe.model.source!r} in {rpath}: only from-scratch models "
            "(source: config, a character tokenizer) need exporting; an hf_dir model already is one"
        )
    task = build_task(recipe.task)
    model, tok = build_model(recipe.model, task.alphabet, recipe.seed)
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    if isinstance(state, dict) and "model" in state and isinstance(state["model"], dict):
        state = state["model"]  # a training checkpoint rather than a bare state dict
    model.load_state_dict(state)
    return export_hf(model, tok, out_dir, provenance={"checkpoint": str(ckpt.resolve()), "recipe": str(rpath.resolve()),
                                                       "task": recipe.task.name})


def export_warmup(warmup_recipe: str | Path, model_dir: str | Path, *, overrides: tuple[str, ...] = ()) -> ExportResult:
    """Run ``warmup_recipe``'s supervised warm-up (no RL step) and export the result as an HF
    model directory — the start model other frameworks' CPU runs load. The warm-up run lives
    beside the model (``MODEL_DIR/../warmup``) with its report and ``warmup.pt``."""
    from .config import load_recipe
    from .loop import Trainer

    model_dir = Path(model_dir)
    run_dir = model_dir.parent / "warmup"
    recipe = load_recipe(Path(warmup_recipe), [f"out_dir={run_dir}", *overrides])
    if not recipe.warmup.enabled:
        raise ValueError(f"warm-up recipe {warmup_recipe}: its warm-up is disabled; the start model would be random")
    trainer = Trainer(recipe)
    trainer.prepare()
    return export_run(run_dir / "warmup.pt", model_dir)
