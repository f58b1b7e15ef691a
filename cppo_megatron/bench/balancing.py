"""Our ``balance_partitions`` against veRL's ``get_seqlen_balanced_partitions`` and the naive split.

Same inputs for all three: sequence lengths from one of four distributions, turned into
workloads with veRL's objective ``24576 * len + len**2`` (``sequence_workload`` defaults),
onto k ranks, with and without equal-size parts. Reported per input: imbalance
(max / mean rank workload), gap to the lower bound (max / bound - 1, the same bound for
everyone) and the median time of the call.

veRL is imported lazily; without it the comparison columns are empty and a note says so.
Its API asserts N >= k, and with equal_size N divisible by k: those cases are skipped for
veRL (and noted), never forced.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from ..core import balance_partitions, lower_bound, naive_partition, sequence_workload
from .report import Report, median

__all__ = ["BalanceSettings", "DISTRIBUTIONS", "sample_lengths", "run_balance", "verl_partitioner"]


def _uniform(rng, n):
    return rng.integers(16, 4097, n)


def _lognormal(rng, n):  # reasoning traces: most short, a long tail up to the cap
    return np.clip(rng.lognormal(6.5, 0.9, n), 16, 16384).round()


def _bimodal(rng, n):  # a mix of direct answers and long chains of thought
    long = rng.random(n) < 0.3
    return np.where(long, rng.normal(6000, 1500, n), rng.normal(300, 80, n)).clip(16, 16384).round()


def _equal(rng, n):
    return np.full(n, 1024)


DISTRIBUTIONS: dict[str, Callable] = {
    "uniform": _uniform,
    "lognormal": _lognormal,
    "bimodal": _bimodal,
    "equal": _equal,
}


def sample_lengths(distribution: str, n: int, seed: int) -> np.ndarray:
    """[n] int64 sequence lengths from a named distribution (see ``DISTRIBUTIONS``)."""
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"distribution must be one of {sorted(DISTRIBUTIONS)}, got {distribution!r}")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an integer >= 1, got {n!r}")
    return DISTRIBUTIONS[distribution](np.random.default_rng(seed), n).astype(np.int64)


def verl_partitioner() -> Callable | None:
    """veRL's balancer, or None when veRL is not importable."""
    try:
        from verl.utils.seqlen_balancing import get_seqlen_balanced_partitions
    except Exception:  # noqa: BLE001 - veRL missing or broken: the comparison is skipped
        return None
    return get_seqlen_balanced_partitions


