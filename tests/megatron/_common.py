"""Shared pieces of the megatron tests: a tiny random-init Qwen2 (no downloads) and data."""

import json
import os
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


def train_nproc(recipe: str, overrides: list, out: Path, *args: str, nproc: int = 4, timeout: int = 300,
                fault: str | None = None, expect: int = 0):
    """`cppo-megatron train RECIPE OVERRIDES out_dir=OUT --nproc N [ARGS]` from outside the
    repo; the finished process and the metrics records it wrote (fails the test unless it
    exits ``expect``). ``fault``: a ``CPPO_MEGATRON_FAULT`` for the ranks."""
    cmd = [sys.executable, "-m", "cppo_megatron.cli", "train", recipe, *overrides, f"out_dir={out}", "--nproc",
           str(nproc), *args]
    env = {k: v for k, v in os.environ.items() if k != "CPPO_MEGATRON_FAULT"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    if fault:
        env["CPPO_MEGATRON_FAULT"] = fault
    out.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(cmd, cwd=out.parent, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-6000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return proc, records
