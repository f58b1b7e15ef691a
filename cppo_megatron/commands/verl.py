"""Train with veRL 0.9.1 and CPPO: an alias of `python -m cppo_megatron.integrations.verl.main`.

Every argument goes to veRL's hydra command line (its config plus the `cppo` group):

  cppo-megatron verl cppo.pruning_rate=0.875 data.train_files=... actor_rollout_ref.model.path=...
  cppo-megatron verl recipes/verl/qwen2.5-1.5b-gsm8k-cppo.yaml [overrides]   (any recipe file)
  cppo-megatron verl --config-path=$PWD/recipes/verl --config-name=qwen2.5-1.5b-gsm8k-cppo
  cppo-megatron verl recipes/verl/qwen2.5-7b-math-megatron-cppo.yaml --cpu recipes/verl/cpu_toy.yaml
                                            (a cluster recipe on a CPU machine at toy size: the
                                            override file's keys over the recipe's)
  cppo-megatron verl --cppo-dry-run ...     (print the config after allocation and exit)
  cppo-megatron verl --check                (plugin loaded by `import verl`, the functions the GPU
                                            path hooks unchanged? exit 0 if so; CPU-mode drift warns)
  cppo-megatron verl qwen2.5-7b-math-megatron-cppo --cppo-dry-run   (a shipped recipe by name)
"""

from __future__ import annotations

import argparse
import os

from ..errors import UsageError

PASSTHROUGH = True


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--check",
        action="store_true",
        help="check that `import verl` loads the plugin and that the veRL functions its GPU path hooks are "
        "unchanged (drift guard; exit 1 if not); drift only in what the CPU mode patches (CPU seams, "
        "megatron-core / mbridge functions) is a warning",
    )


def _check() -> int:
    import json
    import os
    import subprocess
    import sys

    # a fresh interpreter, so the answer is what veRL's own processes will see
    code = (
        "import json, sys, verl\n"
        "from verl.trainer.ppo import core_algos\n"
        "loaded = 'cppo_megatron.integrations.verl' in sys.modules\n"
        "from cppo_megatron.integrations.verl.diagnostics import drift\n"
        "r = drift.report()\n"
        "print(json.dumps({'verl': verl.__version__, 'plugin_loaded': loaded,"
        " 'estimator': 'cppo' in core_algos.ADV_ESTIMATOR_REGISTRY, 'drift': r.gpu_path,"
        " 'cpu_mode_drift': r.cpu_mode, 'cpu_mode_versions': r.versions}))\n"
    )
    env = dict(os.environ)
    env.pop("VERL_USE_EXTERNAL_MODULES", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        print(out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "import verl failed")
        return 1
    report = json.loads(out.stdout.strip().splitlines()[-1])
    code_, lines = verdict(report)
    print(json.dumps(report))
    for line in lines:
        print(line, file=sys.stderr)
    return code_


def verdict(report: dict) -> tuple[int, list[str]]:
    """(exit status, lines for the user) of a ``--check`` report: 1 when the plugin did not load or
    a function the GPU path hooks drifted (``drift``); CPU-mode drift and another veRL version
    whose hooked functions are unchanged are warnings (exit 0)."""
    from cppo_megatron.integrations.verl import SUPPORTED_VERL
    from cppo_megatron.integrations.verl.diagnostics.drift import DriftReport

    report["supported_verl"] = SUPPORTED_VERL
    lines = []
    if not report["plugin_loaded"] or not report["estimator"]:
        lines.append("error: `import verl` did not load the plugin (is cppo-megatron installed in this environment, "
                     "and VERL_USE_EXTERNAL_PLUGINS not 'none'?)")
    if report["drift"]:
        lines.append(f"error: {len(report['drift'])} veRL function(s) the plugin's GPU path hooks or relies on differ "
                     f"from veRL {SUPPORTED_VERL}'s: {'; '.join(report['drift'])}")
    elif report["verl"] != SUPPORTED_VERL:
        lines.append(f"warning: veRL {report['verl']} is not the release the plugin was built on ({SUPPORTED_VERL}); "
                     "the functions it hooks are unchanged")
    cpu = DriftReport([], list(report.get("cpu_mode_drift", [])), list(report.get("cpu_mode_versions", []))).warning()
    if cpu:
        lines.append(cpu)
    return (1 if any(line.startswith("error:") for line in lines) else 0), lines


def run(args: argparse.Namespace) -> int:
    if args.check:
        return _check()
    from cppo_megatron._optional import require

    require("verl", "the veRL integration")
    from cppo_megatron.integrations.verl.main import main

    # hydra prints its own multi-line report and exits 1 unless HYDRA_FULL_ERROR=1, which
    # lets the exception reach the CLI: one line and exit 2 (the traceback with --debug)
    previous = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        with _without_hydra_job_banner():
            main(list(args.passthrough))
    except Exception as exc:
        if _is_config_error(exc):
            raise UsageError(_config_message(exc)) from exc
        raise
    finally:
        if previous is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = previous
    return 0


def _is_config_error(exc: BaseException) -> bool:
    """hydra's composition / override errors and omegaconf's key and type errors."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from cppo_megatron.integrations.verl.overrides import OverrideFileError

    return isinstance(exc, (HydraException, OmegaConfBaseException, OverrideFileError))


def _config_message(exc: BaseException) -> str:
    # "Could not override 'cppo.pruning_rat'." + its omegaconf cause "Key 'pruning_rat' is not in struct"
    cause = exc.__cause__
    first = str(cause).splitlines()[0] if cause is not None and str(cause).strip() else ""
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return f"{text} ({first})" if first and first not in text else text


class _without_hydra_job_banner:
    """Drops the line hydra writes to stderr before re-raising a job's exception
    ("Error executing job with overrides: [...]"), so a failure stays one line."""

    BANNER = "Error executing job with overrides:"

    def __enter__(self):
        import sys

        self._stderr = sys.stderr
        outer = self

        class _Filter:
            def write(self, text):
                return len(text) if text.startswith(outer.BANNER) else outer._stderr.write(text)

            def __getattr__(self, name):
                return getattr(outer._stderr, name)

        sys.stderr = _Filter()
        return self

    def __exit__(self, *exc):
        import sys

        sys.stderr = self._stderr
        return False
