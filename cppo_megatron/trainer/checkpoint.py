"""Checkpoints: everything a resumed run needs to continue the same run, on every rank.

A checkpoint is a directory ``checkpoints/step_NNNNNN/``: ``trainer.pt`` (step, prompt
sampler, allocation planner, RL wall time, recipe; rank 0's) and one ``policy_rankRRRRR.pt``
per process (its policy state — the whole model, optimizer and scheduler for ``backend: hf``;
its megatron-core TP / PP shards and optimizer state for ``backend: megatron`` — and its RNG
states). It is written under ``step_NNNNNN.tmp/`` and renamed once every file is complete, so
a crash never leaves a half-written checkpoint under a final name; the last ``KEEP_LAST`` are
kept. ``find_checkpoint`` skips (and names) a latest checkpoint that cannot be read and falls
back to the one before.

Ranks need not share a filesystem (nodes with local disks): ``filesystem_peers`` finds which
ranks see the same ``out_dir`` (each writes a probe file; each lists the probes it sees). On
each filesystem its lowest rank prepares the directory, writes a copy of ``trainer.pt`` and
renames it; every rank writes only its own shard. On resume the ranks agree on the newest step
that every one of them holds and can read. With one shared filesystem this is the usual
layout: one directory with every rank's file.
"""

from __future__ import annotations

import os
import random
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

__all__ = ["KEEP_LAST", "CorruptCheckpoint", "checkpoints", "filesystem_peers", "find_checkpoint", "load_checkpoint",
           "rng_state", "save_checkpoint", "set_rng_state"]

KEEP_LAST = 3


class CorruptCheckpoint(RuntimeError):
    """A checkpoint file is missing, truncated or unreadable."""


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():  # pragma: no cover - CUDA only (CI runs on CPU)
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():  # pragma: no cover - CUDA only
        torch.cuda.set_rng_state_all(state["cuda"])


def _policy_file(rank: int) -> str:
    return f"policy_rank{rank:05d}.pt"


def _save(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".part")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _one(obj):
    return [obj]


def filesystem_peers(out_dir: Path, rank: int = 0, *, gather: Callable[[object], list] = _one,
                     barrier: Callable[[], None] = lambda: None) -> list[int]:
    """The ranks (sorted, this one included) that see the same ``out_dir/checkpoints`` as this
    rank. A collective: every rank writes a probe file named by its rank under one fresh
    directory name (chosen by rank 0), all wait, each lists the probes it can see.

    ``gather(obj)``: an all-gather of one picklable object per rank, in rank order (one
    process: ``[obj]``)."""
    ckpt_dir = Path(out_dir) / "checkpoints"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    token = gather(uuid.uuid4().hex if rank == 0 else None)[0]
    probe = ckpt_dir / f".fs-probe-{token}"
    probe.mkdir(exist_ok=True)
    (probe / f"rank{rank:05d}").touch()
    barrier()
    seen = sorted(int(p.name[len("rank"):]) for p in probe.glob("rank*"))
    barrier()
    if rank not in seen:  # first: a rank that sees no file at all has no min(seen) to compare with
        raise RuntimeError(f"checkpoint probe: rank {rank} cannot see its own file under {probe}")
    if rank == min(seen):
        shutil.rmtree(probe, ignore_errors=True)
    return seen


