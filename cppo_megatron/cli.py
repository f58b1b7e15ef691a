"""`cppo-megatron` command line.

Each command lives in its own module, imported only when that command runs, so
``cppo-megatron --help`` and ``doctor`` stay fast and work without optional backends.
A command module provides ``configure(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import types

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "doctor": ("cppo_megatron.commands.doctor",
               "report which backends (torch/CUDA, megatron-core, veRL, vLLM, Ray, ...) import, with versions"),
    "demo": ("cppo_megatron.commands.demo",
             "run the CPPO core on synthetic rewards: advantages, pruning, allocation, balancing, timing"),
    "recipes": ("cppo_megatron.commands.recipes",
                "list the shipped recipes (host, model, layout, cluster size); every command takes a recipe's name"),
    "train": ("cppo_megatron.commands.train", "train with GRPO/CPPO on one machine from a recipe YAML (the main job)"),
    "openrlhf": ("cppo_megatron.commands.openrlhf",
                 "train with OpenRLHF 0.11.2 + CPPO from a recipe (recipes/openrlhf/*.yaml); --dry-run checks it"),
    "patch": ("cppo_megatron.commands.patch",
              "check or apply the CPPO source patch to an installed framework (openrlhf)"),
    "megatron-check": ("cppo_megatron.commands.megatron_check",
                       "HF -> megatron TP/PP/DP on local processes: log-probs vs HF, weight round trip, one pruned "
                       "rebalanced update"),
    "study": ("cppo_megatron.commands.study",
              "sweep P x metric x allocation x seeds at equal time budgets, with a supervised control (a veRL recipe: "
              "inside veRL, equal wall time)"),
    "verl": ("cppo_megatron.commands.verl",
             "train with veRL 0.9.1 + CPPO (= python -m cppo_megatron.integrations.verl.main; veRL hydra overrides)"),
    "export-hf": ("cppo_megatron.commands.export_hf",
                  "export an embedded-trainer model (warm-up, checkpoint) as an HF model directory with a real "
                  "tokenizer"),
    "bench": ("cppo_megatron.commands.bench",
              "benchmarks (speedup, rollout, overhead, balance, verl, openrlhf, gradient, predictor): JSON + "
              "markdown + PNG into --out"),
    "simulate": ("cppo_megatron.commands.simulate", "cost model of GRPO/CPPO steps on GPU clusters; --check-paper"),
    "advise": ("cppo_megatron.commands.advise",
               "what CPPO would do for your run: S_max, step time, allocation and the recipe change per P, from a "
               "veRL / OpenRLHF / trainer log"),
    "example-data": ("cppo_megatron.commands.example_data",
                     "write a small GSM8K-format train/test pair (word problems, offline) to try bring-your-own data"),
    "gpu-check": ("cppo_megatron.commands.gpu_check",
                  "prove the GPU path in minutes: env, core, megatron-core, trainer on the device (--device cpu "
                  "--quick in CI)"),
}

EPILOG = """\
examples:
  cppo-megatron doctor
  cppo-megatron recipes                  (the shipped recipes; pass a name where a command takes a recipe file)
  cppo-megatron train recipes/tiny_cpu.yaml cppo.pruning_rate=0.5
  cppo-megatron verl qwen2.5-7b-math-megatron-cppo --cppo-dry-run   (a recipe by name, e.g. from a wheel)
  cppo-megatron demo --group-size 16 --pruning-rate 0.875 --ranks 8
  cppo-megatron openrlhf recipes/openrlhf/qwen2.5-1.5b-gsm8k-cppo.yaml --dry-run
  cppo-megatron patch openrlhf --check
  cppo-megatron megatron-check --tp 2 --pp 1 --dp 2
  cppo-megatron verl recipes/verl/qwen2.5-1.5b-gsm8k-cppo.yaml   (any veRL recipe file; + hydra overrides)
  cppo-megatron verl recipes/verl/qwen2.5-7b-math-megatron-cppo.yaml --cpu recipes/verl/cpu_toy.yaml   (toy size on CPU)
  cppo-megatron verl recipes/verl/tiny_cpu_cppo.yaml trainer.total_training_steps=40   (veRL on CPU)
  cppo-megatron export-hf runs/tiny_cpu/warmup.pt runs/verl_tiny/model
  cppo-megatron bench balance --out runs/bench
  cppo-megatron study recipes/tiny_cpu.yaml --seeds 3 --budget 75
  cppo-megatron example-data runs/byod_data          (GSM8K-format files for recipes/byod_gsm8k_cpu.yaml)
  cppo-megatron simulate --model 7B --gpu H100-SXM --dp 8
  cppo-megatron advise runs/verl_tiny/tiny_cpu_grpo/metrics.jsonl   (S_max and the recipe change for your run)
  cppo-megatron gpu-check --out runs/gpu_check          (on a GPU machine; --device cpu --quick anywhere)
  cppo-megatron COMMAND --help      (options of one command)

