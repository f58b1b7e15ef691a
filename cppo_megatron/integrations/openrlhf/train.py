"""Run OpenRLHF's ``train_ppo_ray`` with CPPO pruning at ``make_experience_batch``.

    python -m cppo_megatron.integrations.openrlhf.train [--cppo.FIELD VALUE ...] [--dry-run] OPENRLHF_FLAGS...
    cppo-megatron openrlhf RECIPE.yaml [--dry-run] [--cppo.FIELD VALUE ...] [OPENRLHF_FLAGS...]

``--cppo.FIELD VALUE`` sets a ``CPPOConfig`` field (``--cppo.pruning_rate 0.875``,
``--cppo.scope batch``); ``--cppo.off`` runs plain OpenRLHF. Every other argument goes to
``openrlhf.cli.train_ppo_ray`` unchanged (checked first against its own parser).

How the hook reaches OpenRLHF's Ray workers: the trainer (``PPOTrainer`` or the async
``TrainingActor``) is a Ray actor in another process, so this launcher starts Ray itself
with ``$CPPO_OPENRLHF_CONFIG`` in the job's environment and
``hook.setup_ray_worker`` as the workers' setup hook, which wraps
``RemoteExperienceMaker`` in whichever worker imports it. OpenRLHF then finds Ray
initialised and runs as usual.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import runpy
import shlex
import sys
from collections.abc import Callable
from typing import Any

import yaml

from ...config import RENAMED, CPPOConfig, keep_count, nest_keys
from .. import vllm_shm
from . import hook
from .checkpoint import checkpoint_warnings, resume_hint
from .pinned import PINNED_VERSION, installed_version, pinned_parser

CPPO_PREFIX = "--cppo."
OPENRLHF_MODULE = "openrlhf.cli.train_ppo_ray"
# what train_ppo_ray.train() would put in the runtime env had it started Ray itself
OPENRLHF_RAY_ENV_DEFAULTS = {
    "TOKENIZERS_PARALLELISM": "true",
    "NCCL_DEBUG": "WARN",
    "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1",
}


def split_argv(argv: list[str]) -> tuple[dict[str, Any] | None, bool, list[str]]:
    """(CPPOConfig values or None for --cppo.off, dry_run, arguments for OpenRLHF)."""
    values: dict[str, Any] = {}
    off = dry_run = False
    forwarded: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--dry-run":
            dry_run = True
        elif arg == "--cppo.off":
            off = True
        elif arg.startswith(CPPO_PREFIX):
            name, eq, value = arg[len(CPPO_PREFIX) :].partition("=")
            if not eq:
                if i + 1 >= len(argv):
                    raise ValueError(f"{arg} needs a value")
                i += 1
                value = argv[i]
            values[name] = _scalar(value)
        else:
            forwarded.append(arg)
        i += 1
    if off and values:
        raise ValueError(f"--cppo.off together with CPPO settings {sorted(values)}")
    return (None if off else values), dry_run, forwarded


_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _scalar(text: str) -> Any:
    """A command-line value as YAML reads it (0.875 -> float, true -> bool, null -> None),
    plus what YAML 1.1 leaves a string: exponents without a dot (1e-9)."""
    value = yaml.safe_load(text)
    if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        return float(value)
    return value


def parse_openrlhf_args(forwarded: list[str]):
    """OpenRLHF's hierarchical args from its own parser (pinned source); errors name the flag."""
    from types import SimpleNamespace

    parser = pinned_parser()
    parser.exit_on_error = False

    def refuse(message: str):  # argparse would print its usage and exit; one line instead
        raise ValueError(f"OpenRLHF {PINNED_VERSION} rejects the arguments: {message}")

    parser.error = refuse  # type: ignore[method-assign]  # this parser only: argparse calls self.error
    try:
        flat = parser.parse_args(forwarded)
    except ValueError:
        raise
    except Exception as exc:  # argparse.ArgumentError
        raise ValueError(f"OpenRLHF {PINNED_VERSION} rejects the arguments: {exc}") from exc
    root: dict = {}
    for key, value in vars(flat).items():  # as openrlhf.utils.config.hierarchize
        node = root
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value

    def build(x):
        return SimpleNamespace(**{k: build(v) for k, v in x.items()}) if isinstance(x, dict) else x

    return build(root)


