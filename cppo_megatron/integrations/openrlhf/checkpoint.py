"""Which OpenRLHF step a process resumes at: the plugin's per-step state across a restart.

OpenRLHF 0.11.2 resumes with ``--ckpt.load_enable``: each actor rank loads the DeepSpeed
checkpoint named by ``{ckpt.path}/_actor/latest`` (``trainer/ray/ppo_actor.py:574-578``, DeepSpeed's
``engine.load_checkpoint`` reads the tag from that file) and the trainer restarts its loop at the
``global_step`` stored with it (``trainer/ppo_trainer.py:434-440,509-511``), with the prompt
dataloader's state. Those tags are ``global_step{N}`` (``ppo_trainer.py:398``; ``best_global_step{N}``
for a best-metric checkpoint, ``:367``).

The CPPO hook seeds its selection by a step counter that lives in the trainer process
(``RemoteExperienceMaker._cppo_step``), and the audit counts updates in each actor process: both
would restart at 0 in a resumed run — the same seed as step 1 for every later step's ties. They
start instead from ``resumed_step(args)``, the step of the checkpoint the host itself loads.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

__all__ = ["ACTOR_DIR", "checkpoint_warnings", "latest_tag", "resume_hint", "resumed_step"]

ACTOR_DIR = "_actor"  # OpenRLHF's actor checkpoint folder under --ckpt.path
_STEP = re.compile(r"global_step(\d+)$")


def latest_tag(ckpt_path: str | os.PathLike) -> str | None:
    """The tag in ``{ckpt_path}/_actor/latest`` (what DeepSpeed loads), or None without one."""
    latest = Path(ckpt_path) / ACTOR_DIR / "latest"
    if not latest.is_file():
        return None
    tag = latest.read_text().strip()
    return tag or None


def resumed_step(args: Any) -> int:
    """OpenRLHF's ``global_step`` when this run's training loop starts: 0 for a fresh run, N when
    it resumes from the checkpoint tagged ``global_step{N}`` (``--ckpt.load_enable`` and a
    checkpoint under ``--ckpt.path``, exactly when OpenRLHF itself resumes).

    Args:
        args: OpenRLHF's hierarchical args (``args.ckpt.load_enable``, ``args.ckpt.path``).
    """
    ckpt = getattr(args, "ckpt", None)
    if ckpt is None or not getattr(ckpt, "load_enable", False):
        return 0
    if not (Path(str(ckpt.path)) / ACTOR_DIR).exists():
        return 0  # OpenRLHF starts from scratch (ppo_trainer.py:435)
    tag = latest_tag(ckpt.path)
    if tag is None:
        return 0  # DeepSpeed finds nothing to load and OpenRLHF starts at step 0
    m = _STEP.search(tag)
    if m is None:
        raise ValueError(
            f"OpenRLHF checkpoint tag {tag!r} in {Path(str(ckpt.path)) / ACTOR_DIR / 'latest'} does not end in "
            "'global_step<N>': the CPPO hook cannot tell which step it resumes at; point --ckpt.path at a folder "
            "written by OpenRLHF's own save_checkpoint"
        )
    return int(m.group(1))


def resume_hint(args: Any) -> str:
    """One sentence: what rerunning this run does now, and how to resume it."""
    ckpt = args.ckpt
    save_steps = getattr(ckpt, "save_steps", -1)
    tag = latest_tag(ckpt.path)
    folder = Path(str(ckpt.path)) / ACTOR_DIR
    if tag is None:
        if save_steps is None or save_steps == -1 or save_steps == float("inf"):
            return "This run saves no checkpoint (--ckpt.save_steps -1): a rerun starts over."
        return f"No checkpoint was written yet (every {save_steps} steps into {folder}): a rerun starts over."
    m = _STEP.search(tag)
    step = f"step {m.group(1)}" if m else f"checkpoint {tag}"
    if getattr(ckpt, "load_enable", False):
        return f"Rerun the same command to resume from {step} ({folder / tag}; --ckpt.load_enable)."
    return f"To resume from {step} ({folder / tag}), rerun with --ckpt.load_enable and the same --ckpt.path."


def checkpoint_warnings(args: Any) -> list[str]:
    """Settings under which OpenRLHF's own resume loses prompts (one line each)."""
    out = []
    saves = getattr(args.ckpt, "save_steps", -1) not in (-1, None, float("inf"))
    gen = getattr(args.rollout, "vllm_generate_batch_size", None)
    if saves and gen and int(gen) > int(args.rollout.batch_size):
        out.append(
            f"--rollout.vllm_generate_batch_size {gen} > --rollout.batch_size {args.rollout.batch_size}: "
            "OpenRLHF keeps "
            "the extra samples in memory for later steps (samples_generator.py:96-131) but checkpoints the dataloader "
            "past them (ppo_trainer.py:558), so a run resumed from a checkpoint never trains those prompts; leave "
            "--rollout.vllm_generate_batch_size unset for runs that may resume"
        )
    return out
