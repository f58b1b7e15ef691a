"""Writing a benchmark's results: one JSON file, one markdown table, one PNG plot.

Every benchmark returns a ``Report``; ``write_report`` puts ``NAME.json``, ``NAME.md`` and
``NAME.png`` into the output directory. The JSON holds the machine description, the
parameters, the rows of the table and free-form extras, so a later run can be compared
to it without re-parsing the markdown.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Report", "write_report", "publish", "machine_info", "markdown_table", "median", "plot_step_split",
           "seconds_per_prompt"]


def median(values) -> float:
    xs = sorted(float(v) for v in values)
    if not xs:
        raise ValueError("median of no values")
    m = len(xs) // 2
    return xs[m] if len(xs) % 2 else 0.5 * (xs[m - 1] + xs[m])


def seconds_per_prompt(rows: list[dict], skip: int, *, step_key: str, phase_prefix: str, phases: tuple[str, ...],
                       hint: str) -> dict:
    """Median seconds per prompt, of the whole step (``step_key``) and of each phase
    (``phase_prefix + phase``), over a host's logged steps after the first ``skip`` (the host
    benchmarks' summary: ``bench verl``, ``bench openrlhf``). A step without ``cppo/num_groups``
    is an error ending in ``hint`` (how the run should have been made)."""
    steps = [r for r in rows if step_key in r][skip:]
    if not steps:
        raise ValueError(f"no timed steps left after skipping {skip}: raise --steps")
    missing = [r["step"] for r in steps if "cppo/num_groups" not in r]
    if missing:
        raise ValueError(f"steps {missing} logged no cppo/num_groups: {hint}")
    prompts = [r["cppo/num_groups"] for r in steps]
    out = {"steps": len(steps), "prompts_per_step": median(prompts),
           "trained_per_step": median([r["cppo/num_kept"] for r in steps]),
           "s_per_prompt": median([r[step_key] / p for r, p in zip(steps, prompts, strict=True)]),
           # tokens generated (early stopping's count where it ran, else signal/*'s) and the share stopped
           "tokens_per_prompt": median([r.get("early_stop/tokens_generated", r.get("signal/generated_tokens", 0.0)) / p
                                        for r, p in zip(steps, prompts, strict=True)]),
           "stopped_share": median([r.get("early_stop/stopped_share", 0.0) for r in steps])}
    for phase in phases:
        per_prompt = [r.get(f"{phase_prefix}{phase}", 0.0) / p for r, p in zip(steps, prompts, strict=True)]
        out[f"{phase}_s_per_prompt"] = median(per_prompt)
    return out


def machine_info() -> dict[str, Any]:
    """What ran the benchmark: enough to tell two machines apart, nothing secret."""
    import torch

    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
        "time_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    try:
        import numpy

        info["numpy"] = numpy.__version__
    except ImportError:  # pragma: no cover - numpy is a core dependency
        pass
    return info


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        if v == 0:
            return "0"
        a = abs(v)
        if a >= 1e5 or a < 1e-3:
            return f"{v:.3g}"
        if a >= 100:
            return f"{v:.1f}"
        return f"{v:.4g}"
    return str(v)


def markdown_table(columns: list[str], rows: list[dict[str, Any]], formats: dict[str, str] | None = None) -> str:
    """A markdown table; ``formats`` maps a column to a format spec (e.g. ``.6f``)."""
    formats = formats or {}

    def cell(row, c):
        v = row.get(c)
        if c in formats and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            return format(v, formats[c])
        return _fmt(v)

    head = "| " + " | ".join(columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    body = ["| " + " | ".join(cell(r, c) for c in columns) + " |" for r in rows]
    return "\n".join([head, sep, *body])


def plot_step_split(fig, table: list[dict[str, Any]], *, gen_label: str, title: str) -> None:
    """A host bench's stacked bars: per run, generation and the rest of a step per prompt (ms),
    labelled with the speedup and its bound. ``table`` rows carry ``run``, ``ms/prompt``,
    ``ms/prompt gen``, ``speedup`` and ``bound``; ``gen_label`` names the host's timer."""
    ax = fig.add_subplot(1, 1, 1)
    names = [row["run"] for row in table]
    gen = [row["ms/prompt gen"] for row in table]
    rest = [row["ms/prompt"] - row["ms/prompt gen"] for row in table]
    ax.bar(names, gen, label=f"generation ({gen_label})")
    ax.bar(names, rest, bottom=gen, label="everything else in the step")
    for i, row in enumerate(table):
        bound = "GRPO, larger batch" if row["bound"] is None else f"bound {row['bound']:.2f}x"
        ax.text(i, row["ms/prompt"], f"{row['speedup']:.2f}x ({bound})", ha="center", va="bottom")
    ax.set_ylabel("ms per prompt")
    ax.set_title(title)
    ax.legend()