def plan(cfg: CPPOConfig, args: Any) -> dict[str, float]:
    """Per-step sample counts this configuration gives OpenRLHF (checked before launching)."""
    hook.check_supported(args)
    if not (args.reward.remote_url or args.train.agent_func_path):
        raise ValueError(
            "CPPO prunes before the model forwards, so rewards must come with the rollout: set "
            "--reward.remote_url (a URL or a reward_func .py file) or --train.agent_func_path"
        )
    if cfg.keep_mass is not None:
        raise ValueError(
            f"cppo keep_mass={cfg.keep_mass}: the OpenRLHF launcher plans per-step counts from a fixed k; "
            "set pruning_rate or keep_per_group (keep_mass runs in the embedded trainer)"
        )
    n, prompts = args.rollout.n_samples_per_prompt, args.rollout.batch_size
    total = n * prompts
    if cfg.scope == "group":
        selected = prompts * cfg.keep_for_group(n)
    elif cfg.keep_per_group is not None:
        selected = prompts * cfg.keep_per_group
    else:
        selected = keep_count(total, cfg.pruning_rate, None)  # the batch as one pool
    multiple = hook.minimum_keep_multiple(args)
    kept = min(total, -(-selected // multiple) * multiple)
    return {
        "prompts_per_step": float(prompts),
        "generated_per_step": float(total),
        "selected_per_step": float(selected),
        "kept_per_step": float(kept),
        "keep_multiple": float(multiple),
        "optimizer_steps_per_rollout": kept / args.train.batch_size * args.train.max_epochs,
    }


BATCH_FLAG = "--rollout.batch_size"


def allocate(cfg: CPPOConfig, forwarded: list[str], args: Any) -> tuple[list[str], int, int]:
    """Allocation from the final CPPO settings: ``--rollout.batch_size`` is the GRPO
    (pre-allocation) prompt count; with ``cppo.allocation`` it becomes b x G / k so the
    survivors fill the update batch GRPO would have had (as veRL's ``data.train_batch_size``).

    Runs after every override, so ``--cppo.pruning_rate 0.75`` re-derives the prompts.
    Returns (OpenRLHF arguments with the final ``--rollout.batch_size``, prompts before, after).
    """
    n, before = args.rollout.n_samples_per_prompt, args.rollout.batch_size
    if not cfg.allocation:
        return forwarded, before, before
    k = cfg.keep_for_group(n)
    if (before * n) % k:
        raise ValueError(
            f"allocation: {BATCH_FLAG}={before} x --rollout.n_samples_per_prompt={n} / keep={k} is not a whole "
            "number of prompts; pick a pruning rate with G(1-P) dividing G x batch_size, or --cppo.allocation false"
        )
    after = before * n // k
    kept: list[str] = []
    i = 0
    while i < len(forwarded):  # drop every earlier value; the final one goes last
        arg = forwarded[i]
        if arg == BATCH_FLAG:
            i += 2
            continue
        if not arg.startswith(BATCH_FLAG + "="):
            kept.append(arg)
        i += 1
    return kept + [BATCH_FLAG, str(after)], before, after


def ray_runtime_env(cfg: CPPOConfig | None) -> dict:
    """The Ray job environment that carries the hook (and, when on, the CPU mode, audit and
    metrics settings) into every worker."""
    from . import cpu, diagnostics, metrics
    from .worker import HOOK

    env = {k: os.environ.get(k, v) for k, v in OPENRLHF_RAY_ENV_DEFAULTS.items()}
    if cfg is not None:
        env[hook.ENV_CONFIG] = json.dumps(cfg.to_dict())
    if cpu.enabled():
        from .cpu.prepare import PATH_VARS

        names = [*cpu.worker_env(), *PATH_VARS.values(), "TORCH_EXTENSIONS_DIR", "PATH", metrics.EVAL_BEFORE_ENV,
                 vllm_shm.REGISTRY_ENV]
        env.update({k: os.environ[k] for k in names if k in os.environ})
    for name in (*diagnostics.SWITCHES, metrics.ENV):
        if os.environ.get(name):
            env[name] = os.environ[name]
    return {"env_vars": env, "worker_process_setup_hook": HOOK}


def launch(forwarded: list[str], cfg: CPPOConfig | None, num_gpus: int | None = None,
           resume_hint: Callable[[], str] = lambda: "") -> None:
    """Start Ray with our worker setup hook (CPPO hook, CPU mode, audit, metrics), then run
    OpenRLHF's __main__ block. ``num_gpus``: logical GPUs for a CPU run. A dead Ray worker ends
    the run with a line naming it (``integrations/watchdog.py``) and ``resume_hint()``."""
    from .. import watchdog
    from . import cpu, diagnostics, metrics
    from .worker import setup

    ours = cfg is not None or cpu.enabled() or bool(diagnostics.requested()) or bool(os.environ.get(metrics.ENV))
    if ours:
        runtime_env = ray_runtime_env(cfg)
        if cfg is not None:
            os.environ[hook.ENV_CONFIG] = runtime_env["env_vars"][hook.ENV_CONFIG]
        setup()  # this (driver) process as well
        import ray

        if ray.is_initialized():
            raise RuntimeError("Ray is already initialised in this process; the CPPO worker setup hook cannot be added")
        kwargs: dict[str, Any] = {"runtime_env": runtime_env}
        if cpu.enabled():
            # OpenRLHF's placement bundles ask for {"GPU": 1, "CPU": 1}: logical slots, not hardware
            slots = int(num_gpus or 16)
            kwargs.update(num_gpus=slots, num_cpus=slots, include_dashboard=False)
        ray.init(**kwargs)
    sys.argv = [OPENRLHF_MODULE, *forwarded]
    _clean_shm("a run before this one")  # its driver was killed before it could
    try:
        with watchdog.watched("OpenRLHF", resume_hint):
            runpy.run_module(OPENRLHF_MODULE, run_name="__main__", alter_sys=True)
    finally:
        if ours:
            import ray

            ray.shutdown()
        _clean_shm("this run")


def _clean_shm(whose: str) -> None:
    # vLLM's CPU communicator and FileStore outlive its killed workers (integrations/vllm_shm.py)
    line = vllm_shm.clean_registered(whose)
    if line:
        print(line, flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    try:
        return run_argv(argv)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def run_argv(argv: list[str], cpu_num_gpus: int | None = None) -> int:
    """The launcher without its error printing: ValueError names a bad flag or value (the
    `cppo-megatron` CLI prints it on one line, exit 2; `main` does the same here).
    With the CPU mode on (``cpu.enabled()``), the CPU mode's required flags are added."""
    raw, dry_run, forwarded = split_argv(argv)
    cfg, args, forwarded, batches = _settle_flags(raw, forwarded)
    _check_run(cfg, args, cpu_num_gpus)
    command = shlex.join(["python", "-m", OPENRLHF_MODULE, *forwarded])
    if cfg is None:
        print("CPPO off: plain OpenRLHF")
    else:
        # OpenRLHF's estimator decides the advantage formula; the hook uses the same
        cfg = dataclasses.replace(cfg, adv_norm=hook.SUPPORTED_ESTIMATORS[args.algo.advantage.estimator])
        _print_plan(cfg, args, *batches)
    print(f"openrlhf: {command}")
    if dry_run:
        if cfg is not None:
            print(f"patched checkout instead: export {hook.ENV_CONFIG}='{json.dumps(cfg.to_dict())}'")
        return 0
    launch(forwarded, cfg, num_gpus=cpu_num_gpus, resume_hint=lambda: resume_hint(args))
    return 0


def _settle_flags(raw: dict | None, forwarded: list[str]) -> tuple[CPPOConfig | None, Any, list[str], tuple[int, int]]:
    """The run's CPPO config (None: CPPO off), OpenRLHF's parsed args and the flags it gets, after
    the CPU mode's required flags, the allocation (prompts per step; ``(before, after)``) and the CPU
    recipe's run length; warns of an OpenRLHF other than the pinned one and of settings the hook reads
    differently."""
    from . import cpu

    # nested sections, dotted keys and deprecated flat names (a FutureWarning each) as CPPOConfig takes them
    values = None if raw is None else nest_keys(CPPOConfig, raw, where="cppo", renamed=RENAMED)
    if cpu.enabled():
        from .cpu.prepare import required_flags

        forwarded = required_flags(forwarded)
    version = installed_version()
    if version != PINNED_VERSION:
        print(
            f"warning: OpenRLHF {version} is installed; this integration is pinned to {PINNED_VERSION} "
            "(`cppo-megatron patch openrlhf --check` reports whether the hooked code changed)",
            file=sys.stderr,
        )
    args = parse_openrlhf_args(forwarded)
    for note in [] if values is None else hook.check_settings(values, args.algo.advantage.estimator):
        print(f"warning: {note}", file=sys.stderr)
    cfg = None if values is None else CPPOConfig.from_dict(values)
    batches = (0, 0)
    if cfg is not None:  # after every override: the final rate decides the prompts per step
        forwarded, before, after = allocate(cfg, forwarded, args)
        batches = (before, after)
        args = parse_openrlhf_args(forwarded)
        if cfg.early_stop.enabled and not args.vllm.enable_prefix_caching:
            # each segment continues its prefix in a new request: vLLM's prefix cache keeps its KV
            forwarded = [*forwarded, "--vllm.enable_prefix_caching"]
            args = parse_openrlhf_args(forwarded)
    if cpu.enabled():
        from .cpu.prepare import max_steps_flags

        steps = max_steps_flags(args.rollout.batch_size)  # the CPU recipe's run length, after allocation
        if steps:
            forwarded = forwarded + steps
            args = parse_openrlhf_args(forwarded)
    return cfg, args, forwarded, batches


def _check_run(cfg: CPPOConfig | None, args: Any, cpu_num_gpus: int | None) -> None:
    """Warnings on resuming, the notes (or refusals) of selective rollout and DAPO's filter, then what
    OpenRLHF / DeepSpeed / vLLM would refuse minutes later in a Ray actor: one line now."""
    for note in checkpoint_warnings(args):
        print(f"warning: {note}", file=sys.stderr)
    if cfg is not None and cfg.selective.enabled:  # GRESO before generation: refused where not built, else explained
        from .selective import check_args as check_selective

        for note in check_selective(args):
            print(f"note: {note}")
    if cfg is not None and cfg.early_stop.enabled:  # segment-wise generation: refused where not built
        from .early_stop import check_args as check_early_stop

        for note in check_early_stop(args, cfg):
            print(f"note: {note}")
    if cfg is not None:  # DAPO's filter before CPPO: refused where it cannot be honoured, else explained
        from .filtering import check_args as check_filtering

        for note in check_filtering(args):
            print(f"note: {note}")
    from .preflight import check as preflight

    preflight(args, cpu_num_gpus=cpu_num_gpus)


def _print_plan(cfg: CPPOConfig, args: Any, before: int, after: int) -> None:
    """The CPPO settings, the allocation (``before`` -> ``after`` prompts per step), the counts per step
    and what in them a user should change."""
    counts = plan(cfg, args)
    print(cfg.describe())
    n = args.rollout.n_samples_per_prompt
    print(
        f"allocation={cfg.allocation}: {BATCH_FLAG} {before} -> {after} prompts"
        + (f" (x G/k = {n}/{cfg.keep_for_group(n)})" if cfg.allocation else " (unchanged)")
    )
    print(
        "per step: {prompts_per_step:.0f} prompts x {n} = {generated_per_step:.0f} completions generated, "
        "{selected_per_step:.0f} selected, {kept_per_step:.0f} kept (OpenRLHF needs multiples of "
        "{keep_multiple:.0f}), {optimizer_steps_per_rollout:g} optimizer steps".format(
            n=args.rollout.n_samples_per_prompt, **counts
        )
    )
    reason = cfg.noop_reason(n)
    if reason is not None:
        print(f"warning: cppo {reason}. Set --rollout.n_samples_per_prompt (G) > 1 and --cppo.pruning_rate "
              ">= 1/G, or run plain OpenRLHF (--cppo.off)")
    elif counts["kept_per_step"] >= counts["generated_per_step"] and not cfg.is_grpo:
        print(f"warning: cppo keeps all {counts['kept_per_step']:.0f} completions after rounding up to "
              f"OpenRLHF's multiple of {counts['keep_multiple']:.0f}: nothing is pruned. Raise "
              f"{BATCH_FLAG} (or keep cppo.allocation on) or lower --train.batch_size")
    if counts["kept_per_step"] > counts["selected_per_step"]:
        print(
            "note: CPPO will keep more than it selects every step (metric cppo/topped_up); raise "
            "--rollout.batch_size or lower --train.batch_size to avoid it"
        )
    if args.actor.lr_scheduler != "constant_with_warmup":
        print(
            f"note: OpenRLHF sizes the --actor.lr_scheduler {args.actor.lr_scheduler} horizon from unpruned "
            "sample counts; with pruning the run ends early in that schedule"
        )


if __name__ == "__main__":
    sys.exit(main())
