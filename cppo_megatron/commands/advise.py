"""What CPPO would do for a run you already have, from its own metrics.

Give the log of a GRPO run — veRL (its console output, the `file` logger's JSON lines, or
TensorBoard events), OpenRLHF (its console output or TensorBoard events), or this package's
metrics.jsonl (embedded trainer, the OpenRLHF hook) — or the directory holding it. advise takes
the median phase split over the steps after the warm-up (the first step, and further slow
leading ones; --skip N to choose), and prints per pruning rate P:

  S_max(P)          the most pruning can give: T_step / (T_fixed + (1 - P) T_rest), with T_rest the
                    passes pruning shrinks (old-policy, reference, critic, update) and T_fixed the rest
  step no-alloc     the step time to expect with the same prompts per step
  step alloc        with allocation (B/(1-P) prompts, the same completions trained)
  allocation        advised or not: whether the rollout engine holds the larger batch (--recipe)
  the change        the one-line recipe change for the run's host

and flags a run whose generation is 80% or more of a step (CPPO alone will not pay there).

examples:
  cppo-megatron advise runs/verl_tiny/tiny_cpu_grpo/metrics.jsonl
  cppo-megatron advise train.log --recipe recipes/verl/tiny_cpu_grpo.yaml
  cppo-megatron advise tensorboard_log/my_project/my_run --rates 0.5,0.875 --json advice.json

Exit status 0, or 2 with one line for what you can fix (no timing keys in the log, a missing
file, a directory holding several runs, a bad option).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("log", metavar="LOG_OR_DIR",
                        help="a run's console log, metrics JSONL, TensorBoard event file, or a directory holding "
                             "one run's")
    parser.add_argument("--rates", default="0.5,0.75,0.875,0.9375",
                        help="pruning rates P (default 0.5,0.75,0.875,0.9375)")
    parser.add_argument("--skip", type=int, default=None,
                        help="leading steps to leave out of the medians (default: the first, and later slow ones)")
    parser.add_argument("--recipe", default=None,
                        help="the run's recipe (veRL, OpenRLHF or embedded trainer): its batch, and whether its "
                             "rollout holds allocation's larger batch")
    parser.add_argument("--override", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a recipe override (veRL / embedded trainer), repeatable")
    parser.add_argument("--device-gb", type=float, default=80.0,
                        help="GPU memory of one rollout replica's devices, GB, for veRL/OpenRLHF recipes (default 80)")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write everything as JSON")


def _rates(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise ValueError(f"--rates must be comma-separated numbers in (0, 1), got {text!r}") from exc


def run(args: argparse.Namespace) -> int:
    from ..advise import advice_json, advise_rates, format_advice, phase_split, read_recipe, read_run

    rates = _rates(args.rates)
    if args.skip is not None and args.skip < 0:
        raise ValueError(f"--skip must be >= 0, got {args.skip}")
    split = phase_split(read_run(args.log), skip=args.skip)
    facts = read_recipe(args.recipe, args.overrides, args.device_gb) if args.recipe else None
    rows = advise_rates(split, rates, facts)
    print(format_advice(split, rows, facts))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(advice_json(split, rows, facts), indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0
