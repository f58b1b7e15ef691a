"""The machine's load during a run, sampled so that a study can report it next to its times."""

from __future__ import annotations

import os
import statistics
import threading

__all__ = ["LoadSampler"]


class LoadSampler:
    """Samples the 1-minute load average every ``every_s`` seconds on a daemon thread."""

    def __init__(self, every_s: float = 5.0) -> None:
        self.every_s = every_s
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            self.samples.append(os.getloadavg()[0])
            if self._stop.wait(self.every_s):
                return

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def summary(self) -> dict:
        s = self.samples or [os.getloadavg()[0]]
        return {"load_mean": statistics.mean(s), "load_max": max(s), "load_min": min(s), "load_samples": len(s)}
