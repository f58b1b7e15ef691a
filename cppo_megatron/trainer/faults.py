"""Deterministic fault injection for the interrupt and failure tests.

``CPPO_MEGATRON_FAULT="PHASE:STEP:RANK:ACTION"`` makes rank RANK do ACTION as it enters
phase PHASE (one of ``metrics.PHASES``) of RL step STEP (1-based): ``sigint`` / ``sigterm``
(signal this process), ``kill`` (SIGKILL: the process dies without a word) or ``raise`` (a
RuntimeError on this rank only). Unset (the default) it does nothing. Several faults:
separate them with commas. With ``CPPO_MEGATRON_FAULT_LOG=FILE`` each fault appends
``RANK PHASE STEP ACTION UNIX_TIME`` to FILE as it fires (tests time the job's reaction).
"""

from __future__ import annotations

import os
import signal
import time

from .metrics import PHASES

__all__ = ["ENV", "maybe_inject", "parse"]

ENV = "CPPO_MEGATRON_FAULT"
ACTIONS = ("sigint", "sigterm", "kill", "raise")


def parse(text: str) -> list[tuple[str, int, int, str]]:
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        bits = part.split(":")
        if len(bits) != 4 or bits[0] not in PHASES or bits[3] not in ACTIONS or not (bits[1].isdigit()
                                                                                      and bits[2].isdigit()):
            raise ValueError(f"{ENV}={text!r}: each fault is PHASE:STEP:RANK:ACTION with PHASE in {list(PHASES)} "
                             f"and ACTION in {list(ACTIONS)}, got {part!r}")
        out.append((bits[0], int(bits[1]), int(bits[2]), bits[3]))
    return out


def maybe_inject(phase: str, step: int, rank: int) -> None:
    text = os.environ.get(ENV)
    if not text:
        return
    for f_phase, f_step, f_rank, action in parse(text):
        if (f_phase, f_step, f_rank) != (phase, step, rank):
            continue
        log = os.environ.get(ENV + "_LOG")
        if log:
            with open(log, "a") as fh:
                fh.write(f"{rank} {phase} {step} {action} {time.time():.3f}\n")
        if action == "raise":
            raise RuntimeError(f"injected fault ({ENV}) on rank {rank} in the {phase} of step {step}")
        sig = {"sigint": signal.SIGINT, "sigterm": signal.SIGTERM, "kill": signal.SIGKILL}[action]
        os.kill(os.getpid(), sig)
