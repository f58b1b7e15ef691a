"""OpenRLHF's per-step metrics as JSON lines (``CPPO_OPENRLHF_METRICS=FILE``).

OpenRLHF logs to wandb or TensorBoard (``--logger.tensorboard_dir``). For plots, benches and
tests we also want plain JSON: with ``CPPO_OPENRLHF_METRICS`` set (the launcher sets it for a
recipe with a ``cpu:`` section, ``RUN_DIR/metrics.jsonl``, together with
``--logger.tensorboard_dir RUN_DIR/tensorboard``) the trainer process appends

- ``{"step": N, "kind": "train", "data": {...}}`` for every logged step (OpenRLHF's own status
  dict: ``timing/*``, ``policy_loss``, ``reward``, ``cppo/*``, ...);
- ``{"step": N, "kind": "eval", "data": {...}}`` for every evaluation (``eval_*_pass1`` ...).

A train line (and TensorBoard) also gets ``signal/gen_share`` (``with_gen_share``). Both come
from OpenRLHF's ``TensorboardLogger.log_train`` / ``log_eval``
(``utils/logging_utils.py:122,132``), wrapped to also write the line. (The trainer itself is
a Ray actor class that Ray ships by value, so its own methods cannot be wrapped from
outside; the logger is imported by reference.)

``CPPO_OPENRLHF_EVAL_BEFORE_TRAIN=1`` evaluates once before the first step (step 0), through
OpenRLHF's own ``SamplesGenerator.generate_eval_samples`` and ``compute_eval_metrics`` with the
run's eval settings, so a run's held-out accuracy has a "before" on the same path (not again
when the run resumes from a checkpoint: the run it continues logged it).
"""

from __future__ import annotations

import functools
import json
import os
import time
from pathlib import Path
from typing import Any

from ..importhook import after_import
from ..wrap import wrap
from .checkpoint import resumed_step

__all__ = ["ENV", "EVAL_BEFORE_ENV", "install", "read", "with_gen_share", "write"]

ENV = "CPPO_OPENRLHF_METRICS"
EVAL_BEFORE_ENV = "CPPO_OPENRLHF_EVAL_BEFORE_TRAIN"
LOGGER_MODULE = "openrlhf.utils.logging_utils"
GENERATOR_MODULE = "openrlhf.trainer.ppo_utils.samples_generator"
WRAP_TAG = __name__  # marks our layers on OpenRLHF's methods (integrations/wrap.py)


def _scalar(v: Any):
    import torch

    if isinstance(v, torch.Tensor):
        return v.float().mean().item() if v.numel() else None
    if isinstance(v, (int, float, bool)) or v is None:
        return v
    return None


def write(step: int, kind: str, data: dict) -> None:
    """Append one line (no-op without ``CPPO_OPENRLHF_METRICS``)."""
    path = os.environ.get(ENV)
    if not path:
        return
    clean = {k: s for k, v in (data or {}).items() if (s := _scalar(v)) is not None}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps({"step": int(step), "kind": kind, "time": time.time(), "data": clean}) + "\n")


def read(path: str | Path, kind: str = "train") -> list[dict]:
    """``[{"step": N, **data}]`` of one kind, in file order."""
    rows = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            if rec["kind"] == kind:
                rows.append({"step": rec["step"], **rec["data"]})
    return rows


def with_gen_share(logs: dict) -> dict:
    """``logs`` plus ``signal/gen_share`` = ``timing/generation / timing/step_total`` (the share of
    the step OpenRLHF spent generating, as the embedded trainer and veRL log it) when both are there."""
    if "timing/generation" not in logs or "timing/step_total" not in logs:
        return logs
    from ...core.signal import gen_share

    return {**logs, **gen_share(float(logs["timing/generation"]), float(logs["timing/step_total"]))}


def _wrap_log(original, kind: str):
    @functools.wraps(original)
    def log(self, global_step, logs_dict):
        if kind == "train":
            logs_dict = with_gen_share(logs_dict or {})
        write(global_step, kind, logs_dict)
        return original(self, global_step, logs_dict)

    return log


def _patch_logger(module) -> None:
    cls = module.TensorboardLogger
    for name, kind in (("log_train", "train"), ("log_eval", "eval")):
        wrap(cls, name, functools.partial(_wrap_log, kind=kind), tag=WRAP_TAG)


def _wrap_generate(original):
    @functools.wraps(original)
    def generate_samples(self, **generate_kwargs):
        if not getattr(self, "_cppo_evaluated_before", False):
            self._cppo_evaluated_before = True
            # a resumed run had its "before" in the run it continues
            if self.eval_dataloader is not None and resumed_step(self.args) == 0:
                from openrlhf.trainer.ppo_trainer import compute_eval_metrics

                kwargs = dict(generate_kwargs)
                kwargs["temperature"] = self.args.eval.temperature
                kwargs["n_samples_per_prompt"] = self.args.eval.n_samples_per_prompt
                samples = self.generate_eval_samples(**kwargs)
                write(0, "eval", compute_eval_metrics(self.eval_dataloader, samples, kwargs["n_samples_per_prompt"]))
        return original(self, **generate_kwargs)

    return generate_samples


def _patch_generator(module) -> None:
    wrap(module.SamplesGenerator, "generate_samples", _wrap_generate, tag=WRAP_TAG)


def install() -> bool:
    if not os.environ.get(ENV):
        return False
    after_import(LOGGER_MODULE, _patch_logger)
    if os.environ.get(EVAL_BEFORE_ENV) == "1":
        after_import(GENERATOR_MODULE, _patch_generator)
    return True
