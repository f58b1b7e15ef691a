"""JSON-lines record files that survive a killed writer (the audit records of both hosts), and
the fingerprints both hosts' audits compare weights and optimizer states by.

A host process may be SIGKILLed at any moment (a preempted node, the resume tests' driver
kill, a dead worker). Each record is appended with one ``write`` on an ``O_APPEND`` descriptor,
so it lands whole or not at all in practice; a reader skips a final line without its newline
(a write cut short), never a complete one.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

__all__ = ["append", "complete_lines", "optimizer_fingerprint", "read", "tensor_hash"]


def append(path: str | os.PathLike, line: str) -> None:
    """Append ``line`` and a newline to ``path`` in a single write."""
    data = (line.rstrip("\n") + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        written = os.write(fd, data)
        while written < len(data):  # a short write (rare on regular files): finish it
            written += os.write(fd, data[written:])
    finally:
        os.close(fd)


def complete_lines(path: str | os.PathLike) -> list[str]:
    """The non-empty lines of ``path`` that end in a newline (a cut-off last line is left out)."""
    text = Path(path).read_text()
    lines = text.split("\n")
    return [ln for ln in lines[:-1] if ln.strip()]  # the part after the last newline is incomplete


def read(root: str | os.PathLike, kind: str | None = None) -> list[dict]:
    """Every record of the ``*.jsonl`` files under ``root`` (every process's), in time order (their
    ``time`` field); only those of ``kind`` when given. Both hosts' audits read theirs with it."""
    import json

    out = []
    for path in sorted(Path(root).glob("*.jsonl")):
        for line in complete_lines(path):
            rec = json.loads(line)
            if kind is None or rec["kind"] == kind:
                out.append(rec)
    return sorted(out, key=lambda r: r["time"])


def tensor_hash(t) -> str:
    """sha1 of a tensor's bytes, dtype and shape included (16 hex digits): equal hashes, equal
    tensors, bit for bit."""
    import torch

    t = t.detach().cpu().contiguous()
    h = hashlib.sha1(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _torch_optimizers(opt) -> list:
    """The torch optimizers inside a host's optimizer: itself, or the inner optimizer of each of
    megatron-core's chained / distributed / mixed-precision wrappers and DeepSpeed's ZeRO ones."""
    if opt is None:
        return []
    if hasattr(opt, "chained_optimizers"):
        return [o for c in opt.chained_optimizers for o in _torch_optimizers(c)]
    import torch

    if isinstance(opt, torch.optim.Optimizer):
        return [opt]
    return _torch_optimizers(getattr(opt, "optimizer", None))


def optimizer_fingerprint(opt) -> dict:
    """What an optimizer carries from step to step, per rank: sum |moments| (every tensor state
    but ``step``), the step counts, and the learning rates."""
    import torch

    moments, steps, lrs, tensors = 0.0, set(), [], 0
    for o in _torch_optimizers(opt):
        for state in o.state.values():
            for key, v in state.items():
                if hasattr(v, "to_local"):  # FSDP2: DTensor states, this rank's shard
                    v = v.to_local()
                if key == "step":
                    steps.add(float(v))
                elif isinstance(v, torch.Tensor):
                    moments += float(v.detach().double().abs().sum())
                    tensors += 1
        lrs += [float(g["lr"]) for g in o.param_groups]
    return {"moments": moments, "steps": sorted(steps), "lr": lrs, "tensors": tensors}
