"""The CPPO core on synthetic rewards, step by step, then at cluster scale.

1. B prompts x G completions with per-prompt difficulty: Bernoulli correctness rewards.
2. Full-group advantages; which completions survive pruning (a few groups printed).
3. Allocation: prompts per step so the survivors fill the update capacity, over steps.
4. Balancing: survivors with long-tailed lengths onto DP ranks vs contiguous chunks.
5. Scale: selection + allocation + balancing for --scale completions (default 1,000,000
   in 100,000 groups) into 256 ranks, on one CPU thread.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from ..config import CPPOConfig
from ..core import (
    AllocationPlanner,
    balance_partitions,
    group_advantages,
    naive_partition,
    select_completions,
    sequence_workload,
)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", type=int, default=8, help="prompts in the example batch (default 8)")
    parser.add_argument("--group-size", type=int, default=16, help="G, completions per prompt (default 16)")
    parser.add_argument("--pruning-rate", type=float, default=0.875, help="P in [0, 1) (default 0.875)")
    parser.add_argument("--metric", default="smallest", choices=["smallest", "largest", "random"])
    parser.add_argument("--scope", default="group", choices=["group", "batch"])
    parser.add_argument("--ranks", type=int, default=8, help="data-parallel ranks to balance onto")
    parser.add_argument("--steps", type=int, default=6, help="allocation steps to simulate")
    parser.add_argument("--scale", type=int, default=1_000_000, help="completions in the timing run (0 skips)")
    parser.add_argument("--scale-group-size", type=int, default=10, help="G in the timing run")
    parser.add_argument("--scale-ranks", type=int, default=256, help="ranks in the timing run")
    parser.add_argument("--seed", type=int, default=0)


def _synthetic_batch(prompts: int, group_size: int, gen: torch.Generator):
    difficulty = torch.rand(prompts, generator=gen)  # P(correct) per prompt
    correct = torch.rand(prompts, group_size, generator=gen) < difficulty[:, None]
    rewards = correct.float().flatten()
    lengths = torch.exp(torch.randn(prompts * group_size, generator=gen) * 0.8 + 5.5).round().clamp(8, 4096)
    return rewards, torch.arange(prompts).repeat_interleave(group_size), lengths


def run(args: argparse.Namespace) -> int:
    cfg = CPPOConfig(pruning_rate=args.pruning_rate, metric=args.metric, scope=args.scope, seed=args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    G = args.group_size
    print(f"== {cfg.describe()}")

    # 1-2: one batch
    rewards, gids, lengths = _synthetic_batch(args.prompts, G, gen)
    adv, stats = group_advantages(rewards, gids, adv_norm=cfg.adv_norm, eps=cfg.eps)
    sel = select_completions(adv, gids, cfg)
    kept = sel.kept_mask()
    print(f"\n-- one batch: {args.prompts} prompts x G={G}; k = {cfg.keep_for_group(G)} kept per prompt")
    for p in range(min(args.prompts, 4)):
        idx = (gids == p).nonzero().squeeze(1)
        cells = " ".join(
            f"{'[' if kept[i] else ' '}{adv[i]:+.2f}{']' if kept[i] else ' '}" for i in idx[: min(G, 8)]
        )
        more = " ..." if G > 8 else ""
        print(f"prompt {p}: mean {stats.mean[p]:.2f} std {stats.std[p]:.2f} | {cells}{more}")
    print("   ([x] = kept; advantages use the FULL group's mean/std, never the survivors')")
    for key, value in sel.metrics().items():
        print(f"   {key:<28} {value:.4g}")

    # 3: allocation
    capacity = args.prompts * G
    planner = AllocationPlanner.from_config(cfg, capacity=capacity, group_size=G)
    print(
        f"\n-- allocation: capacity {capacity} completions/step, {float(planner.prompts_per_step):.3g} "
        f"prompts/step (x{float(planner.prompts_per_step) * G / capacity:.3g}) so survivors fill it"
    )
    for step in range(args.steps):
        n = planner.begin_step()
        r, g, _ = _synthetic_batch(n, G, gen)
        planner.record_round(n, n * G)
        a, _ = group_advantages(r, g)
        s = select_completions(a, g, cfg, step=step + 1)
        m = planner.end_step(s)
        print(
            f"step {step}: drew {n:>4} prompts, generated {n * G:>5}, trained {s.num_kept:>4} "
            f"(fill {m['alloc/capacity_fill']:.2f}), groups fully pruned {int((s.kept_per_group == 0).sum())}"
        )
    t = planner.totals
    print(
        f"   totals: {t.prompts_drawn} prompts drawn = {t.prompts_trained} trained + "
        f"{t.prompts_fully_pruned} fully pruned + {t.prompts_dropped} dropped"
    )

    # 4: balancing
    w = sequence_workload(lengths[sel.kept], linear=cfg.workload_linear, quadratic=cfg.workload_quadratic)
    ranks = min(args.ranks, max(1, sel.num_kept))
    bal = balance_partitions(w, ranks, equal_size=cfg.equal_size)
    naive = naive_partition(w, ranks)
    print(
        f"\n-- balancing {sel.num_kept} survivors (lognormal lengths) onto {ranks} ranks: "
        f"max/mean workload {bal.imbalance:.3f} (lower bound gap {bal.gap_to_bound:.2%}) vs "
        f"{naive.imbalance:.3f} for contiguous chunks"
    )

    # 5: scale
    if args.scale > 0:
        _scale(args, cfg)
    return 0


def _scale(args: argparse.Namespace, cfg: CPPOConfig) -> None:
    n, G, k = args.scale, args.scale_group_size, args.scale_ranks
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(args.seed)
        rewards = (torch.rand(n, generator=gen) < 0.3).float()
        gids = torch.arange(n) // G
        lengths = torch.from_numpy(np.random.default_rng(args.seed).lognormal(6.0, 1.0, n).round().clip(8, 16384))
        t0 = time.perf_counter()
        adv, stats = group_advantages(rewards, gids)
        t1 = time.perf_counter()
        sel = select_completions(adv, gids, cfg, stats=stats)
        t2 = time.perf_counter()
        planner = AllocationPlanner.from_config(cfg, capacity=sel.num_kept, group_size=G)
        planner.begin_step()
        planner.record_round(n // G, n)
        planner.end_step(sel)
        t3 = time.perf_counter()
        part = balance_partitions(sequence_workload(lengths[sel.kept]), k, equal_size=cfg.equal_size)
        t4 = time.perf_counter()
    finally:
        torch.set_num_threads(threads)
    print(f"\n-- scale, one CPU thread: {n:,} completions in {n // G:,} groups -> {k} ranks")
    print(f"   advantages      {1e3 * (t1 - t0):8.1f} ms")
    print(f"   selection       {1e3 * (t2 - t1):8.1f} ms  ({sel.num_kept:,} kept)")
    print(f"   allocation      {1e3 * (t3 - t2):8.1f} ms")
    print(f"   balancing       {1e3 * (t4 - t3):8.1f} ms  (max/mean {part.imbalance:.6f}, {part.method})")
    print(f"   selection + allocation + balancing: {t4 - t1:.3f} s")
