"""gpu-check: prove the GPU path in minutes — environment, core, megatron-core, trainer.

Four checks run one after another, each with a time budget; a check that raises, misses
a tolerance or overruns its budget fails, and the next one still runs:

1. ``environment``: GPU name and memory, torch / CUDA / NCCL versions, bf16 support, and
   what every optional backend imports (``cppo-megatron doctor`` in a subprocess, so
   importing veRL or vLLM cannot change this process).
2. ``core``: ``prune`` + allocation + balancing for 10^6 completions (10^5 with
   ``quick``) with device tensors in and out; the result must be identical to the same
   step on CPU tensors.
3. ``megatron``: megatron-core on the device (NCCL on CUDA, gloo on CPU; world size 1 in
   this process, TP 2 and PP 2 through torchrun when ``parallel`` >= 2): per-token
   log-probs of a random-init Qwen2 against the HF model in float32 and bfloat16, one
   float32 update step, its loss and grad norm against a plain-torch HF reference.
4. ``trainer``: the embedded trainer on the device: GRPO vs CPPO P = 0.875 with and
   without allocation, side by side in one process (``bench speedup``'s ``measure``):
   time per prompt, speedup, the bound from the GRPO phase split, the fraction of it, and
   how the rollout time per prompt changes with allocation's larger batch; and GRPO at the
   prompts allocation draws, the same-generation-batch baseline.
5. ``study`` (``--study``, with ``environment``): GRPO, CPPO with and without allocation and
   the same-batch GRPO on the worked-arithmetic testbed for equal wall time each, a pretrained
   SmolLM2-135M when its GGUF travels along: phase split, time per prompt, speedups against both
   GRPO runs and their bounds, held-out accuracy at equal time (``study_check``).

Every check records the peak memory it used (CUDA: ``max_memory_allocated`` reset per
check; CPU: the process's peak RSS so far). ``run_gpu_check`` writes gpu_check.json and
gpu_check.md; docs/gpu.md explains every number and tolerance.

The package: ``settings`` (what to run, budgets, ``CheckResult``), one module per check
(``env_check``, ``core_check``, ``megatron_check``, ``trainer_check``), ``output`` (the two
files) and, here, the driver that runs the checks in order.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable

from .common import peak_memory
from .core_check import check_core
from .env_check import check_environment
from .megatron_check import TOLERANCES, check_megatron, judge_megatron, megatron_sizes
from .output import write_outputs
from .settings import ALL_CHECKS, CHECKS, STUDY_CHECKS, TITLES, CheckResult, GpuCheckSettings, budgets
from .study_check import check_study, study_overrides
from .trainer_check import check_trainer, trainer_overrides

__all__ = [
    "ALL_CHECKS",
    "CHECKS",
    "CHECK_FUNCS",
    "CheckResult",
    "GpuCheckSettings",
    "STUDY_CHECKS",
    "TITLES",
    "TOLERANCES",
    "budgets",
    "check_core",
    "check_environment",
    "check_megatron",
    "check_study",
    "check_trainer",
    "judge_megatron",
    "megatron_sizes",
    "run_gpu_check",
    "run_one",
    "study_overrides",
    "trainer_overrides",
    "write_outputs",
]


CHECK_FUNCS: dict[str, Callable[[GpuCheckSettings, dict], tuple[dict, list[str]]]] = {
    "environment": check_environment,
    "core": check_core,
    "megatron": check_megatron,
    "trainer": check_trainer,
    "study": check_study,
}


def run_one(name: str, fn, s: GpuCheckSettings, budget: float) -> CheckResult:
    """Run one check, catching everything: an exception or an overrun budget is a failure."""
    box: dict = {}
    t0 = time.perf_counter()
    ctx = {"budget": budget, "deadline": t0 + budget}
    nums: dict = {}
    failures: list[str] = []
    err = tb = None
    with peak_memory(s.device, box):
        try:
            nums, failures = fn(s, ctx)
        except Exception as exc:  # noqa: BLE001 - a failing check must not stop the others
            err = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"
            tb = traceback.format_exc()
    seconds = time.perf_counter() - t0
    failures = list(failures)
    if seconds > budget:
        failures.append(f"took {seconds:.0f} s, over its budget of {budget:.0f} s")
    return CheckResult(
        name=name, title=TITLES[name], passed=err is None and not failures, seconds=seconds, budget_s=budget,
        peak_memory_mib=box.get("peak_memory_mib"), memory_kind=box.get("memory_kind", ""), numbers=nums,
        failures=tuple(failures), error=err, traceback=tb,
    )


def run_gpu_check(s: GpuCheckSettings, *, log: Callable[[str], None] = print,
                  funcs: dict | None = None) -> tuple[list[CheckResult], float]:
    """Run the selected checks in order; return their results and the total seconds."""
    s.validate()
    funcs = funcs or CHECK_FUNCS
    b = budgets(s.quick, s.budget_scale, s.parallel)
    todo = [c for c in ALL_CHECKS if c in s.only]
    results = []
    t0 = time.perf_counter()
    for i, name in enumerate(todo, 1):
        log(f"gpu-check [{i}/{len(todo)}] {TITLES[name]} (budget {b[name]:.0f} s) ...")
        r = run_one(name, funcs[name], s, b[name])
        mem = f", peak {r.peak_memory_mib:.0f} MiB" if r.peak_memory_mib is not None else ""
        log(f"gpu-check [{i}/{len(todo)}] {name}: {'PASS' if r.passed else 'FAIL'} in {r.seconds:.1f} s{mem}"
            f"{'' if r.passed else ': ' + '; '.join(([r.error] if r.error else []) + list(r.failures))}")
        results.append(r)
    return results, time.perf_counter() - t0
