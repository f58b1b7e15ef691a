"""Predict GRPO / CPPO step times on a GPU cluster with a documented cost model.

Per pruning rate: seconds per phase (rollout, reward, sync, overhead, old-policy and
reference log-probs, update), time per prompt, speedup vs GRPO split into the batching gain
(a GRPO generating as many completions per call) x the pruning gain, the bound S_max from
the GRPO phase split, and the straggler cost of DP imbalance with and without
rebalancing. The model is described in docs/benchmarks.md, its defaults with their sources and the paper check in
docs/records/benchmarks_tools.md.

examples:
  cppo-megatron simulate --model 7B --gpu A100-80GB --dp 8
  cppo-megatron simulate --model 32B --gpu H100-SXM --tp 4 --pp 2 --dp 4 --rollout-tp 4 --capacity 1024
  cppo-megatron simulate --check-paper          (against the paper's published speedups)
  cppo-megatron simulate --check-paper --seq-overhead-s 0   (the check without host overhead per sequence)

With --check-paper the two published setups are fixed; only --gpu, --samples and the
efficiency options (MFUs, bandwidth efficiency, overheads, throughputs) apply.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import fields

from ..bench.simulate import GPUS, MODELS, ClusterSim


def _rates(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated rates, got {text!r}") from None


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


_HELP = {
    "model": f"Qwen2.5 size: {', '.join(MODELS)}",
    "gpu": f"GPU type: {', '.join(GPUS)}",
    "tp": "tensor parallel size of training", "pp": "pipeline parallel size of training",
    "dp": "data parallel size of training",
    "rollout_gpus": "GPUs that only generate (0 = colocated: rollout on the training GPUs)",
    "rollout_tp": "tensor parallel size of one rollout engine",
    "group_size": "G, completions per prompt",
    "capacity": "completions the update takes per step (GRPO batch B*G)",
    "prompt_len": "prompt tokens", "response_mean": "mean response tokens",
    "response_sigma": "sigma of log response length (lognormal; 0 = fixed)",
    "max_response": "response length cap", "mu": "policy iterations per step",
    "old_pass": "compute old-policy log-probs (veRL always; TRL only with mu > 1)",
    "ref_pass": "reference pass (KL, beta > 0)", "allocation": "CPPO draws more prompts to fill the capacity",
    "rebalance": "balance survivors across DP ranks", "equal_size": "equal-size DP parts when balancing",
    "train_mfu": "training model FLOPs utilisation", "gen_mfu": "rollout FLOPs utilisation when compute-bound",
    "bw_eff": "fraction of HBM bandwidth reached in decoding",
    "iter_overhead_s": "host seconds per decode iteration",
    "seq_overhead_s": "host seconds per active sequence per decode iteration",
    "max_num_seqs": "concurrent sequences per rollout engine",
    "reward_s_per_completion": "reward seconds per completion",
    "sync_gb_per_s": "weight sync bandwidth to the rollout engines, GB/s",
    "step_overhead_s": "fixed seconds per step", "samples": "sampled steps averaged per rate",
    "seed": "random seed", "train_tokens_per_gpu": "override: training tokens/s per GPU (fwd+bwd)",
    "gen_tokens_per_gpu": "override: saturated decode tokens/s per GPU",
}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rates", type=_rates, default=[0.5, 0.75, 0.875, 0.9375],
                        help="pruning rates (P=0 is always included as the baseline)")
    parser.add_argument("--check-paper", action="store_true",
                        help="predict the paper's two setups and compare with its published speedups")
    parser.add_argument("--out", default="runs/simulate", help="output directory (default runs/simulate)")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
    defaults = ClusterSim()
    for f in fields(ClusterSim):
        value = getattr(defaults, f.name)
        kind: Callable[[str], object] = _bool if isinstance(value, bool) else (int if isinstance(value, int) else float)
        if f.name in ("model", "gpu"):
            kind = str
        parser.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, type=kind, default=value,
                            help=f"{_HELP.get(f.name, f.name)} (default {value})")


def run(args: argparse.Namespace) -> int:
    from ..bench.report import publish
    from ..bench.simulate import run_paper_check, run_simulate

    try:
        if args.check_paper:
            from ..bench.simulate import EFFICIENCY_FIELDS

            overrides = {name: getattr(args, name) for name in EFFICIENCY_FIELDS}
            report = run_paper_check(args.rates, gpu=args.gpu, samples=args.samples, overrides=overrides)
        else:
            cfg = ClusterSim(**{f.name: getattr(args, f.name) for f in fields(ClusterSim)}).validate()
            report = run_simulate(cfg, args.rates)
    except ValueError as exc:
        print(f"cppo-megatron simulate: {exc}", file=sys.stderr)
        return 2
    publish(report, args.out, plot=not args.no_plot)
    return 0
