"""Train a model with GRPO/CPPO on one machine from a recipe.

  cppo-megatron train recipes/tiny_cpu.yaml
  cppo-megatron train recipes/tiny_cpu.yaml cppo.pruning_rate=0.5 train.steps=50 out_dir=runs/p05
  cppo-megatron train recipes/tiny_cpu.yaml --resume        (continue the run in out_dir)

Overrides are omegaconf dotlist `key=value` pairs; an unknown key is an error. Every key
is documented in docs/trainer.md. Ctrl-C / SIGTERM finishes the running step, saves a
checkpoint and exits with status 130; --resume continues with the same data order and
accounting. backend=megatron recipes run under torchrun (--nproc N). Outputs in out_dir: metrics.jsonl,
tensorboard/, checkpoints/, report.md, report.png.
"""

from __future__ import annotations

import argparse
import json
import sys


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipe YAML (see recipes/)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. cppo.pruning_rate=0.5")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in out_dir")
    parser.add_argument("--nproc", type=int, default=1,
                        help="processes (torchrun) for backend=megatron; 1 for the single-process backend")
    parser.add_argument("--print-recipe", action="store_true", help="print the merged recipe and exit")


def run(args: argparse.Namespace) -> int:
    from ..trainer.config import load_recipe, recipe_to_dict

    try:
        recipe = load_recipe(args.recipe, args.overrides)
    except (ValueError, FileNotFoundError) as exc:
        print(f"cppo-megatron train: {exc}", file=sys.stderr)
        return 2
    if args.print_recipe:
        print(json.dumps(recipe_to_dict(recipe), indent=2))
        return 0
    if recipe.backend == "megatron" or args.nproc > 1:
        from ..trainer.launch import launch

        return launch(args)  # torchrun; every rank runs the same Trainer

    from ..trainer import Trainer

    try:
        trainer = Trainer(recipe, resume=args.resume)
    except FileNotFoundError as exc:  # --resume without a (readable) checkpoint
        print(f"cppo-megatron train: {exc}", file=sys.stderr)
        return 2
    summary = trainer.run()
    if summary.get("interrupted"):
        return 130
    print(
        f"done: accuracy {summary['accuracy_before']:.3f} -> {summary['accuracy_after']:.3f}, "
        f"{summary['steps']} RL steps in {summary['rl_wall_s']:.0f} s; report: {recipe.out_dir}/report.md"
    )
    return 0
