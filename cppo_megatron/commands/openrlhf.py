"""Train with OpenRLHF 0.11.2 and CPPO from a recipe (recipes/openrlhf/*.yaml).

The recipe's ``cppo`` section configures pruning, its ``openrlhf`` section becomes
``openrlhf.cli.train_ppo_ray`` flags. Arguments after the recipe override it: ``--cppo.FIELD
VALUE`` for CPPO, anything else is added to the OpenRLHF flags (a later flag wins).
``--dry-run`` checks every flag against the pinned OpenRLHF parser and prints the plan
without starting Ray. Needs a GPU machine with OpenRLHF's own requirements to train.

  cppo-megatron openrlhf recipes/openrlhf/qwen2.5-1.5b-gsm8k-cppo.yaml --dry-run
  cppo-megatron openrlhf recipes/openrlhf/qwen2.5-1.5b-gsm8k-cppo.yaml --data.prompt_dataset /data/gsm8k
  cppo-megatron openrlhf recipes/openrlhf/tiny_cpu_cppo.yaml                  # on a CPU machine (.venv-vllm)
  cppo-megatron openrlhf recipes/openrlhf/qwen2.5-1.5b-gsm8k-cppo.yaml --cpu recipes/openrlhf/cpu_toy.yaml
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ..recipes import arg_type as recipe_arg

PASSTHROUGH = True  # unknown arguments go to the launcher


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", type=recipe_arg("openrlhf"),
                        help="a recipe YAML, e.g. recipes/openrlhf/qwen2.5-1.5b-gsm8k-cppo.yaml, or its name "
                             "(qwen2.5-1.5b-gsm8k-cppo)")
    parser.add_argument("--cpu", metavar="OVERRIDE", default=None, type=recipe_arg("openrlhf"),
                        help="run a cluster recipe on this CPU machine at toy size: the override file's cpu section "
                             "and openrlhf flags replace the recipe's (recipes/openrlhf/cpu_toy.yaml)")


# OpenRLHF's loop imports these (openrlhf/trainer/ray/vllm_engine.py:7, utils/deepspeed/deepspeed.py)
TRAINING_MODULES = ("vllm", "deepspeed")
VLLM_VENV_ENV = "CPPO_VLLM_VENV"  # where scripts/setup_vllm.sh puts them (default: the checkout's .venv-vllm)


def _vllm_venv() -> Path:
    default = Path(__file__).resolve().parents[2] / ".venv-vllm"
    return Path(os.environ.get(VLLM_VENV_ENV) or default)


def _training_environment(args: argparse.Namespace) -> None:
    """A training run needs vLLM and DeepSpeed. Without them here: re-run the same command in the
    vLLM environment when it exists, else stop with the one command that builds and runs it."""
    import importlib.util
    import shlex
    import sys

    from ..errors import UsageError

    missing = [m for m in TRAINING_MODULES if importlib.util.find_spec(m) is None]
    if not missing:
        return
    argv = ["openrlhf", args.recipe, *(["--cpu", args.cpu] if args.cpu else []), *args.passthrough]
    venv = _vllm_venv()
    python = venv / "bin" / "python"
    if python.is_file() and Path(sys.prefix).resolve() != venv.resolve():
        print(f"cppo-megatron openrlhf: {' and '.join(missing)} missing in {sys.prefix}; running in {venv} "
              "(made by scripts/setup_vllm.sh)", flush=True)
        os.execv(str(python), [str(python), "-m", "cppo_megatron.cli", *argv])
    raise UsageError(
        f"OpenRLHF's training loop needs {' and '.join(missing)}, which {sys.prefix} lacks (the CPU path keeps them in "
        f"their own environment): run `bash scripts/setup_vllm.sh && .venv-vllm/bin/cppo-megatron "
        f"{shlex.join(argv)}` (on a GPU machine: pip install 'cppo-megatron[openrlhf,vllm]')")


def run(args: argparse.Namespace) -> int:
    from ..integrations.openrlhf.recipe import launcher_argv, load_recipe, merge_cpu_override
    from ..integrations.openrlhf.train import run_argv

    recipe = load_recipe(args.recipe)  # a ValueError names the problem; the CLI prints it on one line
    if args.cpu:
        recipe = merge_cpu_override(recipe, args.cpu)
    if "--dry-run" not in args.passthrough:
        _training_environment(args)  # before a CPU recipe builds its start model
    if recipe.get("description"):
        print(str(recipe["description"]).strip())
    dry_run = "--dry-run" in args.passthrough
    saved = dict(os.environ)
    try:
        num_gpus = None
        if "cpu" in recipe:
            from ..integrations.openrlhf.cpu.prepare import prepare, settings

            num_gpus = int(settings(recipe["cpu"])["num_gpus"])
            run = prepare(recipe["cpu"], build=not dry_run)  # sets the CPU environment in os.environ
            print(run.describe())
        return run_argv(launcher_argv(recipe) + list(args.passthrough), cpu_num_gpus=num_gpus)
    finally:
        if dry_run:  # a dry run leaves this process as it found it
            os.environ.clear()
            os.environ.update(saved)
