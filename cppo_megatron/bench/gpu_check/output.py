"""gpu-check's output files: gpu_check.json (every number, the machine, the settings, each
check's failures and traceback) and gpu_check.md (a summary table and each check's numbers)."""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .settings import CheckResult, GpuCheckSettings

__all__ = ["write_outputs"]


def _jsonable(o):
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, dict):
        return {str(k): _jsonable(v) for k, v in o.items() if not str(k).startswith("_")}
    if isinstance(o, (list, tuple)):
        return [_jsonable(v) for v in o]
    if isinstance(o, torch.Tensor):
        return _jsonable(o.tolist())
    if isinstance(o, (torch.dtype, torch.device, Path)):
        return str(o)
    return o


def write_outputs(results: list[CheckResult], s: GpuCheckSettings, total_s: float) -> dict[str, str]:
    """gpu_check.json (every number) and gpu_check.md (summary + per-check numbers) in ``s.out``."""
    from ... import __version__
    from ..report import machine_info, markdown_table

    out = Path(s.out)
    out.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    data = {
        "tool": "cppo-megatron gpu-check",
        "version": __version__,
        "settings": asdict(s),
        "passed": all(r.passed for r in results),
        "total_seconds": total_s,
        "machine": machine,
        "peak_memory_mib": {r.name: r.peak_memory_mib for r in results},
        "checks": [asdict(r) for r in results],
    }
    env = next((r for r in results if r.name == "environment"), None)
    if env is not None and env.numbers.get("gpus"):
        machine["gpus"] = env.numbers["gpus"]
    (out / "gpu_check.json").write_text(json.dumps(_jsonable(data), indent=2, allow_nan=False) + "\n")

    head = "GPU" if s.device == "cuda" else "CPU"
    gpus = env.numbers.get("gpus") if env else None
    where = (", ".join(f"{g['name']} ({g['memory_gib']} GiB)" for g in gpus) if gpus
             else f"{os.cpu_count()} CPU cores")
    lines = [
        f"# cppo-megatron gpu-check ({head}{', quick' if s.quick else ''}): "
        f"{'PASSED' if data['passed'] else 'FAILED'}",
        "",
        f"- machine: {where}; python {sys.version.split()[0]}, torch {torch.__version__}"
        f"{', CUDA ' + str(torch.version.cuda) if torch.version.cuda else ''}",
        f"- total {total_s:.1f} s; written {machine['time_utc']}",
        "",
        markdown_table(
            ["check", "result", "seconds", "budget", "peak memory (MiB)"],
            [{"check": r.name, "result": "pass" if r.passed else "FAIL", "seconds": r.seconds,
              "budget": r.budget_s, "peak memory (MiB)": r.peak_memory_mib} for r in results],
            {"seconds": ".1f", "budget": ".0f", "peak memory (MiB)": ".0f"},
        ),
    ]
    for r in results:
        lines += ["", f"## {r.title}", ""]
        if not r.passed:
            lines += [f"- **FAILED**: {x}" for x in ([r.error] if r.error else []) + list(r.failures)] + [""]
        lines.append(f"- peak memory: {r.peak_memory_mib:.0f} MiB ({r.memory_kind})" if r.peak_memory_mib is not None
                     else "- peak memory: -")
        if r.numbers.get("rows"):  # the trainer's and the study's tables
            rows = r.numbers["rows"]
            lines += ["", markdown_table(list(rows[0]), rows), ""]
            lines += [f"- {k}: {_short(v)}" for k, v in r.numbers.items() if k != "rows"]
        else:
            lines += [f"- {k}: {_short(v)}" for k, v in _flat(r.numbers)]
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")
    return {"json": str(out / "gpu_check.json"), "md": str(out / "gpu_check.md")}


def _flat(d: dict, prefix: str = ""):
    for k, v in d.items():
        if str(k).startswith("_"):
            continue
        if isinstance(v, dict) and k not in ("model", "backends", "tolerances", "timings"):
            yield from _flat(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def _short(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return ", ".join(f"{k}={_short(x)}" for k, x in v.items())
    return str(v)
