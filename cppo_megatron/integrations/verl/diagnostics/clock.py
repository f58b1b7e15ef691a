"""Wall-clock mode: a veRL run that trains for a time budget and keeps the policy in force at
fixed wall-clock points, for an equal-time study (``cppo-megatron study`` on a veRL recipe).

veRL counts in steps (``total_training_steps``, ``test_freq``, ``save_freq``); an equal-time
comparison needs the model *as it was at* t seconds of training, for every arm alike. With
``CPPO_VERL_CLOCK=DIR`` (``DIR/clock.json``: ``{"budget_s": B, "marks": [t1, ..., B]}``,
exported to every Ray process):

- the clock starts when the start weights reach the rollout (veRL's initial weight sync,
  before step 1; Ray and worker start-up are not charged) and runs on the wall;
- ``Snapshots`` (in the ``hf`` rollout server, which receives the actor's weights after every
  update): when an update arrives after mark t, the weights it replaces — the last policy
  synced before t, i.e. the policy the run had *at* t — are saved for t
  (``DIR/snapshots.jsonl`` + ``policy_stepN.pt``); every sync is logged (``DIR/syncs.jsonl``)
  and the newest weights are kept as ``latest.pt`` (the policy at marks after the run ended);
- ``install()`` (the legacy ``RayPPOTrainer`` and V1's ``PPOTrainer``): at the start of each
  step, the step becomes veRL's last one when ``stop_now`` says the budget is (about to be) spent, so veRL ends its
  run normally: at most the step in progress at B runs past it, and its result is not used.

Evaluation is not done here: one evaluator, shared by all arms, reads the snapshots afterwards
(``cppo_megatron.bench.verl_study``), so every arm is graded identically and no evaluation
time is charged to a run.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...importhook import after_import
from ...wrap import wrap_methods
from . import CHANGED, CLOCK_ENV

__all__ = ["ENV", "ClockSettings", "Snapshots", "install", "policy_at_marks", "read_run", "settings", "stop_now",
           "write_settings"]

ENV = CLOCK_ENV
SETTINGS = "clock.json"
WRAP_TAG = __name__  # marks our layers on the two loops' step starts (integrations/wrap.py)
LEGACY = ("verl.trainer.ppo.ray_trainer", "RayPPOTrainer")
V1 = ("verl.trainer.ppo.v1.trainer_base", "PPOTrainer")


@dataclass(frozen=True)
class ClockSettings:
    """Budget and marks (seconds of wall time since the initial weight sync)."""

    dir: Path
    budget_s: float
    marks: tuple[float, ...]

    def __post_init__(self) -> None:
        if not (self.budget_s > 0):
            raise ValueError(f"clock: budget_s must be > 0, got {self.budget_s!r}")
        if not self.marks or any(not (0 < m <= self.budget_s) for m in self.marks) or list(self.marks) != sorted(
                set(self.marks)):
            raise ValueError(f"clock: marks must be increasing, in (0, budget_s={self.budget_s}], got {self.marks!r}")


def write_settings(run_dir: str | Path, budget_s: float, marks: list[float]) -> ClockSettings:
    """Write ``RUN_DIR/clock.json`` (validated); set ``CPPO_VERL_CLOCK=RUN_DIR`` for the run."""
    s = ClockSettings(Path(run_dir), float(budget_s), tuple(float(m) for m in marks))
    s.dir.mkdir(parents=True, exist_ok=True)
    (s.dir / SETTINGS).write_text(json.dumps({"budget_s": s.budget_s, "marks": list(s.marks)}) + "\n")
    return s


def settings() -> ClockSettings | None:
    """This process's clock settings (None: wall-clock mode is off)."""
    root = os.environ.get(ENV)
    if not root:
        return None
    path = Path(root) / SETTINGS
    if not path.is_file():
        raise FileNotFoundError(f"{ENV}={root}: no {SETTINGS} there (write it with clock.write_settings)")
    raw = json.loads(path.read_text())
    return ClockSettings(Path(root), float(raw["budget_s"]), tuple(float(m) for m in raw["marks"]))


# ------------------------------------------------------------------------------ decisions (pure)
def stop_now(elapsed_s: float, last_step_s: float | None, budget_s: float, margin: float = 0.5) -> bool:
    """Whether the step starting now should be veRL's last: the budget is spent, or what is
    left of it is shorter than ``margin`` x the previous step (this step would end past the
    budget). The step in progress at the budget still runs (its sync dates the policy at B);
    ``margin`` < 1 only spares a step that would start and end after the budget."""
    if last_step_s is None:
        return elapsed_s >= budget_s
    return elapsed_s + margin * last_step_s >= budget_s


