"""What the CPPO decision costs per step: advantages + selection + allocation + balancing.

For each batch size N (completions in one step) the four phases run on a synthetic step
(Bernoulli rewards with a per-prompt success rate, long-tailed lengths) with one CPU
thread and with the default thread count; the median over ``repeats`` is reported.

The share of a training step needs a measured step time, which only a training run has:
pass ``step_seconds`` (e.g. the ``summary.json`` of a ``train`` run) and each row gets
``share_of_step`` = overhead / step time. Without it, that column is left empty.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..config import CPPOConfig
from ..core import AllocationPlanner, balance_partitions, group_advantages, select_completions, sequence_workload
from .report import Report, median

__all__ = ["OverheadSettings", "run_overhead", "load_step_seconds", "synthetic_step", "PHASES"]

PHASES = ("advantage", "selection", "allocation", "balancing")


@dataclass
class OverheadSettings:
    sizes: list[int] = field(default_factory=lambda: [1_000, 10_000, 100_000, 1_000_000])
    group_size: int = 16
    pruning_rate: float = 0.875
    scope: str = "group"
    ranks: int = 8
    equal_size: bool = False
    repeats: int = 5
    threads: list[int] = field(default_factory=lambda: [1, 0])  # 0 = torch's default
    seed: int = 0
    step_seconds: float | None = None

    def validate(self) -> OverheadSettings:
        if not self.sizes or any((not isinstance(n, int)) or n < 1 for n in self.sizes):
            raise ValueError(f"sizes must be positive integers, got {self.sizes!r}")
        for name in ("group_size", "ranks", "repeats"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if any(n < self.group_size for n in self.sizes):
            raise ValueError(f"every size must hold at least one group of {self.group_size}, got {self.sizes}")
        if any((not isinstance(t, int)) or t < 0 for t in self.threads) or not self.threads:
            raise ValueError(f"threads must be integers >= 0 (0 = default), got {self.threads!r}")
        if self.step_seconds is not None and not (self.step_seconds > 0):
            raise ValueError(f"step_seconds must be > 0, got {self.step_seconds!r}")
        CPPOConfig(pruning_rate=self.pruning_rate, scope=self.scope)  # validates P and scope
        return self


def load_step_seconds(value: str) -> float:
    """A number of seconds, or a JSON file with a top-level ``step_seconds`` (the
    ``summary.json`` a ``cppo-megatron train`` run writes: its median step time)."""
    try:
        x = float(value)
    except ValueError:
        path = Path(value)
        if not path.is_file():
            raise ValueError(f"--step-seconds must be a number or a JSON file, got {value!r}") from None
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or "step_seconds" not in data:
            raise ValueError(f"{path} has no top-level 'step_seconds' key") from None
        x = float(data["step_seconds"])
    if not x > 0:
        raise ValueError(f"step seconds must be > 0, got {x}")
    return x


def synthetic_step(n: int, group_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One seeded synthetic batch of ``n`` completions in groups of ``group_size``: binary
    rewards [n] float32 (a per-prompt success rate), group ids [n] int64, lognormal lengths
    [n] (8..16384 tokens), as ``(rewards, group_ids, lengths)``."""
    gen = torch.Generator().manual_seed(seed)
    prompts = -(-n // group_size)
    rate = torch.rand(prompts, generator=gen)  # per-prompt success rate
    gids = torch.arange(prompts).repeat_interleave(group_size)[:n]
    rewards = (torch.rand(n, generator=gen) < rate[gids]).float()
    rng = np.random.default_rng(seed)
    lengths = torch.from_numpy(rng.lognormal(6.0, 1.0, n).round().clip(8, 16384))
    return rewards, gids, lengths


def _one_pass(cfg: CPPOConfig, rewards, gids, lengths, group_size: int, ranks: int, equal_size: bool, step: int):
    t0 = time.perf_counter()
    adv, stats = group_advantages(rewards, gids, adv_norm=cfg.adv_norm, eps=cfg.eps)
    t1 = time.perf_counter()
    sel = select_completions(adv, gids, cfg, step=step, stats=stats)
    t2 = time.perf_counter()
    planner = AllocationPlanner.from_config(cfg, capacity=max(1, sel.num_kept), group_size=group_size)
    planner.begin_step()
    planner.record_round(int(stats.group_ids.numel()), int(gids.numel()))
    planner.end_step(sel)
    t3 = time.perf_counter()
    w = sequence_workload(lengths[sel.kept], linear=cfg.workload_linear, quadratic=cfg.workload_quadratic)
    part = balance_partitions(w, min(ranks, max(1, sel.num_kept)), equal_size=equal_size)
    t4 = time.perf_counter()
    return (t1 - t0, t2 - t1, t3 - t2, t4 - t3), sel.num_kept, part


def run_overhead(s: OverheadSettings, *, log=print) -> Report:
    s.validate()
    cfg = CPPOConfig(pruning_rate=s.pruning_rate, scope=s.scope, seed=s.seed)
    default_threads = torch.get_num_threads()
    rows = []
    for threads in s.threads:
        nthreads = threads or default_threads
        torch.set_num_threads(nthreads)
        try:
            for n in s.sizes:
                rewards, gids, lengths = synthetic_step(n, s.group_size, s.seed)
                _one_pass(cfg, rewards, gids, lengths, s.group_size, s.ranks, s.equal_size, 0)  # warm-up
                times = []
                for r in range(s.repeats):
                    t, kept, part = _one_pass(cfg, rewards, gids, lengths, s.group_size, s.ranks, s.equal_size, r + 1)
                    times.append(t)
                med = {ph: median(t[i] for t in times) for i, ph in enumerate(PHASES)}
                total = median(sum(t) for t in times)
                row = {
                    "completions": n,
                    "threads": nthreads,
                    "kept": kept,
                    **{f"{ph}_ms": 1e3 * med[ph] for ph in PHASES},
                    "total_ms": 1e3 * total,
                    "us_per_completion": 1e6 * total / n,
                    "share_of_step": (total / s.step_seconds) if s.step_seconds else None,
                    "balance_method": part.method,
                    "balance_imbalance": part.imbalance,
                }
                rows.append(row)
                log(
                    f"overhead: N={n:>9,} threads={nthreads}: total {row['total_ms']:.1f} ms "
                    f"(adv {row['advantage_ms']:.1f}, sel {row['selection_ms']:.1f}, alloc "
                    f"{row['allocation_ms']:.2f}, bal {row['balancing_ms']:.1f})"
                )
        finally:
            torch.set_num_threads(default_threads)

    notes = [
        f"G={s.group_size}, P={s.pruning_rate}, scope={s.scope}, survivors balanced onto {s.ranks} ranks "
        f"(equal_size={s.equal_size}); median of {s.repeats} repeats after one warm-up.",
        "Rewards: Bernoulli with a uniform per-prompt success rate; lengths lognormal(6, 1) clipped to [8, 16384].",
    ]
    if s.step_seconds:
        notes.append(f"share_of_step = total / {s.step_seconds:g} s (the measured step given with --step-seconds).")
    else:
        notes.append(
            "share_of_step needs a measured step of the default recipe: rerun with --step-seconds SECONDS "
            "or --step-seconds RUN.json (a file with a top-level step_seconds)."
        )

    def plot(fig):
        ax = fig.add_subplot(1, 1, 1)
        for threads in sorted({r["threads"] for r in rows}):
            sub = [r for r in rows if r["threads"] == threads]
            x = [r["completions"] for r in sub]
            ax.plot(x, [r["total_ms"] for r in sub], marker="o", label=f"total, {threads} thread(s)")
            for ph, style in zip(PHASES, (":", "--", "-.", (0, (1, 3))), strict=True):
                ax.plot(x, [max(r[f"{ph}_ms"], 1e-3) for r in sub], linestyle=style, alpha=0.6,
                        label=f"{ph}, {threads}t")
        if s.step_seconds:
            ax.axhline(10 * s.step_seconds, color="red", linewidth=0.8, label="1% of a step")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("completions per step")
        ax.set_ylabel("milliseconds (median)")
        ax.set_title("CPPO decision overhead per step")
        ax.legend(fontsize=7, ncol=2)

    return Report(
        name="overhead",
        title="Overhead of advantages + selection + allocation + balancing",
        params=asdict(s),
        columns=["completions", "threads", "kept", "advantage_ms", "selection_ms", "allocation_ms",
                 "balancing_ms", "total_ms", "us_per_completion", "share_of_step"],
        rows=rows,
        notes=notes,
        plot=plot,
        formats={**{f"{ph}_ms": ".2f" for ph in PHASES}, "total_ms": ".2f", "us_per_completion": ".2f",
                 "share_of_step": ".3%"},
    )


# ----------------------------------------------------------------------------- command line
def _ints(text: str) -> list[int]:
    try:
        return [int(float(x)) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def configure(parser) -> None:
    parser.add_argument("--sizes", type=_ints, default=[1_000, 10_000, 100_000, 1_000_000],
                        help="completions per step, comma-separated (default 1000,10000,100000,1000000)")
    parser.add_argument("--group-size", type=int, default=16, help="G (default 16)")
    parser.add_argument("--pruning-rate", type=float, default=0.875, help="P (default 0.875)")
    parser.add_argument("--scope", default="group", choices=["group", "batch"])
    parser.add_argument("--ranks", type=int, default=8, help="DP ranks the survivors are balanced onto (default 8)")
    parser.add_argument("--equal-size", action="store_true", help="equal-size parts when balancing")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per size; the median is reported")
    parser.add_argument("--threads", type=_ints, default=[1, 0],
                        help="torch thread counts to run with, 0 = default (default 1,0)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step-seconds", default=None,
                        help="a measured step time of the default recipe (seconds, or a JSON file with a "
                             "top-level step_seconds, e.g. OUT_DIR/summary.json of `cppo-megatron train`) to "
                             "report the overhead as a share of a step")


def run(args) -> Report:
    step = load_step_seconds(args.step_seconds) if args.step_seconds is not None else None
    return run_overhead(OverheadSettings(
        sizes=args.sizes, group_size=args.group_size, pruning_rate=args.pruning_rate, scope=args.scope,
        ranks=args.ranks, equal_size=args.equal_size, repeats=args.repeats, threads=args.threads,
        seed=args.seed, step_seconds=step,
    ))
