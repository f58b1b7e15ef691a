"""Checkpoints: everything a resumed run needs to continue the same run."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Optional

import numpy as np
import torch

KEEP_LAST = 3


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(out_dir: Path, step: int, payload: dict) -> Path:
    ckpt_dir = out_dir / "checkpoints"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    path = ckpt_dir / f"step_{step:06d}.pt"
    tmp = path.with_suffix(".tmp")
    torch.save({**payload, "step": step, "rng": rng_state()}, tmp)
    os.replace(tmp, path)  # atomic: a crash never leaves a half-written checkpoint
    for old in sorted(ckpt_dir.glob("step_*.pt"))[:-KEEP_LAST]:
        old.unlink()
    return path


def latest_checkpoint(out_dir: Path) -> Optional[Path]:
    found = sorted((out_dir / "checkpoints").glob("step_*.pt"))
    return found[-1] if found else None


def load_checkpoint(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)
