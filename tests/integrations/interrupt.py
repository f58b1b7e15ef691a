"""Interrupting a real host run at a chosen point, for the resume and dead-worker tests.

A run is a subprocess in its own session (process group), so that everything it starts — Ray's
head processes and workers included — can be removed afterwards, whatever state it ended in.
``run`` watches the run's files while it runs; ``when(...)`` says when to strike and ``strike``
how: SIGKILL the driver (``kill_driver``) or one Ray worker process (``kill_pid``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional


@dataclass
class Run:
    """What a (possibly interrupted) run left: exit status, log, when and whom it struck."""

    returncode: int
    log: str
    wall_s: float
    struck: Optional[str] = None  # what was killed ("driver", "pid 1234 (...)")
    struck_at_s: Optional[float] = None  # since the start
    exit_after_strike_s: Optional[float] = None
    extra: dict = field(default_factory=dict)


def kill_driver(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGKILL)
    return "driver"


def kill_pid(pid: int, what: str = "") -> Callable[[subprocess.Popen], str]:
    def strike(proc: subprocess.Popen) -> str:
        os.kill(pid, signal.SIGKILL)
        return f"pid {pid}" + (f" ({what})" if what else "")

    return strike


def kill_session(sid: int) -> int:
    """SIGKILL every process of session ``sid`` (the run's, started with ``start_new_session``):
    its process group and the groups Ray's workers make for themselves, whose children outlive a
    SIGKILLed driver otherwise. Returns how many were killed."""
    killed = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # the fields after the command's closing parenthesis: state ppid pgrp session ...
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid:
                os.kill(int(stat.parent.name), signal.SIGKILL)
                killed += 1
        except (OSError, ValueError, IndexError):
            pass  # gone meanwhile, or not ours to read
    return killed


def run(args: list[str], *, env: dict, cwd: Path, log_path: Path, timeout: float = 900,
        when: Optional[Callable[[], Optional[Callable[[subprocess.Popen], str]]]] = None,
        poll_s: float = 0.2) -> Run:
    """Run ``args``; while it runs, call ``when()`` every ``poll_s``: once it returns a strike
    function, call it on the process (once). Afterwards every process left in the run's session
    is killed (Ray's head processes and its workers' children outlive a SIGKILLed driver otherwise)."""
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
        struck = struck_at = None
        try:
            while proc.poll() is None:
                if time.monotonic() - t0 > timeout:
                    raise TimeoutError(f"run did not end within {timeout:.0f} s: {log_path}")
                if when is not None and struck is None:
                    strike = when()
                    if strike is not None:
                        struck, struck_at = strike(proc), time.monotonic()
                time.sleep(poll_s)
        finally:
            kill_session(proc.pid)
            proc.wait()
    end = time.monotonic()
    return Run(proc.returncode, log_path.read_text(errors="replace"), end - t0, struck,
               None if struck_at is None else struck_at - t0, None if struck_at is None else end - struck_at)
