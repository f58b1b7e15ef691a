"""Pad an exported HF model's vocabulary to a multiple, for tensor parallelism.

megatron-core splits the embedding and output layer by rows over the TP ranks and asserts the
vocabulary divides (``megatron/core/tensor_parallel/utils.py:118``); veRL builds mbridge without
``make_vocab_size_divisible_by`` (``verl/models/mcore/mbridge.py``), so the HF model itself must
have a divisible row count — as real checkpoints do (Qwen2.5: 151936 rows for 151665 tokens).
The tiny exported models have 19 rows. ``pad_vocab`` appends rows that copy the pad token's
(pad is never a training target, so its logit was pushed down by every softmax: the new ids
start as unlikely as pad, the rule ``trainer/export.py`` uses for the tokens it adds).

The tokenizer gets one special token per new row (``<|cppo_vocab_pad_N|>``), so every row is a
token: veRL's vLLM rollout masks the logits of rows past ``len(tokenizer)``
(``verl/workers/rollout/vllm_rollout/utils.py:126``, ``vllm_async_server.py:503``) while the actor's
log-probs cover every row, so on a model whose padded rows carry probability mass the rollout and
the actor disagree by that mass. A random-init export (the CI start model) puts about 20% there
(5 of 24 rows at uniform logits; measured ``training/rollout_probs_diff_max`` 0.029, mean 0.012);
a trained model puts almost none (Qwen2.5's 271 padded rows). With the rows named, both sides
cover the same 24 tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import cast

import torch

__all__ = ["pad_vocab"]


PAD_TOKEN = "<|cppo_vocab_pad_{}|>"


def _name_new_rows(model_dir: Path, rows: int, target: int) -> int:
    """Add a special token for each of the rows ``rows..target-1`` to the tokenizer in ``model_dir``
    (when it has one and covers exactly the old rows); returns how many were added."""
    if not (model_dir / "tokenizer.json").is_file() and not (model_dir / "tokenizer_config.json").is_file():
        return 0
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    if len(tok) != rows:
        return 0  # a tokenizer that does not map onto the rows one to one: leave it as it is
    added = tok.add_special_tokens({"additional_special_tokens": [PAD_TOKEN.format(i) for i in range(rows, target)]},
                                   replace_extra_special_tokens=False)
    ids = tok.convert_tokens_to_ids([PAD_TOKEN.format(i) for i in range(rows, target)])
    if added != target - rows or ids != list(range(rows, target)):
        raise RuntimeError(f"pad_vocab: the tokenizer in {model_dir} gave the new rows ids {ids}, "
                           f"not {rows}..{target - 1}")
    tok.save_pretrained(model_dir)
    return added


def pad_vocab(model_dir: str | Path, multiple: int) -> int:
    """Pad ``model_dir``'s embedding (and untied output) rows in place to a multiple of
    ``multiple``; returns the new row count (unchanged when it already divides)."""
    from transformers import AutoModelForCausalLM

    if int(multiple) < 1:
        raise ValueError(f"pad_vocab: multiple={multiple!r}; need an int >= 1 (e.g. the TP size, or 8)")
    model_dir = Path(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    emb = cast(torch.Tensor, model.get_input_embeddings().weight)  # nn.Module.__getattr__ is typed Tensor | Module
    rows = int(emb.shape[0])
    target = -(-rows // int(multiple)) * int(multiple)
    if target == rows:
        return rows
    pad_id = model.config.pad_token_id
    if pad_id is None:
        raise ValueError(f"pad_vocab: {model_dir}/config.json has no pad_token_id to copy the new rows from")
    head = model.get_output_embeddings()
    tied = head is not None and head.weight.data_ptr() == emb.data_ptr()
    model.resize_token_embeddings(target, mean_resizing=False)
    with torch.no_grad():
        new_emb = cast(torch.Tensor, model.get_input_embeddings().weight)
        new_emb[rows:] = new_emb[pad_id]
        if head is not None and not tied:
            new_head: torch.Tensor = model.get_output_embeddings().weight
            new_head[rows:] = new_head[pad_id]
    model.config.vocab_size = target
    model.save_pretrained(model_dir, safe_serialization=True)
    named = _name_new_rows(model_dir, rows, target)
    note = model_dir / "cppo_export.json"
    info = json.loads(note.read_text()) if note.is_file() else {}
    info["vocab_padded"] = {"from": rows, "to": target, "multiple": int(multiple), "rows_copy": "pad",
                            "tokens_added": named}
    note.write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    return target
