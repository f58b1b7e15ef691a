"""Train with veRL 0.9.1 and CPPO: an alias of `python -m cppo_megatron.integrations.verl.main`.

Every argument goes to veRL's hydra command line (its config plus the `cppo` group):

  cppo-megatron verl cppo.pruning_rate=0.875 data.train_files=... actor_rollout_ref.model.path=...
  cppo-megatron verl recipes/verl/qwen2.5-1.5b-gsm8k-cppo.yaml [overrides]   (any recipe file)
  cppo-megatron verl --config-path=$PWD/recipes/verl --config-name=qwen2.5-1.5b-gsm8k-cppo
  cppo-megatron verl recipes/verl/qwen2.5-7b-math-megatron-cppo.yaml --cpu recipes/verl/cpu_toy.yaml
                                            (a cluster recipe on a CPU machine at toy size: the
                                            override file's keys over the recipe's)
  cppo-megatron verl --cppo-dry-run ...     (print the config after allocation and exit)
  cppo-megatron verl --check                (veRL 0.9.1, plugin loaded by `import verl`, hooked
                                            methods unchanged? exit 0 if so)
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
        help="check that veRL is the supported version, that `import verl` loads the plugin and "
        "that the veRL methods it hooks are unchanged (drift guard)",
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
        "from cppo_megatron.integrations.verl import drift\n"
        "print(json.dumps({'verl': verl.__version__, 'plugin_loaded': loaded,"
        " 'estimator': 'cppo' in core_algos.ADV_ESTIMATOR_REGISTRY, 'drift': drift.changed()}))\n"
    )
    env = dict(os.environ)
    env.pop("VERL_USE_EXTERNAL_MODULES", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        print(out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "import verl failed")
        return 1
    report = json.loads(out.stdout.strip().splitlines()[-1])
    from cppo_megatron.integrations.verl import SUPPORTED_VERL

    report["supported_verl"] = SUPPORTED_VERL
    print(json.dumps(report))
    ok = report["plugin_loaded"] and report["estimator"] and not report["drift"] and report["verl"] == SUPPORTED_VERL
    return 0 if ok else 1


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
