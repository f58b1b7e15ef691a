"""Check 4, ``trainer``: the embedded trainer on the device: GRPO vs CPPO P = 0.875 with and
without allocation, and GRPO at the prompts allocation draws (the same generation batch), side
by side in one process (``bench speedup``'s ``measure``): time per prompt, speedup, the bound
from the GRPO phase split, the fraction of it; allocation's speedup against the same-batch GRPO
with that run's own bound (pruning alone), and the batching gain (same-batch GRPO against GRPO)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .common import finite

if TYPE_CHECKING:
    from .settings import GpuCheckSettings

__all__ = ["check_trainer", "count_params", "trainer_overrides"]


def trainer_overrides(device: str, quick: bool, seed: int) -> list[str]:
    """Recipe overrides of the trainer check (on top of the recipe defaults: arithmetic
    task, its 16-symbol character vocabulary, HF rollout)."""
    common = [f"seed={seed}", f"device={device}", "task.train_size=4000", "task.test_size=50",
              "eval.every=0", "eval.num_problems=20", "log.progress=false", "log.tensorboard=false",
              "log.plots=false", "log.checkpoint_every=0", "warmup.eval_every=1000", "warmup.eval_problems=10",
              "warmup.target_accuracy=1.0", "rollout.max_new_tokens=6", "model.max_position=32"]
    if quick:
        return common + ["threads=0", "model.hidden_size=32", "model.num_layers=2", "model.num_heads=2",
                         "model.num_kv_heads=2", "model.intermediate_size=64", "rollout.group_size=8",
                         "train.capacity=32", "warmup.max_steps=3", "warmup.batch_size=16"]
    # ~200M parameters: 12 layers of hidden 1024, MLP 4096 (the GPU is busy, the vocabulary small)
    dtype = "bfloat16" if device == "cuda" else "float32"
    return common + [f"model.dtype={dtype}", "model.hidden_size=1024", "model.num_layers=12", "model.num_heads=16",
                     "model.num_kv_heads=16", "model.intermediate_size=4096", "rollout.group_size=16",
                     "train.capacity=512", "train.lr=1e-5",
                     "warmup.max_steps=30", "warmup.batch_size=64", "warmup.lr=3e-4"]


def check_trainer(s: GpuCheckSettings, ctx: dict) -> tuple[dict, list[str]]:
    import shutil

    from ..._optional import require
    from ...trainer.config import load_recipe
    from ..speedup import analyse, measure, same_batch_splits, warm_start

    require("transformers", "the trainer check")
    P = 0.875
    steps, repeats, warm_steps = (1, 2, 1) if s.quick else (3, 2, 1)
    out = Path(s.out) / "trainer"
    recipe = load_recipe(None, [*trainer_overrides(s.device, s.quick, s.seed), f"out_dir={out}"])
    shutil.rmtree(out / "warmup", ignore_errors=True)  # never start from a stale run's weights
    t0 = time.perf_counter()
    warm = warm_start(recipe, out, None)
    t_warm = time.perf_counter() - t0
    rates, allocations = [0.0, P], [True, False]
    params = count_params(warm)
    try:
        records = measure(recipe, rates, allocations, steps, repeats, warm, out, progress=False,
                          warmup_steps=warm_steps, same_batch=True)
    finally:
        shutil.rmtree(warm.parent, ignore_errors=True)  # the start weights (up to ~0.4 GB) are not a result
    rows, split = analyse(records, rates, allocations)
    by = {r["run"]: r for r in rows}
    grpo, alloc, noalloc = by["GRPO"], by[f"CPPO P={P:g} alloc"], by[f"CPPO P={P:g} no-alloc"]
    same = by[f"GRPO at P={P:g}'s batch"]
    same_split = same_batch_splits(records)[P]
    m = recipe.model
    keep = ["run", "P", "allocation", "prompts/step", "trained/step", "ms/prompt", "speedup", "bound", "of bound",
            "speedup same batch", "bound same batch", "of bound same batch", "ms/prompt rollout", "ms/prompt update",
            "steps measured"]
    nums = {
        "model": {"hidden": m.hidden_size, "layers": m.num_layers, "heads": m.num_heads, "mlp": m.intermediate_size,
                  "dtype": m.dtype, "params": params},
        "group_size": recipe.rollout.group_size, "capacity": recipe.train.capacity,
        "steps_per_run_per_round": steps, "rounds": repeats, "unmeasured_warmup_steps_per_run": warm_steps,
        "warmup_seconds": t_warm,
        "rows": [{k: r[k] for k in keep} for r in rows],
        "t_gen_ms_per_prompt": 1e3 * split["t_gen_per_prompt_s"],
        "t_rest_ms_per_prompt": 1e3 * split["t_rest_per_prompt_s"],
        "speedup_alloc": alloc["speedup"], "speedup_noalloc": noalloc["speedup"], "bound": alloc["bound"],
        "of_bound_alloc": alloc["of bound"], "of_bound_noalloc": noalloc["of bound"],
        # against GRPO at allocation's batch: pruning alone, with that run's own bound; its own speedup is batching
        "batching_gain": same["speedup"], "speedup_alloc_same_batch": alloc["speedup same batch"],
        "bound_same_batch": alloc["bound same batch"], "of_bound_alloc_same_batch": alloc["of bound same batch"],
        "t_gen_ms_per_prompt_same_batch": 1e3 * same_split["t_gen_per_prompt_s"],
        "t_rest_ms_per_prompt_same_batch": 1e3 * same_split["t_rest_per_prompt_s"],
        "rollout_ms_per_prompt": {"grpo": grpo["ms/prompt rollout"], "cppo_alloc": alloc["ms/prompt rollout"],
                                  "cppo_noalloc": noalloc["ms/prompt rollout"],
                                  "grpo_same_batch": same["ms/prompt rollout"]},
        # < 1: the larger allocation batch makes generation cheaper per prompt (the paper's super-bound effect)
        "rollout_per_prompt_alloc_over_grpo": alloc["ms/prompt rollout"] / grpo["ms/prompt rollout"],
    }
    failures = _same_batch_failures(P, grpo, alloc, same, same_split)
    for r in rows:
        for k in ("ms/prompt", "speedup", "bound", "of bound", "ms/prompt rollout"):
            if r is same and k in ("bound", "of bound"):
                continue  # a baseline: no pruning bound
            if not (finite(r[k]) and r[k] > 0):
                failures.append(f"P={r['P']} allocation={r['allocation']}: {k} = {r[k]} is not a positive number")
        if r["steps measured"] != steps * repeats:
            failures.append(f"P={r['P']} allocation={r['allocation']}: {r['steps measured']} steps measured, "
                            f"expected {steps * repeats}")
    want_prompts = grpo["prompts/step"] / (1 - P)
    if alloc["prompts/step"] != want_prompts:
        failures.append(f"allocation drew {alloc['prompts/step']} prompts per step, expected {want_prompts:g} "
                        f"(GRPO's {grpo['prompts/step']:g} / (1 - P))")
    if noalloc["prompts/step"] != grpo["prompts/step"] or noalloc["trained/step"] != grpo["trained/step"] * (1 - P):
        failures.append(f"without allocation: {noalloc['prompts/step']} prompts and {noalloc['trained/step']} trained "
                        f"per step, expected {grpo['prompts/step']:g} and {grpo['trained/step'] * (1 - P):g}")
    if alloc["trained/step"] != grpo["trained/step"]:
        failures.append(f"with allocation {alloc['trained/step']} completions trained per step, expected GRPO's "
                        f"{grpo['trained/step']:g} (the capacity)")
    if finite(alloc["bound"]) and abs(alloc["bound"] - _bound(P, split)) > 1e-9 * alloc["bound"]:
        failures.append("the reported bound does not follow from the GRPO phase split")
    return nums, failures


def _same_batch_failures(P: float, grpo: dict, alloc: dict, same: dict, split: dict) -> list[str]:
    """The same-batch GRPO draws allocation's prompts and trains all of their completions, and the
    allocation row's figures against it follow from its split."""
    out = []
    if same["prompts/step"] != alloc["prompts/step"] or same["trained/step"] != same["prompts/step"] * (
            grpo["trained/step"] / grpo["prompts/step"]):
        out.append(f"GRPO at allocation's batch: {same['prompts/step']} prompts and {same['trained/step']} trained per "
                   f"step, expected allocation's {alloc['prompts/step']:g} prompts and all their completions")
    for k in ("speedup same batch", "bound same batch", "of bound same batch"):
        if not (finite(alloc[k]) and alloc[k] > 0):
            out.append(f"allocation against the same-batch GRPO: {k} = {alloc[k]} is not a positive number")
    if finite(alloc["bound same batch"]) and abs(alloc["bound same batch"] - _bound(P, split)) > 1e-9 * alloc[
            "bound same batch"]:
        out.append("the same-batch bound does not follow from that GRPO run's phase split")
    return out


def _bound(P: float, split: dict) -> float:
    from ..bound import speedup_bound

    return speedup_bound(P, split["t_gen_per_prompt_s"], split["t_rest_per_prompt_s"])


def count_params(path: Path) -> int:
    """Parameters in a saved state dict (tied tensors counted once), read memory-mapped."""
    state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    seen, total = set(), 0
    for t in state.values():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key not in seen:
            seen.add(key)
            total += t.numel()
    return total
