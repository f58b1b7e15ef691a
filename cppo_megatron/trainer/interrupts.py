"""Signals during the RL loop (``Trainer.run``).

SIGINT / SIGTERM during a step let the step finish (every rank agrees at the step
boundary), then the trainer writes a checkpoint and the report and returns
``interrupted`` (the CLI exits 130; under torchrun the launcher reads
``INTERRUPTED_MARKER``). A further signal more than ``REPEAT_WINDOW_S`` later abandons the
step (``StopRequest`` raises KeyboardInterrupt). Outside the loop (warm-up, model loading)
Python's own KeyboardInterrupt reaches the CLI, which exits 130 as well.
"""

from __future__ import annotations

import signal
import sys
import time

__all__ = ["INTERRUPTED_MARKER", "REPEAT_WINDOW_S", "StopRequest"]

INTERRUPTED_MARKER = "interrupted.json"  # written when a run stopped on a signal
REPEAT_WINDOW_S = 3.0  # signals this close to the first are one request (torchrun forwards Ctrl-C again)


class StopRequest:
    """SIGINT / SIGTERM while active: the first asks the loop to stop at the next step
    boundary; repeats within ``REPEAT_WINDOW_S`` are the same request; a later one raises
    KeyboardInterrupt (abandon the step now)."""

    def __init__(self) -> None:
        self.requested = False
        self.first_at = 0.0
        self.previous: dict = {}

    def _handler(self, signum, frame) -> None:
        now = time.monotonic()
        if not self.requested:
            self.requested, self.first_at = True, now
            print(f"\n{signal.Signals(signum).name}: finishing the current step, then a checkpoint "
                  f"(signal again after {REPEAT_WINDOW_S:.0f} s to abandon the step)", file=sys.stderr, flush=True)
        elif now - self.first_at > REPEAT_WINDOW_S:
            raise KeyboardInterrupt

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self.previous[sig] = signal.signal(sig, self._handler)
            except ValueError:  # not the main thread: signals stay as they were
                pass
        return self

    def __exit__(self, *exc) -> None:
        for sig, prev in self.previous.items():
            signal.signal(sig, prev)
