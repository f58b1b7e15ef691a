"""What a host's CPU mode prepared for a run (both hosts' ``cpu/prepare.py`` return one)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["CpuRun"]


@dataclass(frozen=True)
class CpuRun:
    """The prepared paths of a CPU run and what was built now (False: reused).

    Attributes:
        model_dir, data_dir, run_dir: the exported start model, the data files, the run's outputs.
        built_model, wrote_data: whether this call built the model / wrote the data (else reused).
        start_model: what the warm-up reached (veRL: ``cppo_start_model.json``: accuracy, steps,
            seconds, threads), or None.
        env: variables the host's processes need (OpenRLHF: the Ray workers' environment).
    """

    model_dir: Path
    data_dir: Path
    run_dir: Path
    built_model: bool
    wrote_data: bool
    start_model: dict | None = None
    env: dict = field(default_factory=dict)

    def describe(self) -> str:
        acc = (self.start_model or {}).get("accuracy")
        what = "exported now" if self.built_model else "reused"
        what += f", held-out accuracy {acc:.3f}" if isinstance(acc, (int, float)) else ""
        return (f"cpu mode: model {self.model_dir} ({what}), "
                f"data {self.data_dir} ({'written now' if self.wrote_data else 'reused'}), "
                f"metrics {self.run_dir / 'metrics.jsonl'}")
