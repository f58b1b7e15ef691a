"""Reading a run's per-step metrics from whatever its host wrote: JSON lines, a console log, or
TensorBoard event files — from a run that never loaded this package too.

What each host writes, read from its source (veRL 0.9.1, OpenRLHF 0.11.2):

- veRL's ``file`` logger (``verl/utils/tracking.py``, ``FileLogger.log``): one JSON object per
  step, ``{"step": N, "data": {"timing_s/gen": ..., ...}}``, at ``VERL_FILE_LOGGER_PATH`` or
  ``$VERL_FILE_LOGGER_ROOT/<project>/<experiment>.jsonl``;
- veRL's ``console`` logger (``verl/utils/logger/aggregate_logger.py``, ``concat_dict_to_str``):
  ``step:N - key:value - key:value ...``, each value ``pprint.pformat`` of a number (numpy 2
  writes ``np.float64(1.5)``); Ray prefixes a worker's lines with ``(TaskRunner pid=...)``;
- veRL's ``tensorboard`` logger (``_TensorboardAdapter``): ``add_scalar(key, value, step)``;
- OpenRLHF's console (``trainer/ppo_trainer.py:549``, ``ppo_trainer_async.py``): a log line
  ``... Global step N: {'timing/generation': ..., ...}`` (the status dict's repr);
- OpenRLHF's TensorBoard (``utils/logging_utils.py``, ``TensorboardLogger.log_train``):
  ``add_scalar("train/" + key, value, step)``;
- this package's JSON lines: the OpenRLHF hook's ``{"step", "kind": "train", "data"}``
  (``integrations/openrlhf/metrics.py``) and the embedded trainer's flat ``{"kind": "step",
  "step", "time/...": ...}`` (``trainer/logger.py``).

``read_run(path)`` takes a file or a directory and returns a ``RunLog``: the host (told by the
timing keys), the file it read, its format, and the steps' metrics in step order.
"""

from __future__ import annotations

import ast
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from .tfevents import EVENT_FILE_MARK, read_scalars

__all__ = ["HOST_KEYS", "NoTimingKeys", "RunLog", "detect_host", "parse_console", "parse_jsonl", "read_run"]

# a key that tells the host; the first host with a match wins
HOST_KEYS = {
    "verl": ("timing_s/step", "timing_s/gen"),
    "openrlhf": ("timing/step_total", "timing/generation"),
    "trainer": ("time/step", "time/rollout"),
}
CONSOLE_SUFFIXES = (".log", ".txt", ".out", ".err")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_VERL_LINE = re.compile(r"(?:^|\s)step:(\d+) - (.*)$")
_ORL_LINE = re.compile(r"Global step (\d+): (\{.*\})\s*$")
# a number as pprint / repr writes it, bare or wrapped: 1.5, np.float64(1.5), tensor(1.5), nan
_NUMBER = (r"(?:(?:np\.|numpy\.)?[A-Za-z_0-9]*\()?\s*"
           r"([-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|nan|inf))")
_NUM_VALUE = re.compile(r"^" + _NUMBER)
_ORL_PAIR = re.compile(r"'([^']+)':\s*" + _NUMBER)


class NoTimingKeys(ValueError):
    """The file or directory holds no step timing of a known host."""


@dataclass(frozen=True)
class RunLog:
    """One run's steps: ``steps`` is ``[(step, {metric: value})]`` in step order (a step logged
    twice, e.g. after a resume, keeps its last record)."""

    host: str
    source: str
    fmt: str
    steps: tuple[tuple[int, dict[str, float]], ...]


def _number(text: str) -> float | None:
    m = _NUM_VALUE.match(text.strip())
    return float(m.group(1)) if m else None


def _clean(metrics: dict) -> dict[str, float]:
    out = {}
    for k, v in metrics.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if math.isfinite(v):
            out[str(k)] = float(v)
    return out


def parse_jsonl(text: str) -> list[tuple[int, dict[str, float]]]:
    """Step records of a JSON-lines file in any of the layouts above; a line that is not a JSON
    object, or a record of another kind (evaluation, warm-up), is skipped."""
    out = []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict) or rec.get("kind") not in (None, "train", "step"):
            continue
        step = rec.get("step")
        if isinstance(step, bool) or not isinstance(step, (int, float)):
            continue
        data = rec["data"] if isinstance(rec.get("data"), dict) else {k: v for k, v in rec.items() if k != "step"}
        out.append((int(step), _clean(data)))
    return out


def _verl_pairs(body: str) -> dict[str, float]:
    out = {}
    for part in body.split(" - "):
        key, sep, value = part.rpartition(":")
        if sep and key and (v := _number(value)) is not None and math.isfinite(v):
            out[key.strip()] = v
    return out


def _openrlhf_pairs(body: str) -> dict[str, float]:
    try:
        data = ast.literal_eval(body)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        data = None  # a value like np.float64(...) or tensor(...): read the pairs one by one
    if isinstance(data, dict):
        return _clean(data)
    return {k: float(v) for k, v in _ORL_PAIR.findall(body) if math.isfinite(float(v))}