A failure the user can fix (a bad value, a missing file or package) prints one line and
exits with status 2; --debug (anywhere on the line) shows the traceback instead.
"""

DEBUG_FLAG = "--debug"


def user_errors() -> tuple[type[BaseException], ...]:
    """Exception types the CLI reports as one line + exit 2: validation errors (ValueError),
    missing files and optional packages, and UsageError (what commands wrap framework
    errors in, e.g. hydra's composition errors)."""
    from ._optional import MissingDependency
    from .errors import UsageError

    return (UsageError, ValueError, FileNotFoundError, NotADirectoryError, MissingDependency)


def one_line(exc: BaseException) -> str:
    """The exception's message on a single line (framework messages are often multi-line)."""
    text = " ".join(part.strip() for part in str(exc).splitlines() if part.strip())
    return text or type(exc).__name__


def _top_parser() -> argparse.ArgumentParser:
    width = max(len(n) for n in COMMANDS) + 2
    lines = "\n".join(f"  {name:<{width}} {help_}" for name, (_, help_) in COMMANDS.items())
    return argparse.ArgumentParser(
        prog="cppo-megatron",
        description=(
            "CPPO (completion pruning) for GRPO training: keep only the completions whose "
            "advantage teaches the most, refill with new prompts, rebalance across ranks.\n\n"
            f"commands:\n{lines}"
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = DEBUG_FLAG in argv  # global: `cppo-megatron --debug train ...` or at the end
    argv = [a for a in argv if a != DEBUG_FLAG]
    top = _top_parser()
    top.add_argument("--version", action="store_true", help="print the version and exit")
    top.add_argument(DEBUG_FLAG, action="store_true",
                     help="show the traceback of a failure (default: one line, exit 2)")
    if not argv or argv[0] in ("-h", "--help"):
        top.print_help()
        return 0
    if argv[0] == "--version":
        from . import __version__

        print(__version__)
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        top.print_usage(sys.stderr)
        print(f"cppo-megatron: unknown command {name!r}; choose from {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module, args = parse_command(name, rest)
    args.debug = debug
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except user_errors() as exc:
        if debug:
            raise
        print(f"cppo-megatron {name}: error: {one_line(exc)} (--debug shows the traceback)", file=sys.stderr)
        return 2


def stdout_reader_gone() -> bool:
    """True when stdout is a pipe whose reading end is closed (poll reports POLLERR on the
    write end once no reader is left): the one BrokenPipeError the CLI stops quietly on."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll (Windows), stdout closed or replaced
        return False


def parse_command(name: str, rest: list[str]) -> tuple[types.ModuleType, argparse.Namespace]:
    """(command module, parsed arguments) for ``cppo-megatron NAME REST...``; argparse exits 2
    on a bad option. Also what the docs test uses to check a command line without running it.
    ``--debug`` is the CLI's (``main`` reads it anywhere on the line), never a command's option."""
    rest = [a for a in rest if a != DEBUG_FLAG]
    module = importlib.import_module(COMMANDS[name][0])
    parser = argparse.ArgumentParser(
        prog=f"cppo-megatron {name}",
        description=(module.__doc__ or COMMANDS[name][1]).strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    module.configure(parser)
    if getattr(module, "PASSTHROUGH", False):  # forwards unknown arguments (framework launchers)
        args, extra = parser.parse_known_args(rest)
        args.passthrough = extra
    else:
        try:  # options may sit between positionals: `train RECIPE --nproc 4 key=value`
            args = parser.parse_intermixed_args(rest)
        except TypeError:  # argparse cannot intermix with subcommands (bench)
            args = parser.parse_args(rest)
    return module, args


def console() -> int:
    """The ``cppo-megatron`` command: ``main`` with each repeated warning of the libraries it
    drives shown once and counted at exit (a job log, not a wall of repeats); ``main`` itself,
    which tests call in-process, changes no logging. Output piped into a reader that stops
    early (``| head``, ``less`` quit) ends the command with status 141, without a traceback."""
    from .integrations.logs import collapse_repeated_logs

    collapse_repeated_logs()
    try:
        rc = main()
        sys.stdout.flush()  # a reader that left shows here, not as a traceback at exit
        return rc
    except BrokenPipeError:
        if not stdout_reader_gone():
            raise  # a socket or a child's pipe: a real failure, with its traceback
        # `cppo-megatron verl ... --cppo-dry-run | head`: the reader has what it wanted; stop
        # as `yes | head` does, quietly (stdout to /dev/null so Python's exit flush is quiet too)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(console())