def save_checkpoint(out_dir: Path, step: int, trainer_state: dict | None, policy_state: dict, *, rank: int = 0,
                    barrier: Callable[[], None] = lambda: None, peers: list[int] | None = None) -> Path:
    """Write this rank's part of the checkpoint of ``step``; a collective when several
    processes share the run (``barrier`` joins them).

    ``peers``: the ranks that share this rank's filesystem (``filesystem_peers``; default:
    every rank writes into one shared directory, rank 0 leading). The lowest of them prepares
    and renames the directory and writes ``trainer_state`` there, so it must be given on each
    such rank (every rank's copy of rank 0's state)."""
    leader = rank == (0 if peers is None else min(peers))
    ckpt_dir = Path(out_dir) / "checkpoints"
    final = ckpt_dir / f"step_{step:06d}"
    tmp = ckpt_dir / f"step_{step:06d}.tmp"
    if leader:
        if trainer_state is None:
            raise ValueError(f"save_checkpoint: rank {rank} writes trainer.pt on its filesystem but got no "
                             "trainer_state")
        shutil.rmtree(tmp, ignore_errors=True)  # a crashed earlier attempt
        tmp.mkdir(parents=True)
    barrier()
    _save({**policy_state, "rng": rng_state()}, tmp / _policy_file(rank))
    if leader:
        _save({**(trainer_state or {}), "step": step}, tmp / "trainer.pt")
    barrier()
    if leader:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)  # atomic: the checkpoint appears complete or not at all
        for old in checkpoints(out_dir)[KEEP_LAST:]:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def checkpoints(out_dir: Path) -> list[Path]:
    """Complete checkpoint directories of a run, newest first."""
    found = [p for p in (Path(out_dir) / "checkpoints").glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")]
    return sorted(found, reverse=True)


def load_checkpoint(path: Path, rank: int = 0) -> tuple[dict, dict]:
    """(trainer state, this rank's policy state) of the checkpoint at ``path``; raises
    ``CorruptCheckpoint`` naming the file when one is missing or cannot be read."""
    out = []
    for name in ("trainer.pt", _policy_file(rank)):
        f = Path(path) / name
        if not f.exists():
            raise CorruptCheckpoint(f"{f} is missing")
        try:
            out.append(torch.load(f, map_location="cpu", weights_only=False))
        except Exception as exc:  # noqa: BLE001 - truncated zip, unpickling error, ...
            raise CorruptCheckpoint(f"{f} cannot be read ({type(exc).__name__}: {str(exc).splitlines()[0]})") from exc
    return out[0], out[1]


def find_checkpoint(out_dir: Path, rank: int = 0, *, any_rank_failed: Callable[[bool], bool] = lambda failed: failed,
                    log: Callable[[str], None] | None = None,
                    gather: Callable[[object], list] = _one) -> tuple[Path, dict, dict]:
    """The newest checkpoint under ``out_dir`` that every rank can read: (its path, trainer
    state, this rank's policy state). A truncated or corrupt one is named through ``log`` and
    skipped (its predecessor has all the accounting up to its own step).

    ``any_rank_failed(failed)``: a collective that tells every rank whether any rank could not
    read the candidate (the default, one process: this rank's own answer). ``gather``: an
    all-gather of one object per rank; the candidates are the steps every rank holds (ranks on
    different filesystems may see different lists). FileNotFoundError when there is no
    checkpoint, or none every rank can read."""
    found = checkpoints(out_dir)
    held = gather([p.name for p in found])
    common = set(held[0]).intersection(*held[1:])
    skipped = sorted({p.name for p in found} - common)
    if skipped and log is not None:
        log(f"--resume: {', '.join(skipped)} not on every rank's filesystem; skipped")
    found = [p for p in found if p.name in common]
    if not found:
        raise FileNotFoundError(f"--resume: no checkpoint under {Path(out_dir) / 'checkpoints'}; "
                                "run without --resume to start")
    state: dict | None
    policy: dict | None
    for i, path in enumerate(found):
        try:
            state, policy = load_checkpoint(path, rank)
            error = None
        except CorruptCheckpoint as exc:
            state = policy = None
            error = str(exc)
        if not any_rank_failed(error is not None):
            assert state is not None and policy is not None
            return path, state, policy
        if log is not None:
            after = f"falling back to {found[i + 1].name}" if i + 1 < len(found) else "no older checkpoint left"
            log(f"--resume: checkpoint {path.name} is truncated or corrupt "
                f"({error or 'unreadable on another rank'}); {after}")
    raise FileNotFoundError(f"--resume: no readable checkpoint under {Path(out_dir) / 'checkpoints'}")