def parse_console(text: str) -> list[tuple[int, dict[str, float]]]:
    """Step records of a console log: veRL's ``step:N - key:value`` lines and OpenRLHF's
    ``Global step N: {...}`` lines, anywhere on a line (after a Ray or logging prefix, with or
    without colour codes)."""
    out = []
    for raw in text.splitlines():
        line = _ANSI.sub("", raw).rstrip("\r")
        if (m := _VERL_LINE.search(line)) is not None:
            out.append((int(m.group(1)), _verl_pairs(m.group(2))))
        elif (m := _ORL_LINE.search(line)) is not None:
            out.append((int(m.group(1)), _openrlhf_pairs(m.group(2))))
    return out


def _tensorboard(files: list[Path]) -> list[tuple[int, dict[str, float]]]:
    merged: dict[int, dict[str, float]] = {}
    for f in sorted(files, key=lambda p: p.name):  # the name carries the start time: a resume's file is later
        for step, values in read_scalars(f).items():
            merged.setdefault(step, {}).update(values)
    rows = sorted(merged.items())
    if any(k.startswith("train/timing/") for _, d in rows for k in d):  # OpenRLHF's "train/" prefix
        rows = [(s, {k.removeprefix("train/"): v for k, v in d.items() if not k.startswith("eval/")})
                for s, d in rows]
    return rows


def detect_host(steps: list[tuple[int, dict[str, float]]]) -> str | None:
    """``verl``, ``openrlhf`` or ``trainer`` from the timing keys the steps carry, else None."""
    keys = {k for _, d in steps for k in d}
    for host, marks in HOST_KEYS.items():
        if any(m in keys for m in marks):
            return host
    return None


def _dedupe(steps: list[tuple[int, dict[str, float]]]) -> tuple[tuple[int, dict[str, float]], ...]:
    by_step: dict[int, dict[str, float]] = {}
    for s, d in steps:
        if d:
            by_step[s] = d  # the last record of a step wins (a resumed run logs it again)
    return tuple(sorted(by_step.items()))


def _read_file(path: Path) -> tuple[str, list[tuple[int, dict[str, float]]]]:
    if EVENT_FILE_MARK in path.name:
        return "tensorboard", _tensorboard([path])
    text = path.read_text(encoding="utf-8", errors="replace")
    first = next((line for line in text.splitlines() if line.strip()), "")
    if path.suffix == ".jsonl" or first.lstrip().startswith("{"):
        steps = parse_jsonl(text)
        if steps:
            return "jsonl", steps
    return "console", parse_console(text)


def _candidates(root: Path) -> dict[str, list[tuple[str, list[Path]]]]:
    """Per format, the sources under ``root``: each JSONL and console file alone, each folder of
    event files together (one writer's run)."""
    out: dict[str, list[tuple[str, list[Path]]]] = {"jsonl": [], "tensorboard": [], "console": []}
    event_dirs: dict[Path, list[Path]] = {}
    for p in sorted(root.rglob("*")):
        if not p.is_file():
            continue
        if EVENT_FILE_MARK in p.name:
            event_dirs.setdefault(p.parent, []).append(p)
        elif p.suffix == ".jsonl":
            out["jsonl"].append((str(p), [p]))
        elif p.suffix in CONSOLE_SUFFIXES:
            out["console"].append((str(p), [p]))
    out["tensorboard"] = [(str(d), files) for d, files in sorted(event_dirs.items())]
    return out


def _from_directory(root: Path) -> RunLog:
    for fmt, sources in _candidates(root).items():  # JSONL first, then TensorBoard, then console logs
        found = []
        for name, files in sources:
            steps = _tensorboard(files) if fmt == "tensorboard" else _read_file(files[0])[1]
            if (host := detect_host(steps)) is not None:
                found.append(RunLog(host, name, fmt, _dedupe(steps)))
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            names = ", ".join(r.source for r in found[:6]) + (" ..." if len(found) > 6 else "")
            raise ValueError(f"{root} holds {len(found)} runs' {fmt} metrics ({names}): pass one of them")
    raise NoTimingKeys(_no_keys(root))


def _no_keys(path: Path) -> str:
    return (f"{path}: no step timings found (veRL's timing_s/*, OpenRLHF's timing/*, the embedded trainer's "
            "time/*): give the run's console log, its metrics JSONL (veRL: trainer.logger=[console,file]) or its "
            "TensorBoard folder")


def read_run(path: str | Path) -> RunLog:
    """The run's steps from ``path``: a metrics JSONL, a console log, a TensorBoard event file, or
    a directory holding one run's (JSONL preferred over TensorBoard over console logs). Raises
    FileNotFoundError for a missing path, NoTimingKeys when nothing holds step timings,
    ValueError when a directory holds several runs."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p} does not exist: give a run's log file or directory")
    if p.is_dir():
        return _from_directory(p)
    fmt, steps = _read_file(p)
    host = detect_host(steps)
    if host is None:
        raise NoTimingKeys(_no_keys(p))
    return RunLog(host, str(p), fmt, _dedupe(steps))