@dataclass
class BalanceSettings:
    distributions: list[str] = field(default_factory=lambda: list(DISTRIBUTIONS))
    ranks: list[int] = field(default_factory=lambda: [2, 8, 64, 256])
    items_per_rank: int = 16
    equal_size: list[bool] = field(default_factory=lambda: [False, True])
    repeats: int = 3
    seed: int = 0
    compare_verl: bool = True

    def validate(self) -> BalanceSettings:
        for d in self.distributions:
            if d not in DISTRIBUTIONS:
                raise ValueError(f"distribution must be one of {sorted(DISTRIBUTIONS)}, got {d!r}")
        if not self.ranks or any((not isinstance(k, int)) or k < 1 for k in self.ranks):
            raise ValueError(f"ranks must be integers >= 1, got {self.ranks!r}")
        for name in ("items_per_rank", "repeats"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        return self


def _timed_interleaved(fns: dict, repeats: int):
    """Call each function once per round, in turn (A B A B ...), so machine drift hits all
    alike; return each one's last result, median wall time and median process CPU time
    (CPU time is less disturbed by other jobs on a shared machine)."""
    outs: dict[str, Any] = {}
    wall: dict[str, list[float]] = {name: [] for name in fns}
    cpu: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            c0, t0 = time.process_time(), time.perf_counter()
            outs[name] = fn()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    return outs, {n: median(v) for n, v in wall.items()}, {n: median(v) for n, v in cpu.items()}


def _loads_of(parts, w: np.ndarray) -> np.ndarray:
    return np.array([w[np.asarray(p, dtype=np.int64)].sum() for p in parts], dtype=np.float64)


def _measure(dist: str, k: int, eq: bool, lengths: np.ndarray, repeats: int, verl_fn) -> dict:
    """One input's row: our balancer, veRL's (``verl_fn``, None: not compared) and the naive split,
    their imbalance, gap to the lower bound and median time."""
    n = len(lengths)
    w_t = sequence_workload(torch.from_numpy(lengths))
    w = w_t.numpy()
    lb = lower_bound(w, k, equal_size=eq)
    fns = {"ours": functools.partial(balance_partitions, w_t, k, equal_size=eq)}
    if verl_fn is not None:
        # veRL's _balance_batch passes the integer workloads as a list
        wl = (24576 * lengths + lengths * lengths).tolist()
        fns["verl"] = functools.partial(verl_fn, wl, k_partitions=k, equal_size=eq)
    outs, times, cpu = _timed_interleaved(fns, repeats)
    ours = outs["ours"]
    naive = naive_partition(w, k)
    row = {
        "distribution": dist,
        "ranks": k,
        "items": n,
        "equal_size": eq,
        "ours_imbalance": ours.imbalance,
        "ours_gap": ours.max_load / lb - 1,
        "ours_ms": 1e3 * times["ours"],
        "ours_cpu_ms": 1e3 * cpu["ours"],
        "ours_method": ours.method,
        "naive_imbalance": naive.imbalance,
        "verl_imbalance": None,
        "verl_gap": None,
        "verl_ms": None,
        "verl_cpu_ms": None,
        "lower_bound_imbalance": lb / (w.sum() / k),
    }
    if verl_fn is not None:
        loads = _loads_of(outs["verl"], w)
        row["verl_imbalance"] = float(loads.max() / loads.mean())
        row["verl_gap"] = float(loads.max() / lb - 1)
        row["verl_ms"] = 1e3 * times["verl"]
        row["verl_cpu_ms"] = 1e3 * cpu["verl"]
    if row["verl_imbalance"] is not None:
        row["ours_le_verl"] = bool(ours.max_load <= row["verl_imbalance"] * (w.sum() / k) * (1 + 1e-12))
        row["time_ratio"] = row["ours_cpu_ms"] / row["verl_cpu_ms"] if row["verl_cpu_ms"] else None
    return row


def _balance_notes(s: BalanceSettings, compared: list[dict], verl_fn, skipped_verl: int) -> list[str]:
    """How the inputs were made and measured, and the verdict against veRL (or why there is none)."""
    notes = [
        f"N = {s.items_per_rank} x ranks sequences; workload 24576*len + len^2 (veRL's objective); "
        f"median of {s.repeats} calls, ours and veRL interleaved, as process CPU time (wall time in the JSON); "
        "gap = max rank load / lower bound - 1 (same bound for all).",
        "Distributions: uniform [16, 4096]; lognormal(6.5, 0.9) clipped [16, 16384] (reasoning traces); "
        "bimodal 70% ~N(300, 80) + 30% ~N(6000, 1500); equal: all 1024.",
        "naive = contiguous chunks, what a pipeline without rebalancing gets after pruning.",
    ]
    if verl_fn is None:
        notes.append(
            "veRL is not installed (or was disabled): no comparison. Install it with "
            "pip install -c constraints/cpu.txt 'cppo-megatron[verl]'."
        )
        return notes
    import verl

    wins = sum(r["ours_le_verl"] for r in compared)
    faster = sum(1 for r in compared if r["time_ratio"] is not None and r["time_ratio"] <= 1.0)
    within = sum(1 for r in compared if r["time_ratio"] is not None and r["time_ratio"] <= 1.5)
    notes.append(
        f"veRL {getattr(verl, '__version__', '?')}: ours at or below veRL's imbalance on {wins}/{len(compared)} "
        f"inputs; no more CPU time on {faster}/{len(compared)} (within 1.5x on {within}/{len(compared)})."
    )
    if skipped_verl:
        notes.append(f"{skipped_verl} input(s) skipped for veRL: its equal_size needs N divisible by k.")
    return notes


def _log_scatter(ax, x, labels: list[str], series: list[tuple[str, str, list]], ylabel: str, title: str) -> None:
    """One log-scale panel, a point per input and a marker per series ``(label, marker, values)``."""
    for label, marker, values in series:
        ax.scatter(x, values, marker=marker, s=14, label=label)
    ax.set_yscale("log")
    ax.set_xticks(x, labels, rotation=90, fontsize=5)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)


