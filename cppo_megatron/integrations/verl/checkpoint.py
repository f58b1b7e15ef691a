"""veRL's checkpoints, read from the plugin's side: where a run resumes and what to tell a user.

veRL 0.9.1 saves every ``trainer.save_freq`` steps (and at the last step) into
``trainer.default_local_dir/global_step_N/`` (``actor/``: model, optimizer, LR scheduler, RNG,
per rank; ``data.pt``: the train dataloader's state) and then writes
``latest_checkpointed_iteration.txt`` (``trainer_base.py:948-1025``, ``ray_trainer.py:983-1050``).
``trainer.resume_mode: auto`` (veRL's default) resumes from the newest folder; it restores
``global_steps``, the weights, optimizer and dataloader (``trainer_base.py:850-897``), so the
plugin's step-seeded decisions (``(cppo.seed, global_steps)``) continue where they were: the
plugin keeps no other state across steps (``stats`` holds one batch in flight).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = ["LATEST_FILE", "checkpoint_dir", "latest_step", "resume_hint"]

LATEST_FILE = "latest_checkpointed_iteration.txt"


def checkpoint_dir(config: Any) -> Path:
    """``trainer.default_local_dir`` as veRL resolves it (relative paths from the working dir)."""
    path = str(config.trainer.get("default_local_dir", "checkpoints"))
    return Path(path if os.path.isabs(path) else os.path.join(os.getcwd(), path))


def latest_step(directory: str | os.PathLike) -> int | None:
    """The step of the newest complete checkpoint in ``directory`` (veRL's tracker file), or None."""
    tracker = Path(directory) / LATEST_FILE
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    return int(text) if text.isdigit() else None


def resume_hint(config: Any) -> str:
    """One sentence: what rerunning this run does now, and how to resume it."""
    trainer = config.trainer
    save_freq = int(trainer.get("save_freq", -1) or -1)
    mode = str(trainer.get("resume_mode", "auto"))
    directory = checkpoint_dir(config)
    step = latest_step(directory)
    if step is None:
        if save_freq <= 0:
            return "This run saves no checkpoint (trainer.save_freq=-1): a rerun starts over."
        return f"No checkpoint was written yet (every {save_freq} steps into {directory}): a rerun starts over."
    folder = directory / f"global_step_{step}"
    if mode == "auto":
        return f"Rerun the same command to resume from step {step} ({folder}; trainer.resume_mode=auto)."
    return (f"To resume from step {step}, rerun with trainer.resume_mode=auto (or resume_mode=resume_path "
            f"trainer.resume_from_path={folder}); resume_mode={mode} starts over.")
