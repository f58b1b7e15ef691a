"""What ``bench verl`` and ``bench openrlhf`` share: the checks of their arguments, the loop over
their variants (reuse a finished run or launch it, then summarize its metrics), and the table of
every run against GRPO and the same-batch GRPO with its notes.

Each host brings what is its own: the variants' overrides, how one run is launched, how its
metrics file is read and summarized, and which timing keys are generation and which the rest.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

from .samebatch import rows_against_both, same_batch_note

__all__ = ["check_args", "compare", "extras", "notes", "run_variants"]

Summary = dict
Results = dict[str, tuple[list[dict], Summary]]


def check_args(args: argparse.Namespace) -> None:
    """Refuse what no run can fix: a rate outside (0, 1), no step left after ``--skip``, a missing recipe."""
    if not 0.0 < args.rate < 1.0:
        raise ValueError(f"--rate must be in (0, 1), got {args.rate}")
    if args.steps <= args.skip:
        raise ValueError(f"--steps ({args.steps}) must exceed --skip ({args.skip})")
    if not Path(args.recipe).is_file():
        raise ValueError(f"recipe {args.recipe!r} not found")


def run_variants(variants: list[tuple[str, list[str]]], *, host: str, runs_dir: Path, step_key: str, steps: int,
                 skip: int, reuse: bool, read: Callable[[Path], list[dict]],
                 launch: Callable[[str, Path, list[str]], list[dict]],
                 summarize: Callable[[list[dict], int], Summary]) -> Results:
    """``{name: (rows, summary)}`` in running order, one run per variant ``(name, overrides)``.

    A variant's run lives in ``runs_dir/<slug>/metrics.jsonl`` (slug: the name without spaces and
    ``=``). With ``reuse``, a run whose file already holds ``steps`` rows with ``step_key`` is read
    back instead of run again; otherwise ``launch(slug, run_dir, overrides)`` runs it (after the old
    file is removed: the hosts' loggers append) and returns its rows. ``summarize(rows, skip)``
    gives each run's summary.
    """
    results: Results = {}
    for name, extra in variants:
        slug = name.replace(" ", "_").replace("=", "")
        run_dir = (runs_dir / slug).resolve()
        metrics_file = run_dir / "metrics.jsonl"
        done = read(metrics_file) if metrics_file.is_file() else []
        if reuse and sum(step_key in r for r in done) >= steps:
            print(f"bench {host}: reusing {name} from {run_dir}", flush=True)
        else:
            if metrics_file.exists():
                metrics_file.unlink()
            done = launch(slug, run_dir, extra)
        results[name] = (done, summarize(done, skip))
    return results


def compare(results: Results, rate: float, gen_keys: tuple[str, ...],
            rest_keys: tuple[str, ...]) -> tuple[list[dict], dict]:
    """The table rows and phase splits of ``samebatch.rows_against_both`` from the runs' summaries;
    ``gen_keys`` / ``rest_keys``: the host's timing keys (``prefix/phase``) of generation and the rest."""
    gen, rest = tuple(k.split("/")[1] for k in gen_keys), tuple(k.split("/")[1] for k in rest_keys)
    return rows_against_both({k: v[1] for k, v in results.items()}, rate, gen, rest)


def notes(split_line: str, table: list[dict], processes: str, started: float) -> list[str]:
    """The report's notes: the GRPO phase split (``split_line``, the host's words), the bound, the
    same-batch comparison, how the runs were made (``processes``: "veRL processes") and the time
    since ``started`` (``time.perf_counter``)."""
    return [
        split_line,
        "bound S_max(P) = (T_gen + T_rest) / (T_gen + (1-P) T_rest); 'of bound' = speedup / S_max",
        *same_batch_note(table),
        f"runs are sequential {processes} from the same start model and seed (not interleaved)",
        f"total bench time {time.perf_counter() - started:.0f} s",
    ]


def extras(split: dict, results: Results) -> dict:
    """The report's extras: GRPO's phase split per prompt, the same-batch GRPO's (None without it) and
    every run's rows by name."""
    return {"phase_split": {"t_gen_per_prompt_s": split["t_gen_per_prompt_s"],
                            "t_rest_per_prompt_s": split["t_rest_per_prompt_s"]},
            "phase_split_same_batch": split["same_batch"],
            "runs": {k: v[0] for k, v in results.items()}}
