"""What a CPU run is doing before its first step, and how long each part took.

A first ``cppo-megatron verl`` run on a CPU machine builds the start model, writes the data,
starts Ray (and veRL's workers) and only then trains. Each of these prints a line when it
starts and one with its duration when it ends, and the first logged step prints a summary:

    cpu mode: building the start model in runs/verl_tiny/model (supervised warm-up of tiny_cpu.yaml
              with ..., 1 torch thread(s): 2 usable cores, load 6.7) ...
    cpu mode: building the start model: done in 64.1 s (held-out accuracy 0.235 on 200 problems
              after 850 SFT steps)
    cpu mode: writing the data as veRL parquet to runs/verl_tiny/data ...
    cpu mode: starting Ray (a local cluster for this run) ...
    cpu mode: first step logged 2 min 40 s after the command started (start-up 10.5 s, start model
              64.1 s, data 1.4 s, Ray 7.9 s, veRL workers + initial validation 56.0 s, step 1 (until
              logged) 20.0 s; step 1 itself 20.0 s)

``choose_threads`` picks torch's thread count for work in the driver process (the warm-up)
from the cores this process may use and the load on them: two torch threads on a 2-core
machine that other processes keep busy spin against each other and made the warm-up 10x
slower here.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ...wrap import wrapped

__all__ = ["FirstStepWatcher", "Phases", "choose_threads", "fmt_seconds", "machine_load", "timed_ray_init"]

PREFIX = "cpu mode:"


def machine_load() -> tuple[int, float]:
    """(cores usable by this process, 1-minute load average of the machine)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = 0.0
    return cores, load


def choose_threads(cores: int | None = None, load: float | None = None) -> int:
    """torch threads for one compute-bound process: the usable cores that the rest of the
    machine leaves free, rounded to nearest, at least 1.

    Args:
        cores: cores this process may run on (default ``len(os.sched_getaffinity(0))``).
        load: the machine's 1-minute load average (default ``os.getloadavg()[0]``); it counts
            runnable processes, so ``cores - load`` is how many cores nobody else wants.

    ``choose_threads(2, 0.1) == 2``, ``choose_threads(2, 0.9) == 1``, ``choose_threads(8, 3.0) == 5``.
    """
    have_cores, have_load = machine_load()
    cores = have_cores if cores is None else cores
    load = have_load if load is None else load
    if not isinstance(cores, int) or cores < 1:
        raise ValueError(f"choose_threads: cores must be a positive int, got {cores!r}")
    if not (isinstance(load, (int, float)) and math.isfinite(load) and load >= 0):
        raise ValueError(f"choose_threads: load must be a finite number >= 0, got {load!r}")
    return max(1, min(cores, int(math.floor(cores - load + 0.5))))


def fmt_seconds(s: float) -> str:
    """``41.2 s`` under two minutes, ``3 min 02 s`` above."""
    if s < 120:
        return f"{s:.1f} s"
    m, sec = divmod(int(round(s)), 60)
    return f"{m} min {sec:02d} s"


class Phases:
    """Named, timed phases of a run, printed as they start and end.

    ``t0`` is when the command started (default: this process's start time when known, so the
    interpreter's and hydra's start-up count too).
    """

    def __init__(self, t0: float | None = None, printer: Callable[[str], None] = print) -> None:
        self.t0 = _process_start() if t0 is None else t0
        self.durations: dict[str, float] = {}
        self._print = printer

    def say(self, text: str) -> None:
        self._print(f"{PREFIX} {text}")

    @contextmanager
    def phase(self, key: str, what: str, label: str | None = None) -> Iterator[dict]:
        """Time the block as phase ``key``; prints ``what ...`` and ``label: done in X`` (label
        defaults to ``what``). The block may put a ``result`` string into the yielded dict to
        add to the second line."""
        self.say(f"{what} ...")
        info: dict = {}
        t = time.time()
        try:
            yield info
        finally:
            self.durations[key] = time.time() - t
        extra = f" ({info['result']})" if info.get("result") else ""
        self.say(f"{label or what}: done in {fmt_seconds(self.durations[key])}{extra}")

    def since_start(self) -> float:
        return time.time() - self.t0


def _process_start() -> float:
    """This process's start time (epoch seconds) from /proc, else now."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


@contextmanager
def timed_ray_init(phases: Phases) -> Iterator[None]:
    """While active, ``ray.init`` in this process runs as the phase "starting Ray" (veRL's
    ``main_ppo`` calls it; nothing else about the call changes)."""
    import ray

    def timed(original):
        def init(*args, **kwargs):
            with phases.phase("ray", "starting Ray (a local cluster for this run)", "starting Ray"):
                return original(*args, **kwargs)

        return init

    with wrapped(ray, "init", timed, tag=f"{__name__}.timed_ray_init"):
        yield


class FirstStepWatcher:
    """A daemon thread that watches veRL's ``metrics.jsonl`` (the file logger) and prints when
    the initial validation and the first training step are logged, with the phase summary."""

    def __init__(self, metrics: Path, phases: Phases, poll_s: float = 1.0) -> None:
        self.metrics = Path(metrics)
        self.phases = phases
        self.poll_s = float(poll_s)
        self.summary: str | None = None
        self._offset = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cppo-first-step", daemon=True)

    def start(self) -> FirstStepWatcher:
        # veRL's file logger appends: lines of an earlier run in the same file are not this run's
        self._offset = self.metrics.stat().st_size if self.metrics.is_file() else 0
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _records(self) -> list[dict]:
        if not self.metrics.is_file():
            return []
        out = []
        with open(self.metrics, "rb") as fh:
            fh.seek(self._offset)
            text = fh.read().decode("utf-8", errors="replace")
        for line in text.splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line being written
                continue
        return out

    def _run(self) -> None:
        seen_val = False
        self.validation_at: float | None = None
        while not self._stop.wait(self.poll_s):
            for rec in self._records():
                data = rec.get("data", {})
                if not seen_val and rec.get("step") == 0 and any(k.startswith("val-core/") for k in data):
                    seen_val = True
                    self.validation_at = self.phases.since_start()
                    acc = next((v for k, v in data.items() if k.startswith("val-core/") and "/acc/" in k), None)
                    self.phases.say(f"initial validation logged {fmt_seconds(self.phases.since_start())} after the "
                                    f"command started" + (f" (held-out accuracy {acc:.3f})" if acc is not None else ""))
                if "timing_s/step" in data:
                    self.summary = self.describe(float(data["timing_s/step"]))
                    self.phases.say(self.summary)
                    return

    def describe(self, step_s: float) -> str:
        total = self.phases.since_start()
        d = self.phases.durations
        named = [("start-up", "startup"), ("start model", "model"), ("data", "data"), ("Ray", "ray")]
        parts = [f"{label} {fmt_seconds(d[k])}" for label, k in named if k in d]
        before = sum(d.get(k, 0.0) for _, k in named)
        val_at = getattr(self, "validation_at", None)
        if val_at is not None:
            parts.append(f"veRL workers + initial validation {fmt_seconds(max(val_at - before, 0.0))}")
            parts.append(f"step 1 (until logged) {fmt_seconds(max(total - val_at, 0.0))}")
        else:
            parts.append(f"veRL workers + step 1 {fmt_seconds(max(total - before, 0.0))}")
        return (f"first step logged {fmt_seconds(total)} after the command started ({', '.join(parts)}; "
                f"step 1 itself {fmt_seconds(step_s)})")
