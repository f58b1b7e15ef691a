"""Train a model with GRPO/CPPO on one machine from a recipe.

  cppo-megatron train recipes/tiny_cpu.yaml
  cppo-megatron train recipes/tiny_cpu.yaml cppo.pruning_rate=0.5 train.steps=50 out_dir=runs/p05
  cppo-megatron train recipes/tiny_cpu.yaml --resume        (continue the run in out_dir)

Overrides are omegaconf dotlist `key=value` pairs; an unknown key is an error. Every key
is documented in docs/trainer.md (and listed by --help-recipe). Before any work starts the
recipe and what it points at (model directory, data files, data fitting the model) are
checked: a mistake ends in one line and exit status 2 (--debug shows the traceback).
Ctrl-C / SIGTERM finishes the running step, saves a checkpoint and exits with status 130;
--resume continues with the same data order and accounting. backend=megatron recipes run
under torchrun (--nproc N). --dry-run prints each rank's memory estimate and whether it fits;
a run that cannot fit is refused before it starts, with the numbers. Outputs in out_dir: metrics.jsonl,
tensorboard/, checkpoints/, report.md, report.png.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..recipes import arg_type as recipe_arg


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", type=recipe_arg("train"),
                        help="recipe YAML, or a shipped recipe's name (`cppo-megatron recipes`)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. cppo.pruning_rate=0.5")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in out_dir")
    parser.add_argument("--nproc", type=int, default=1,
                        help="processes (torchrun) for backend=megatron; 1 for the single-process backend")
    parser.add_argument("--print-recipe", action="store_true", help="print the merged recipe and exit")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the layout and each rank's memory estimate (weights, gradients, optimizer, "
                             "reference, activations, engine), say whether it fits, and exit (2 when it does not)")
    parser.add_argument("--model-config", metavar="CONFIG_JSON",
                        help="with --dry-run: size the model of this HF config.json instead of model.path's "
                             "(e.g. before downloading it; recipes/models/ has the Qwen2.5 ones)")
    parser.add_argument("--help-recipe", nargs="?", const="", metavar="SECTION", action=_HelpRecipe,
                        help="list every recipe key (or those under SECTION, e.g. cppo) with its default, "
                             "choices and meaning, and exit")


class _HelpRecipe(argparse.Action):
    """Prints the recipe reference and exits, like --help (no recipe file needed)."""

    def __call__(self, parser, namespace, values, option_string=None):
        from ..trainer.config import RecipeError, recipe_help

        try:
            print(recipe_help(values or ""))
        except RecipeError as exc:
            parser.exit(2, f"cppo-megatron train: {exc}\n")
        parser.exit(0)


def _dry_run(recipe, args) -> int:
    """The layout and the per-rank memory table; a run that cannot fit raises ``RecipeError`` after
    the table (the CLI: one line, exit status 2)."""
    from ..trainer.sizing import check_fit, estimate, format_report, machine_memory_gb, ram_warning

    limit, where = machine_memory_gb(recipe, args.nproc)
    report = estimate(recipe, args.nproc, model_config=args.model_config, device_gb=limit)
    print(format_report(report, limit, where))
    warning = ram_warning(report, recipe, args.nproc)
    if warning:
        print(f"warning: {warning}")
    check_fit(report, limit, where)
    return 0


def run(args: argparse.Namespace) -> int:
    """A recipe error (``RecipeError``, a ValueError) or a missing checkpoint reaches the CLI, which
    prints it on one line and exits 2 (the traceback with ``--debug``, anywhere on the line)."""
    from ..trainer.config import RecipeError, load_recipe, recipe_to_dict
    from ..trainer.preflight import check_inputs
    from ..trainer.sizing import size_run

    recipe = load_recipe(args.recipe, args.overrides)
    if args.print_recipe:
        print(json.dumps(recipe_to_dict(recipe), indent=2))
        return 0
    if args.nproc < 1:
        raise RecipeError(f"--nproc must be >= 1, got {args.nproc}")
    if args.model_config and not args.dry_run:
        raise RecipeError("--model-config sizes a model for --dry-run only; the run itself uses model.path")
    if args.dry_run:
        return _dry_run(recipe, args)
    # before the warm-up, and before torchrun starts N processes that would each fail
    inputs = check_inputs(recipe, resume=args.resume)
    _, _, notes = size_run(recipe, args.nproc)  # refuses a run that cannot fit, with the numbers
    for note in [*inputs.warnings, *notes]:
        print(f"cppo-megatron train: {note}", file=sys.stderr)
    return start(recipe, args, inputs)


def start(recipe, args: argparse.Namespace, inputs) -> int:
    """Everything after the checks: torchrun for ``backend: megatron`` or ``--nproc`` > 1, else the
    in-process Trainer (warm-up, RL steps, report). The boundary a test of a refusal stubs."""
    if recipe.backend == "megatron" or args.nproc > 1:
        from ..trainer.launch import launch

        return launch(args)  # torchrun; every rank runs the same Trainer

    from ..trainer import Trainer

    trainer = Trainer(recipe, resume=args.resume, task=inputs.task)  # --resume without a checkpoint: FileNotFoundError
    summary = trainer.run()
    if summary.get("interrupted"):
        return 130
    print(
        f"done: accuracy {summary['accuracy_before']:.3f} -> {summary['accuracy_after']:.3f}, "
        f"{summary['steps']} RL steps in {summary['rl_wall_s']:.0f} s; report: {recipe.out_dir}/report.md"
    )
    return 0
