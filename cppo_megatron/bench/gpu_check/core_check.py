"""Check 2, ``core``: ``prune`` + allocation + balancing for 10^6 completions (10^5 with
``quick``) with device tensors in and out; the result must be identical to the same step
on CPU tensors."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import torch

from .common import sync_device

if TYPE_CHECKING:
    from .settings import GpuCheckSettings

__all__ = ["check_core"]


def _core_step(rewards, gids, lengths, cfg, group_size: int, ranks: int) -> dict:
    """One CPPO decision on whatever device the inputs are: full-group advantages and
    survivors (``prune``), the allocation plan and its accounting, survivors balanced
    onto ``ranks`` ranks."""
    from ...core import AllocationPlanner, balance_partitions, prune, sequence_workload

    n = int(rewards.numel())
    res = prune(rewards, gids, cfg, step=0)
    # capacity = this step's survivors: the planner must then plan exactly every group's prompt
    planner = AllocationPlanner.from_config(cfg, capacity=res.selection.num_kept, group_size=group_size)
    planned = planner.begin_step()
    planner.record_round(n // group_size, n)
    alloc = planner.end_step(res.selection)
    kept = res.selection.kept
    w = sequence_workload(lengths[kept.to(lengths.device)], linear=cfg.workload_linear,
                          quadratic=cfg.workload_quadratic)
    part = balance_partitions(w, ranks)
    return {"advantages": res.advantages, "kept": kept, "pruned": res.selection.pruned, "planned": planned,
            "alloc": alloc, "parts": [list(map(int, p)) for p in part.parts], "imbalance": part.imbalance}


def check_core(s: GpuCheckSettings, ctx: dict) -> tuple[dict, list[str]]:
    from ...config import CPPOConfig
    from ..overhead import synthetic_step

    n = 10**5 if s.quick else 10**6
    G, P, ranks = 16, 0.875, 8
    cfg = CPPOConfig(pruning_rate=P, seed=s.seed)
    rewards, gids, lengths = synthetic_step(n, G, s.seed)
    dev = torch.device(s.device)
    _core_step(rewards[: 64 * G], gids[: 64 * G], lengths[: 64 * G], cfg, G, ranks)  # warm-up (imports)

    t0 = time.perf_counter()
    ref = _core_step(rewards, gids, lengths, cfg, G, ranks)
    t_cpu = time.perf_counter() - t0
    r_d, g_d, l_d = rewards.to(dev), gids.to(dev), lengths.to(dev)
    sync_device(s.device)
    t0 = time.perf_counter()
    got = _core_step(r_d, g_d, l_d, cfg, G, ranks)
    sync_device(s.device)
    t_dev = time.perf_counter() - t0

    adv_dev = got["advantages"]
    checks = {
        "advantages_identical": bool(torch.equal(adv_dev.cpu(), ref["advantages"])),
        "advantages_on_device": adv_dev.device.type == dev.type,
        "kept_identical": bool(torch.equal(got["kept"].cpu(), ref["kept"])),
        "pruned_identical": bool(torch.equal(got["pruned"].cpu(), ref["pruned"])),
        "allocation_identical": got["planned"] == ref["planned"] and got["alloc"] == ref["alloc"],
        "balance_identical": got["parts"] == ref["parts"],
    }
    kept = int(ref["kept"].numel())
    expect_kept = (n // G) * max(1, math.floor(G * (1 - P) + 1e-9))
    nums = {
        "completions": n, "group_size": G, "pruning_rate": P, "ranks": ranks, "kept": kept,
        "prompts_planned": got["planned"], "balance_imbalance": ref["imbalance"],
        "cpu_seconds": t_cpu, "device_seconds": t_dev, "device": s.device,
        "advantages_max_abs_diff": float((adv_dev.cpu().double() - ref["advantages"].double()).abs().max()),
        **checks,
    }
    failures = [f"{k} is False (device result differs from the CPU result)" for k, v in checks.items() if not v]
    if kept != expect_kept:
        failures.append(f"kept {kept} completions, expected {expect_kept} (= {n // G} groups x k)")
    if got["planned"] != n // G:
        failures.append(f"allocation planned {got['planned']} prompts, expected {n // G} (capacity / (G (1-P)))")
    if sorted(i for p in got["parts"] for i in p) != list(range(kept)):
        failures.append("balancing lost or duplicated survivors")
    return nums, failures
