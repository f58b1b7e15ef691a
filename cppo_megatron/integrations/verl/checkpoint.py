"""veRL's checkpoints, read from the plugin's side: where a run resumes and what to tell a user.

veRL 0.9.1 saves every ``trainer.save_freq`` steps (and at the last step) into
``trainer.default_local_dir/global_step_N/`` (``actor/``: model, optimizer, LR scheduler, RNG,
per rank; ``data.pt``: the train dataloader's state) and then writes
``latest_checkpointed_iteration.txt`` (``trainer_base.py:948-1025``, ``ray_trainer.py:983-1050``).
``trainer.resume_mode: auto`` (veRL's default) resumes from the newest folder; it restores
``global_steps``, the weights, optimizer and dataloader (``trainer_base.py:850-897``), so the
plugin's step-seeded decisions (``(cppo.seed, global_steps)``) continue where they were: the
plugin keeps no other state across steps (``stats`` holds one batch in flight).

Features that do keep state across steps (selective rollout, early stopping) write it into the
step's folder beside veRL's files, through ``state_file_seams``: one pair of wrappers for V1's
``_save_checkpoint`` / ``_load_checkpoint``, given what differs (the file, the state, what a
checkpoint without the file means).
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = ["LATEST_FILE", "checkpoint_dir", "latest_step", "resume_hint", "state_file_seams", "step_folder"]

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


def step_folder(trainer: Any, *, resuming: bool) -> str:
    """The absolute ``global_step_N`` folder veRL's V1 trainer saves this step into, or (``resuming``)
    the one it resumes from: ``trainer.resume_from_path`` under ``resume_mode=resume_path``."""
    cfg = trainer.config.trainer
    if resuming and str(cfg.get("resume_mode", "auto")) == "resume_path":
        folder = str(cfg.resume_from_path)
    else:
        folder = os.path.join(str(cfg.default_local_dir), f"global_step_{int(trainer.global_steps)}")
    return folder if os.path.isabs(folder) else os.path.join(os.getcwd(), folder)


Wrapper = Callable[[Callable[..., Any]], Callable[..., Any]]


def state_file_seams(
    file: str,
    what: str,
    enabled: Callable[[Any], bool],
    state_of: Callable[[Any], Any],
    *,
    missing: Callable[[Any], str],
    loaded: Callable[[Any, Any, int], None] | None = None,
) -> tuple[Wrapper, Wrapper]:
    """The wrappers (``wrap``'s makers) of V1's ``_save_checkpoint`` and ``_load_checkpoint`` that keep
    one feature's state in ``global_step_N/<file>`` beside veRL's files.

    Saving writes ``state_of(trainer).state_dict()`` before veRL's own save, so the tracker file veRL
    writes last (``latest_checkpointed_iteration.txt``) never names a step without it. Loading, after
    veRL's own (which restored ``global_steps``; 0 means nothing was resumed), restores it with
    ``load_state_dict`` and calls ``loaded(trainer, state, step)`` if given; a checkpoint without the file calls
    ``missing(trainer)`` and warns that it has no ``what`` state, followed by what ``missing`` returns.
    Both are inert where ``enabled(config)`` is false.

    Args:
        file: the state's file name inside the step folder.
        what: the feature, as the warning names it ("selective-rollout").
        enabled: whether the feature is on, from ``trainer.config``.
        state_of: the trainer's state object (``state_dict`` / ``load_state_dict``).
        missing: called when the resumed checkpoint has no ``file``: sets what an unknown state
            means and returns what the run does without it (the warning's end).
        loaded: called after a state was restored (e.g. to publish it).
    """
    if not file or os.sep in file:
        raise ValueError(f"state_file_seams: file={file!r}; pass a bare file name such as 'cppo_selective.pt'")

    def saving(original):
        @functools.wraps(original)
        def _save_checkpoint(self, *args, **kwargs):
            if enabled(self.config):
                folder = step_folder(self, resuming=False)
                os.makedirs(folder, exist_ok=True)
                # before veRL writes latest_checkpointed_iteration.txt: a checkpoint it resumes from has it
                torch.save(state_of(self).state_dict(), os.path.join(folder, file))
            return original(self, *args, **kwargs)

        return _save_checkpoint

    def loading(original):
        @functools.wraps(original)
        def _load_checkpoint(self, *args, **kwargs):
            out = original(self, *args, **kwargs)
            step = int(getattr(self, "global_steps", 0))
            if enabled(self.config) and step > 0:
                path = os.path.join(step_folder(self, resuming=True), file)
                if os.path.isfile(path):
                    state = state_of(self)
                    state.load_state_dict(torch.load(path, weights_only=False))
                    if loaded is not None:
                        loaded(self, state, step)
                else:
                    warnings.warn(f"cppo: checkpoint {os.path.dirname(path)} has no {what} state ({file}); "
                                  f"{missing(self)}", stacklevel=2)
            return out

        return _load_checkpoint

    return saving, loading