@dataclass
class Report:
    """One benchmark's results.

    name: file stem (``overhead`` -> overhead.json/.md/.png); title: markdown heading;
    params: the options it ran with; columns/rows: the table (rows are dicts keyed by
    column, extra keys go to the JSON only); notes: lines printed under the table;
    extras: anything else for the JSON; plot: draws onto a matplotlib Figure; formats:
    column -> format spec for the markdown table.
    """

    name: str
    title: str
    params: dict[str, Any]
    columns: list[str]
    rows: list[dict[str, Any]]
    notes: list[str] = field(default_factory=list)
    extras: dict[str, Any] = field(default_factory=dict)
    plot: Callable[[Any], None] | None = None
    formats: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "benchmark": self.name,
            "title": self.title,
            "machine": machine_info(),
            "params": self.params,
            "columns": self.columns,
            "rows": self.rows,
            "notes": self.notes,
            **self.extras,
        }

    def to_markdown(self) -> str:
        parts = [f"### {self.title}", "", markdown_table(self.columns, self.rows, self.formats)]
        if self.notes:
            parts += ["", *[f"- {n}" for n in self.notes]]
        return "\n".join(parts) + "\n"


def _json_default(o: Any):
    try:
        import numpy as np

        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
    except ImportError:  # pragma: no cover
        pass
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"cannot write {type(o).__name__} to JSON")


def write_report(report: Report, out_dir, *, plot: bool = True) -> dict[str, str]:
    """Write NAME.json, NAME.md and (with matplotlib and ``plot``) NAME.png; return the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    data = report.to_json()
    # allow_nan=False: a NaN would make the file unreadable by strict JSON parsers
    text = json.dumps(_finite_or_none(data), indent=2, default=_json_default, allow_nan=False)
    (out / f"{report.name}.json").write_text(text + "\n")
    paths["json"] = str(out / f"{report.name}.json")
    (out / f"{report.name}.md").write_text(report.to_markdown())
    paths["md"] = str(out / f"{report.name}.md")
    if plot and report.plot is not None:
        from .._optional import require

        mpl = require("matplotlib", "benchmark plots (or pass --no-plot)")  # JSON and markdown are written
        mpl.use("Agg")
        import matplotlib.pyplot as plt

        fig = plt.figure(figsize=(7.5, 4.5), dpi=100)
        try:
            report.plot(fig)
            fig.tight_layout()
            fig.savefig(out / f"{report.name}.png")
        finally:
            plt.close(fig)
        paths["png"] = str(out / f"{report.name}.png")
    return paths


def _finite_or_none(o: Any) -> Any:
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, dict):
        return {k: _finite_or_none(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite_or_none(v) for v in o]
    return o


def publish(report: Report, out_dir, *, plot: bool = True) -> dict[str, str]:
    """Write the report's files and print its table and where they went (the commands' output)."""
    from .._optional import MissingDependency

    try:
        paths = write_report(report, out_dir, plot=plot)
    except MissingDependency as exc:  # the JSON and markdown are already written
        print(f"no plot: {exc}")
        paths = write_report(report, out_dir, plot=False)
    print()
    print(report.to_markdown())
    print("wrote " + ", ".join(paths.values()))
    return paths
