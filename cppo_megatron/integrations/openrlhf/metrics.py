"""OpenRLHF's per-step metrics as JSON lines (``CPPO_OPENRLHF_METRICS=FILE``).

OpenRLHF logs to wandb or TensorBoard (``--logger.tensorboard_dir``). For plots, benches and
tests we also want plain JSON: with ``CPPO_OPENRLHF_METRICS`` set (the launcher sets it for a
recipe with a ``cpu:`` section: ``RUN_DIR/metrics.jsonl``) the trainer process appends

- ``{"step": N, "kind": "train", "data": {...}}`` for every logged step (OpenRLHF's own status
  dict: ``timing/*``, ``policy_loss``, ``reward``, ``cppo/*``, ...);
- ``{"step": N, "kind": "eval", "data": {...}}`` for every evaluation (``eval_*_pass1`` ...).

``CPPO_OPENRLHF_EVAL_BEFORE_TRAIN=1`` additionally evaluates once before the first step
(step 0), so a run's held-out accuracy has a "before" on the same evaluation path.
Both wrap ``BasePPOTrainer`` methods (``trainer/ppo_trainer.py:384`` and ``:337``, and
``init_checkpoint_states`` ``:433`` for the step-0 evaluation); they only read.
"""

from __future__ import annotations

import functools
import json
import os
import time
from pathlib import Path
from typing import Any

from .importhook import after_import

__all__ = ["ENV", "EVAL_BEFORE_ENV", "install", "read"]

ENV = "CPPO_OPENRLHF_METRICS"
EVAL_BEFORE_ENV = "CPPO_OPENRLHF_EVAL_BEFORE_TRAIN"
TRAINER_MODULE = "openrlhf.trainer.ppo_trainer"
_MARK = "__cppo_metrics__"


def _scalar(v: Any):
    try:
        import torch

        if isinstance(v, torch.Tensor):
            return v.float().mean().item() if v.numel() else None
    except ImportError:  # pragma: no cover
        pass
    if isinstance(v, (int, float, bool)) or v is None:
        return v
    return None


def write(step: int, kind: str, data: dict) -> None:
    path = os.environ.get(ENV)
    if not path:
        return
    clean = {k: s for k, v in (data or {}).items() if (s := _scalar(v)) is not None}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps({"step": int(step), "kind": kind, "time": time.time(), "data": clean}) + "\n")


def read(path: str | Path, kind: str = "train") -> list[dict]:
    """``[{"step": N, **data}]`` of one kind, in step order."""
    rows = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            if rec["kind"] == kind:
                rows.append({"step": rec["step"], **rec["data"]})
    return sorted(rows, key=lambda r: r["step"])


def _wrap_logs(original):
    @functools.wraps(original)
    def save_logs_and_checkpoints(self, global_step, logs_dict=None, client_states=None):
        write(global_step, "train", logs_dict or {})
        return original(self, global_step, logs_dict, client_states)

    return save_logs_and_checkpoints


def _wrap_best(original):
    @functools.wraps(original)
    def save_best_checkpoint(self, eval_metrics, global_step, client_states=None):
        write(global_step, "eval", eval_metrics or {})
        return original(self, eval_metrics, global_step, client_states)

    return save_best_checkpoint


def _wrap_init_states(original):
    @functools.wraps(original)
    def init_checkpoint_states(self):
        states = original(self)
        if os.environ.get(EVAL_BEFORE_ENV) == "1" and states.get("global_step", 0) == 0 \
                and getattr(self, "eval_dataloader", None) is not None and hasattr(self, "evaluate"):
            kwargs = dict(self.generate_kwargs)
            kwargs["temperature"] = self.args.eval.temperature
            kwargs["n_samples_per_prompt"] = self.args.eval.n_samples_per_prompt
            write(0, "eval", self.evaluate(0, **kwargs))
        return states

    return init_checkpoint_states


def _patch(module) -> None:
    cls = module.BasePPOTrainer
    for name, wrap in (("save_logs_and_checkpoints", _wrap_logs), ("save_best_checkpoint", _wrap_best),
                       ("init_checkpoint_states", _wrap_init_states)):
        current = cls.__dict__[name]
        if not hasattr(current, _MARK):
            wrapped = wrap(current)
            setattr(wrapped, _MARK, current)
            setattr(cls, name, wrapped)


def install() -> bool:
    if not os.environ.get(ENV):
        return False
    after_import(TRAINER_MODULE, _patch)
    return True
