"""``cppo-megatron train RECIPE --nproc N`` for ``backend: megatron``: torchrun underneath.

Starts ``N`` local processes with ``python -m torch.distributed.run --standalone
--nproc-per-node N -m cppo_megatron.megatron.backend RECIPE [overrides]``; every process
runs ``backend.main`` (gloo on CPU, NCCL on CUDA). For several machines run that
torchrun command yourself with ``--nnodes`` and a rendezvous endpoint.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys


def torchrun_command(recipe: str, overrides: list[str], nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "cppo_megatron.megatron.backend", recipe, *overrides]


def launch(args: argparse.Namespace) -> int:
    """Validate the recipe against the process count, then run torchrun; its exit code."""
    from ..trainer.config import load_recipe

    def fail(msg: str) -> int:
        print(f"cppo-megatron train: {msg}", file=sys.stderr)
        return 2

    try:
        recipe = load_recipe(args.recipe, args.overrides)
    except (ValueError, FileNotFoundError) as exc:
        return fail(str(exc))
    nproc = args.nproc
    if not isinstance(nproc, int) or nproc < 1:
        return fail(f"--nproc must be >= 1, got {nproc!r}")
    if recipe.backend != "megatron":
        return fail(f"--nproc {nproc} needs backend=megatron (the recipe has backend={recipe.backend!r}); "
                    "add backend=megatron or drop --nproc")
    if getattr(args, "resume", False):
        return fail("--resume is not supported by backend=megatron (it writes final.pt, no checkpoints)")
    if recipe.rollout.engine == "vllm":
        from ..rollout.vllm import INSTALL_HINT, vllm_distribution

        if vllm_distribution() is None:  # say it once, before N processes fail on it
            return fail(INSTALL_HINT)
    tp, pp = recipe.megatron.tp, recipe.megatron.pp
    if nproc % (tp * pp):
        return fail(f"--nproc {nproc} is not divisible by megatron.tp * megatron.pp = {tp} * {pp}")
    env = os.environ.copy()
    # torchrun would set 1 thread per process; the backend sets its own from recipe.threads
    env.setdefault("OMP_NUM_THREADS", str(max(1, (recipe.threads or os.cpu_count() or 1) // nproc)))
    cmd = torchrun_command(args.recipe, list(args.overrides), nproc)
    print(f"launching {nproc} processes (tp={tp} pp={pp} dp={nproc // (tp * pp)}): {' '.join(cmd[1:])}",
          file=sys.stderr, flush=True)
    return subprocess.call(cmd, env=env)