def policy_at_marks(marks: list[float], syncs: list[tuple[int, float]]) -> dict[float, int | None]:
    """Which policy was in force at each mark: ``{mark: step}``, the step of the last sync at or
    before the mark (None when no sync preceded it).

    Args:
        marks: seconds since the clock's origin.
        syncs: ``(global step, elapsed seconds)`` of each weight sync, in order; the initial
            sync is step 0 at 0.0.
    """
    out: dict[float, int | None] = {}
    for m in marks:
        step = None
        for g, t in syncs:
            if t <= m:
                step = g
        out[m] = step
    return out


# ------------------------------------------------------------------------------ rollout side
class Snapshots:
    """The ``hf`` rollout server's part: date every weight sync and keep the policy in force at
    each mark. ``before_update`` / ``after_update`` wrap the server's weight load.

    Args:
        cfg: the clock settings.
        clock: wall-clock source (seconds); tests pass a fake one.
    """

    def __init__(self, cfg: ClockSettings, clock: Callable[[], float] = time.time) -> None:
        self.cfg = cfg
        self.clock = clock
        self.origin: float | None = None
        self.step: int | None = None  # step of the weights now loaded
        self.pending = list(cfg.marks)

    @classmethod
    def from_env(cls) -> Snapshots | None:
        s = settings()
        return None if s is None else cls(s)

    def elapsed(self) -> float:
        return 0.0 if self.origin is None else self.clock() - self.origin

    def before_update(self, state: Callable[[], dict], global_steps: int | None) -> list[float]:
        """Called when new weights arrive, before they are loaded: the weights still loaded
        were the policy at every mark passed since the last sync; save them for those marks.
        ``state`` returns the loaded weights (called only when a mark was passed)."""
        if self.origin is None:
            return []
        now = self.elapsed()
        passed = [m for m in self.pending if m < now]
        if passed:
            name = f"policy_step{int(self.step or 0):05d}.pt"
            _save(state(), self.cfg.dir / name)
            with open(self.cfg.dir / "snapshots.jsonl", "a") as f:
                for m in passed:
                    f.write(json.dumps({"mark": m, "step": self.step, "file": name, "replaced_at": round(now, 3),
                                        "next_step": global_steps}) + "\n")
            self.pending = [m for m in self.pending if m >= now]
        return passed

    def after_update(self, state: Callable[[], dict], global_steps: int | None, extra: dict | None = None) -> None:
        """Called after new weights are loaded: the first sync starts the clock; each sync is
        logged (with ``extra``, e.g. the server's cumulative generate time), and the newest
        weights are kept as ``latest.pt``."""
        if self.origin is None:
            self.origin = self.clock()
        self.step = int(global_steps) if global_steps is not None else (self.step or 0) + 1
        now = self.elapsed()
        with open(self.cfg.dir / "syncs.jsonl", "a") as f:
            f.write(json.dumps({"step": self.step, "elapsed": round(now, 3), "time": self.clock(), **(extra or {})})
                    + "\n")
        _save(state(), self.cfg.dir / "latest.pt")
        (self.cfg.dir / "latest.json").write_text(json.dumps({"step": self.step, "elapsed": round(now, 3)}) + "\n")


def _save(state: dict, path: Path) -> None:
    import torch

    tmp = path.with_suffix(".tmp")
    torch.save({k: v.detach().cpu().clone() for k, v in state.items()}, tmp)
    os.replace(tmp, path)