def _plot_balance(fig, rows: list[dict], compared: bool) -> None:
    """Gap to the lower bound (left) and CPU time per call (right) of every input."""
    labels = [f"{r['distribution'][:4]} k{r['ranks']}{'=' if r['equal_size'] else ''}" for r in rows]
    x = np.arange(len(rows))
    floor = 1e-9
    gaps = [("ours", "o", [max(r["ours_gap"], floor) for r in rows])]
    times = [("ours", "o", [max(r["ours_cpu_ms"], 1e-3) for r in rows])]
    if compared:
        gaps.append(("veRL", "x", [max(r["verl_gap"], floor) if r["verl_gap"] is not None else np.nan for r in rows]))
        times.append(("veRL", "x", [max(r["verl_cpu_ms"], 1e-3) if r["verl_cpu_ms"] is not None else np.nan
                                    for r in rows]))
    gaps.append(("naive", "^", [max(r["naive_imbalance"] / r["lower_bound_imbalance"] - 1, floor) for r in rows]))
    _log_scatter(fig.add_subplot(1, 2, 1), x, labels, gaps, "gap to lower bound (max/bound - 1)",
                 "balance quality (lower is better)")
    _log_scatter(fig.add_subplot(1, 2, 2), x, labels, times, "CPU ms per call (median)", "time")


def run_balance(s: BalanceSettings, *, log=print) -> Report:
    s.validate()
    verl_fn = verl_partitioner() if s.compare_verl else None
    rows = []
    skipped_verl = 0
    for dist in s.distributions:
        for k in s.ranks:
            n = k * s.items_per_rank
            lengths = sample_lengths(dist, n, s.seed + k)
            for eq in s.equal_size:
                use_verl = verl_fn is not None and not (n < k or (eq and n % k))
                if verl_fn is not None and not use_verl:
                    skipped_verl += 1
                row = _measure(dist, k, eq, lengths, s.repeats, verl_fn if use_verl else None)
                rows.append(row)
                log(
                    f"balance: {dist:<9} k={k:<4} N={n:<5} equal={str(eq):<5}: ours {row['ours_imbalance']:.6f} "
                    f"({row['ours_ms']:.1f} ms)  veRL "
                    + (f"{row['verl_imbalance']:.6f} ({row['verl_ms']:.1f} ms)" if row["verl_imbalance"] else "-")
                    + f"  naive {row['naive_imbalance']:.4f}"
                )
    compared = [r for r in rows if r.get("verl_imbalance") is not None]
    return Report(
        name="balance",
        title="Balancer: ours vs veRL get_seqlen_balanced_partitions vs contiguous split",
        params=asdict(s),
        columns=["distribution", "ranks", "items", "equal_size", "ours_imbalance", "verl_imbalance",
                 "naive_imbalance", "ours_gap", "verl_gap", "ours_cpu_ms", "verl_cpu_ms"],
        rows=rows,
        notes=_balance_notes(s, compared, verl_fn, skipped_verl),
        plot=lambda fig: _plot_balance(fig, rows, bool(compared)),
        formats={"ours_imbalance": ".6f", "verl_imbalance": ".6f", "naive_imbalance": ".4f", "ours_gap": ".1e",
                 "verl_gap": ".1e", "ours_cpu_ms": ".2f", "verl_cpu_ms": ".2f"},
    )


# ----------------------------------------------------------------------------- command line
def configure(parser) -> None:
    def ints(text):
        return [int(x) for x in text.split(",") if x.strip()]

    def names(text):
        return [x.strip() for x in text.split(",") if x.strip()]

    parser.add_argument("--distributions", type=names, default=list(DISTRIBUTIONS),
                        help=f"comma-separated, from {','.join(DISTRIBUTIONS)} (default all)")
    parser.add_argument("--ranks", type=ints, default=[2, 8, 64, 256], help="comma-separated (default 2,8,64,256)")
    parser.add_argument("--items-per-rank", type=int, default=16, help="N = this x ranks sequences (default 16)")
    parser.add_argument("--equal-size", choices=["both", "on", "off"], default="both",
                        help="equal-size parts: both (default), on, off")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per input; the median is reported")
    parser.add_argument("--no-verl", action="store_true", help="skip the veRL comparison")
    parser.add_argument("--seed", type=int, default=0)


def run(args) -> Report:
    eq = {"both": [False, True], "on": [True], "off": [False]}[args.equal_size]
    return run_balance(BalanceSettings(
        distributions=args.distributions, ranks=args.ranks, items_per_rank=args.items_per_rank,
        equal_size=eq, repeats=args.repeats, seed=args.seed, compare_verl=not args.no_verl,
    ))
