"""A tiny Llama model with a byte-level BPE tokenizer and a ChatML template, written as a GGUF
file with the ``gguf`` package (SmolLM2-135M's layout at 35k parameters), so the GGUF path of
the trainer and of ``gpu-check --study`` (dequantize, save as an HF directory, train) runs in
seconds in tests, where the real 94 MB file would take minutes."""

from __future__ import annotations

from pathlib import Path

import numpy as np

CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _byte_symbols() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes (what byte-level BPE vocabularies hold)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs, strict=True))]


def write_tiny_gguf(path: str | Path, *, hidden: int = 32, layers: int = 2, heads: int = 2, kv_heads: int = 1,
                    ffn: int = 64, seed: int = 0) -> Path:
    """Write the model to ``path`` (float32 tensors, random weights) and return the path."""
    import gguf

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # two merges: a one-element array would come back from transformers' GGUF reader as a bare string
    tokens = [*_byte_symbols(), "ĠĠ", "ĠĠĠ", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-test-llama")
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(hidden // heads)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * (vocab - 3) + [3, 3, 3])
    w.add_token_merges(["Ġ Ġ", "ĠĠ Ġ"])
    w.add_bos_token_id(vocab - 3)
    w.add_eos_token_id(vocab - 2)
    w.add_pad_token_id(vocab - 1)
    w.add_chat_template(CHATML)
    rng = np.random.default_rng(seed)
    hd = hidden // heads
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,), "output.weight": (vocab, hidden)}
    for i in range(layers):
        shapes.update({f"blk.{i}.attn_norm.weight": (hidden,), f"blk.{i}.ffn_norm.weight": (hidden,),
                       f"blk.{i}.attn_q.weight": (hidden, hidden), f"blk.{i}.attn_k.weight": (kv_heads * hd, hidden),
                       f"blk.{i}.attn_v.weight": (kv_heads * hd, hidden),
                       f"blk.{i}.attn_output.weight": (hidden, hidden), f"blk.{i}.ffn_gate.weight": (ffn, hidden),
                       f"blk.{i}.ffn_up.weight": (ffn, hidden), f"blk.{i}.ffn_down.weight": (hidden, ffn)})
    for name, shape in shapes.items():
        value = np.ones(shape) if name.endswith("norm.weight") else rng.standard_normal(shape) * 0.02
        w.add_tensor(name, value.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
