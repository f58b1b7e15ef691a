"""Progress bars fit for a terminal and for a job log.

When stderr is not a terminal (CI, ``nohup``, a cluster's job log) tqdm still redraws its bar with
a carriage return on every update: the 3-minute main job wrote ~1,500 redraws into its log.
``progress(total, desc)`` is tqdm on a terminal; elsewhere it is the same tqdm object writing one
plain line at most every ``LOG_INTERVAL_S`` seconds, and the final state when it closes.

Imports nothing of ours; tqdm is optional (no bar without it).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, TextIO

__all__ = ["LOG_INTERVAL_S", "progress"]

# seconds between progress lines in a log; CPPO_PROGRESS_INTERVAL_S overrides it
LOG_INTERVAL_S = 10.0


class _LineWriter:
    """A file for tqdm that turns carriage-return redraws into plain lines, one per ``interval``
    seconds (tqdm's own ``mininterval`` does not hold back ``set_postfix``, which redraws at once);
    the last line held back is written by ``final()``."""

    def __init__(self, out: TextIO, interval: float):
        self.out, self.interval = out, interval
        self.last_emit: float | None = None
        self.pending = ""

    def write(self, text: str) -> None:
        line = text.replace("\r", "").strip()
        if not line:
            return
        now = time.monotonic()
        if self.last_emit is None or now - self.last_emit >= self.interval:
            self.out.write(line + "\n")
            self.last_emit, self.pending = now, ""
        else:
            self.pending = line

    def final(self) -> None:
        if self.pending:
            self.out.write(self.pending + "\n")
            self.pending = ""
        self.out.flush()

    def flush(self) -> None:
        self.out.flush()


def _interval() -> float:
    raw = os.environ.get("CPPO_PROGRESS_INTERVAL_S", "")
    try:
        value = float(raw) if raw else LOG_INTERVAL_S
    except ValueError:
        raise ValueError(f"CPPO_PROGRESS_INTERVAL_S={raw!r} is not a number of seconds") from None
    if value < 0:
        raise ValueError(f"CPPO_PROGRESS_INTERVAL_S={raw!r} must be >= 0")
    return value


def progress(total: int, desc: str, *, initial: int = 0, leave: bool = True, file: TextIO | None = None) -> Any:
    """A progress bar over ``total`` units, or None when tqdm is not installed.

    On a terminal: tqdm as usual. Otherwise: one line per ``CPPO_PROGRESS_INTERVAL_S`` seconds
    (default ``LOG_INTERVAL_S``) with the same text, plus the final state when closed — never a
    carriage-return redraw."""
    if total < 0 or initial < 0 or initial > total:
        raise ValueError(f"progress: need 0 <= initial <= total, got initial={initial}, total={total}")
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    out = sys.stderr if file is None else file
    if out.isatty():
        return tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True, leave=leave, file=out)
    # a log: a fixed width, no animation, lines gated by _LineWriter, the last state on close
    writer = _LineWriter(out, _interval())

    class _LogBar(tqdm):  # closes with the line _LineWriter held back
        def close(self) -> None:
            super().close()
            writer.final()

    return _LogBar(total=total, initial=initial, desc=desc, file=writer, ncols=100, ascii=True,
                   mininterval=0, miniters=1, leave=True)