def read_run(run_dir: str | Path) -> dict:
    """What a wall-clock run left: ``{"settings": ClockSettings, "syncs": [(step, elapsed)],
    "sync_rows": the raw sync records, "policies": {mark: {"file", "step"}}, "latest": {...} |
    None}``; for each mark, the weights in force at it: its snapshot, or ``latest.pt`` when the
    run ended before the mark. Raises when a mark has no policy or the wrong one."""
    d = Path(run_dir)
    raw = json.loads((d / SETTINGS).read_text())
    cfg = ClockSettings(d, float(raw["budget_s"]), tuple(float(m) for m in raw["marks"]))
    sync_rows = _jsonl(d / "syncs.jsonl")
    syncs = [(int(r["step"]), float(r["elapsed"])) for r in sync_rows]
    snaps = {float(r["mark"]): {"file": d / r["file"], "step": r["step"]} for r in _jsonl(d / "snapshots.jsonl")}
    latest: dict[str, Any] | None = None
    if (d / "latest.json").is_file():
        lj = json.loads((d / "latest.json").read_text())
        latest = {"file": d / "latest.pt", "step": int(lj["step"]), "elapsed": float(lj["elapsed"])}
    policies: dict[float, dict] = {}
    in_force = policy_at_marks(list(cfg.marks), syncs)
    for m in cfg.marks:
        if m in snaps:
            policies[m] = snaps[m]
        elif latest is not None and latest["elapsed"] <= m:
            policies[m] = {"file": latest["file"], "step": latest["step"]}  # the run ended before m
        else:
            raise RuntimeError(f"clock: no policy for mark {m:g} s in {d} (syncs {syncs[-3:]}); did the run fail?")
        if policies[m]["step"] != in_force[m]:
            raise RuntimeError(f"clock: the snapshot for {m:g} s holds step {policies[m]['step']} but the sync log "
                               f"says step {in_force[m]} was in force ({d})")
    return {"settings": cfg, "syncs": syncs, "sync_rows": sync_rows, "policies": policies, "latest": latest}


def _jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ------------------------------------------------------------------------------ trainer side
def _step_start(trainer: Any) -> None:
    """A training step of ``trainer`` starts: date it, and make it veRL's last step when
    ``stop_now`` says the budget is (about to be) spent. Only the first call at each global step
    >= 1 counts (the legacy seam is also called by ``_validate``)."""
    cfg = settings()
    state = trainer.__dict__.setdefault("_cppo_clock", {"origin": None, "last": None, "step": None})
    if cfg is None or int(trainer.global_steps) < 1 or state["step"] == int(trainer.global_steps):
        return
    state["step"] = int(trainer.global_steps)
    now = time.time()
    if state["origin"] is None:
        state["origin"] = now
    elapsed = now - state["origin"]
    last_step = None if state["last"] is None else elapsed - state["last"]
    state["last"] = elapsed
    if stop_now(elapsed, last_step, cfg.budget_s):
        trainer.total_training_steps = min(int(trainer.total_training_steps), int(trainer.global_steps))
        with open(cfg.dir / "trainer.jsonl", "a") as f:
            f.write(json.dumps({"last_step": int(trainer.global_steps), "elapsed": round(elapsed, 3),
                                "previous_step_s": last_step, "budget_s": cfg.budget_s}) + "\n")


def _legacy_gen_batch(original):
    """``RayPPOTrainer._get_gen_batch`` is the first call of every step of the legacy ``fit``,
    before it computes ``is_last_step`` from ``total_training_steps``
    (verl/trainer/ppo/ray_trainer.py:1486 and :1507 in 0.9.1). ``_validate`` calls it too
    (:626), at the global step of the training step before it (0 before training): only the
    first call at each global step >= 1 is a step start."""

    @functools.wraps(original)
    def _get_gen_batch(self, *args: Any, **kwargs: Any):
        _step_start(self)
        return original(self, *args, **kwargs)

    return _get_gen_batch


def _v1_step_begin(original):
    """V1's ``PPOTrainer.on_step_begin`` (verl/trainer/ppo/v1/trainer_base.py:474 in 0.9.1) opens
    each step of ``fit``, after the loop checked ``global_steps <= total_training_steps``: when
    this step is made the last one, the loop's own condition ends it after the step, and ``fit``
    returns through ``on_train_end`` as at its planned end."""

    @functools.wraps(original)
    def on_step_begin(self, *args: Any, **kwargs: Any):
        _step_start(self)
        return original(self, *args, **kwargs)

    return on_step_begin


def _patch(module) -> None:
    wrap_methods(module, LEGACY, {"_get_gen_batch": _legacy_gen_batch}, tag=WRAP_TAG, changed=CHANGED,
                 who="cppo clock")


def _patch_v1(module) -> None:
    wrap_methods(module, V1, {"on_step_begin": _v1_step_begin}, tag=WRAP_TAG, changed=CHANGED, who="cppo clock")


def install() -> bool:
    """Install the budget stop in both of veRL's loops (the legacy ``RayPPOTrainer`` and V1's
    ``PPOTrainer``) when ``CPPO_VERL_CLOCK`` is set."""
    if not os.environ.get(ENV):
        return False
    after_import(LEGACY[0], _patch)
    after_import(V1[0], _patch_v1)
    return True
