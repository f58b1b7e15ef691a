"""What gpu-check runs and what one check's outcome holds: the check names, their time
budgets, ``GpuCheckSettings`` and ``CheckResult``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["ALL_CHECKS", "CHECKS", "STUDY_CHECKS", "TITLES", "CheckResult", "GpuCheckSettings", "budgets"]

CHECKS = ("environment", "core", "megatron", "trainer")  # what gpu-check runs by default
STUDY_CHECKS = ("environment", "study")  # what gpu-check --study runs
ALL_CHECKS = (*CHECKS, "study")
TITLES = {
    "environment": "environment: device, versions, backends",
    "core": "core: prune + allocation + balancing, device vs CPU",
    "megatron": "megatron-core: log-probs and one update vs HF",
    "trainer": "trainer: GRPO vs CPPO P=0.875, side by side",
    "study": "study: GRPO vs CPPO on the worked-arithmetic testbed at equal wall time",
}

# Time budgets in seconds, per check: (full, quick).
# Full sizes sum to 435 s: the whole run fits the 8 minutes an offline GPU machine gives it; so do
# --study's environment + study (465 s). The quick budgets are loose: they must hold on a shared
# 2-core CI machine.
_BUDGETS = {"environment": (45, 60), "core": (60, 60), "megatron": (150, 120), "trainer": (180, 120),
            "study": (420, 180)}
_PARALLEL_BUDGET = (120, 120)  # the torchrun part of the megatron check, on top of its budget


def budgets(quick: bool, scale: float = 1.0, parallel: int = 0) -> dict[str, float]:
    """Seconds each check may take (``scale`` stretches all of them, for slow machines)."""
    if not (isinstance(scale, (int, float)) and scale > 0):
        raise ValueError(f"budget scale must be > 0, got {scale!r}")
    out = {k: scale * v[1 if quick else 0] for k, v in _BUDGETS.items()}
    if parallel >= 2:
        out["megatron"] += scale * _PARALLEL_BUDGET[1 if quick else 0]
    return out


@dataclass(frozen=True)
class GpuCheckSettings:
    """What to run and where.

    Attributes: device (``cuda`` or ``cpu``), quick (scaled-down sizes: 10^5 completions,
    a tiny Qwen2, a tiny policy), out (directory for gpu_check.json / .md and the trainer's
    run files), seed (every random choice), budget_scale (multiplies every time budget),
    parallel (megatron TP 2 / PP 2 across this many local processes via torchrun; 0 = off),
    only (the checks to run, in ``ALL_CHECKS`` order), study_model (the study's model: a GGUF
    file, an HF directory, ``random``, or None: SmolLM2's GGUF when installed, else random),
    study_seconds (RL seconds per study arm; None: 50 of wall time, 10 of CPU time with quick).
    """

    device: str = "cuda"
    quick: bool = False
    out: str = "runs/gpu_check"
    seed: int = 0
    budget_scale: float = 1.0
    parallel: int = 0
    only: tuple = CHECKS
    study_model: str | None = None
    study_seconds: float | None = None

    def validate(self) -> GpuCheckSettings:
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device must be 'cuda' or 'cpu', got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device cuda but torch {torch.__version__} sees no CUDA device: use --device cpu")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {self.seed!r}")
        if self.parallel not in (0, 2):
            raise ValueError(f"parallel must be 0 (off) or 2 (TP 2 and PP 2 on 2 processes), got {self.parallel!r}")
        if self.parallel and self.device == "cuda" and torch.cuda.device_count() < 2:
            raise ValueError(f"parallel=2 on cuda needs 2 GPUs, torch sees {torch.cuda.device_count()}")
        bad = [c for c in self.only if c not in ALL_CHECKS]
        if bad or not self.only:
            raise ValueError(f"checks must be among {list(ALL_CHECKS)}, got {list(self.only)}")
        if self.study_seconds is not None and not (isinstance(self.study_seconds, (int, float)) and
                                                   self.study_seconds > 0):
            raise ValueError(f"--study-seconds must be > 0, got {self.study_seconds!r}")
        if self.study_model not in (None, "random") and not Path(self.study_model).exists():
            raise ValueError(f"--study-model {self.study_model} does not exist: give a GGUF file, an HF model "
                             "directory, or random")
        budgets(self.quick, self.budget_scale)
        return self


@dataclass(frozen=True)
class CheckResult:
    """One check's outcome. ``failures`` lists each missed criterion (empty when passed);
    ``numbers`` holds everything measured; ``peak_memory_mib`` is described by
    ``memory_kind``."""

    name: str
    title: str
    passed: bool
    seconds: float
    budget_s: float
    peak_memory_mib: float | None
    memory_kind: str
    numbers: dict
    failures: tuple = ()
    error: str | None = None
    traceback: str | None = None
