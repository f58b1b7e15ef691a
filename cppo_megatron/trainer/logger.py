"""Metrics sinks: JSONL (always) and TensorBoard (when installed)."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path


class MetricsLogger:
    """Appends one JSON object per record to ``metrics.jsonl``; mirrors numeric values to
    TensorBoard under the same keys. On resume, records past the checkpoint's step are
    dropped first so the file never holds two versions of a step; TensorBoard gets the same
    rule (``purge_step``: it hides the earlier files' events from that step on). A new run in
    the same ``out_dir`` starts both afresh: the old ``metrics.jsonl`` and the old runs' event
    files go (TensorBoard would otherwise draw them beside the new run's curves)."""

    def __init__(self, out_dir: Path, *, tensorboard: bool, resume_step: int | None = None) -> None:
        self.path = out_dir / "metrics.jsonl"
        out_dir.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.exists():
            kept = [line for line in self.path.read_text().splitlines() if _keep(line, resume_step)]
            self.path.write_text("".join(line + "\n" for line in kept))
        elif resume_step is None and self.path.exists():
            self.path.unlink()
        self.fh = self.path.open("a")
        self.tb = None
        if tensorboard:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    from torch.utils.tensorboard import SummaryWriter
                tb_dir = out_dir / "tensorboard"
                if resume_step is None:
                    for stale in tb_dir.glob("events.out.tfevents.*"):
                        stale.unlink()
                purge = None if resume_step is None else resume_step + 1
                self.tb = SummaryWriter(str(tb_dir), purge_step=purge)
            except ImportError:
                self.tb = None

    def log(self, record: dict, step: int | None = None) -> None:
        clean = {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in record.items()}
        self.fh.write(json.dumps(clean) + "\n")
        self.fh.flush()
        if self.tb is not None and step is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        self.fh.close()
        if self.tb is not None:
            self.tb.close()


def _keep(line: str, resume_step: int) -> bool:
    try:
        rec = json.loads(line)
    except json.JSONDecodeError:
        return False
    step = rec.get("step")
    return step is None or step <= resume_step


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
