"""Benchmarks: each writes NAME.json, NAME.md and NAME.png into --out.

  cppo-megatron bench speedup recipes/tiny_cpu.yaml [--rates 0,0.5,0.75,0.875,0.9375] [--allocation both]
  cppo-megatron bench verl recipes/verl/tiny_cpu_grpo.yaml [--rate 0.875] [--allocation both] [--steps 6]
  cppo-megatron bench openrlhf recipes/openrlhf/tiny_cpu_cppo.yaml [--rate 0.875] [--allocation both] [--steps 6]
  cppo-megatron bench overhead [--sizes 1000,10000,100000,1000000] [--step-seconds S|RUN.json]
  cppo-megatron bench balance  [--ranks 2,8,64,256] [--items-per-rank 16]
  cppo-megatron bench gradient recipes/tiny_cpu.yaml [--points 0,20,60] [--batches 4] [--early-stop]
  cppo-megatron bench predictor recipes/worked_cpu.yaml [--steps 6]
  cppo-megatron bench BENCHMARK --help
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module with configure(parser) and run(args) -> Report, one-line help).
BENCHMARKS: dict[str, tuple[str, str]] = {
    "speedup": ("cppo_megatron.bench.speedup",
                "GRPO vs CPPO at several rates, interleaved: speedup vs the bound S_max"),
    "verl": ("cppo_megatron.bench.verl",
             "veRL GRPO vs veRL + CPPO (CPU mode), speedup per prompt vs the bound, from veRL's timing_s/*"),
    "openrlhf": ("cppo_megatron.bench.openrlhf",
                 "OpenRLHF GRPO vs OpenRLHF + CPPO (CPU mode), speedup per prompt vs the bound, from its timing/*"),
    "rollout": ("cppo_megatron.bench.rollout",
                "tokens/s of the HF and vLLM rollout engines (tiny model, SmolLM2-135M)"),
    "overhead": ("cppo_megatron.bench.overhead", "time of advantages + selection + allocation + balancing per step"),
    "balance": ("cppo_megatron.bench.balancing",
                "our balancer vs veRL's get_seqlen_balanced_partitions vs contiguous split"),
    "gradient": ("cppo_megatron.bench.gradient",
                 "cosine / norm error of each kept set's policy gradient vs the full-batch gradient"),
    "predictor": ("cppo_megatron.bench.predictor",
                  "early stopping's predictor per feature set (log-probs, entropies, hidden state): held-out AUC"),
}


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK")
    for name, (module, help_) in BENCHMARKS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        importlib.import_module(module).configure(p)
        p.add_argument("--out", default="runs/bench", help="output directory (default runs/bench)")
        p.add_argument("--no-plot", action="store_true", help="skip the PNG (no matplotlib needed)")


def run(args: argparse.Namespace) -> int:
    if not getattr(args, "benchmark", None):
        print(f"cppo-megatron bench: choose a benchmark: {', '.join(BENCHMARKS)} (bench BENCHMARK --help)",
              file=sys.stderr)
        return 2
    from ..bench.report import publish

    module = importlib.import_module(BENCHMARKS[args.benchmark][0])
    report = module.run(args)  # a ValueError names the bad option: the CLI prints it on one line, exit 2
    publish(report, args.out, plot=not args.no_plot)
    return 0
