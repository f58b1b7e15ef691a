"""Shared pieces of the megatron tests: a tiny random-init Qwen2 (no downloads) and data."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs the megatron extra")
transformers = pytest.importorskip("transformers", reason="needs the train extra")

VOCAB = 101  # not a multiple of 128 * tp: exercises the padded-vocabulary masking


def hf_config(**kw):
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=64)
    base.update(kw)
    return transformers.Qwen2Config(**base)


def hf_model(seed=0, **kw):
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(hf_config(**kw)).float().eval()
    # random-init biases are zero: give them values so the QKV bias layout is really tested
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def sequences(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(L),), generator=g) for L in lengths]


def hf_logprobs(model, seqs):
    """Reference per-token log-probs [L-1] from the HF model, one sequence at a time."""
    out = []
    with torch.no_grad():
        for s in seqs:
            logits = model(s[None]).logits[0, :-1].float()
            out.append(torch.log_softmax(logits, -1).gather(-1, s[1:, None]).squeeze(-1))
    return out


REPO = Path(__file__).resolve().parents[2]


def train_nproc(recipe: str, overrides: list, out: Path, *, nproc: int = 4, timeout: int = 300):
    """`cppo-megatron train RECIPE OVERRIDES out_dir=OUT --nproc N` from the repo root; the
    finished process and the metrics records it wrote (fails the test on a non-zero exit)."""
    cmd = [sys.executable, "-m", "cppo_megatron.cli", "train", recipe, *overrides, f"out_dir={out}", "--nproc",
           str(nproc)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return proc, records
