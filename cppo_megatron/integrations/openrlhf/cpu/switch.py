"""Whether the OpenRLHF CPU mode acts in this process: asked for (``CPPO_OPENRLHF_CPU=1``) and
no CUDA device. Its own module because the package's ``install`` and the vLLM entry point
(``vllm_sync.register``) both ask it."""

from __future__ import annotations

import os

__all__ = ["ENV", "enabled", "has_cuda"]

ENV = "CPPO_OPENRLHF_CPU"


def enabled() -> bool:
    """True when the run asked for the CPU mode (``CPPO_OPENRLHF_CPU=1``)."""
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
