"""Train with OpenRLHF 0.11.2 and CPPO from a recipe (recipes/openrlhf/*.yaml).

The recipe's ``cppo`` section configures pruning, its ``openrlhf`` section becomes
``openrlhf.cli.train_ppo_ray`` flags. Arguments after the recipe override it: ``--cppo.FIELD
VALUE`` for CPPO, anything else is added to the OpenRLHF flags (a later flag wins).
``--dry-run`` checks every flag against the pinned OpenRLHF parser and prints the plan
without starting Ray. Needs a GPU machine with OpenRLHF's own requirements to train.

  cppo-megatron openrlhf recipes/openrlhf/qwen2.5-1.5b-gsm8k-cppo.yaml --dry-run
  cppo-megatron openrlhf recipes/openrlhf/qwen2.5-1.5b-gsm8k-cppo.yaml --data.prompt_dataset /data/gsm8k
"""

from __future__ import annotations

import argparse

PASSTHROUGH = True  # unknown arguments go to the launcher


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="a recipe YAML, e.g. recipes/openrlhf/qwen2.5-1.5b-gsm8k-cppo.yaml")


def run(args: argparse.Namespace) -> int:
    from ..integrations.openrlhf.recipe import launcher_argv, load_recipe
    from ..integrations.openrlhf.train import run_argv

    recipe = load_recipe(args.recipe)  # a ValueError names the problem; the CLI prints it on one line
    if recipe.get("description"):
        print(str(recipe["description"]).strip())
    return run_argv(launcher_argv(recipe) + list(args.passthrough))
