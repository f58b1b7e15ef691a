"""``backend: megatron`` runs one ``Trainer`` per rank under torchrun.

``cppo-megatron train RECIPE --nproc N`` (``launch``) validates the recipe, then starts
``python -m torch.distributed.run --standalone --nproc-per-node N -m
cppo_megatron.trainer.launch RECIPE [overrides]``; every process runs ``main`` (gloo on
CPU, NCCL on CUDA). For several machines run that torchrun command yourself with
``--nnodes`` and a rendezvous endpoint.

Failures: a rank that raises prints one line naming its rank, step and phase and exits
1; torchrun then stops the other ranks and exits non-zero, naming the first failed rank.
A rank that dies (killed) breaks its peers' next collective (gloo: at once, as the
connection closes); one that hangs makes its peers' collective fail after
``megatron.collective_timeout_s``. Signals: see ``loop.py`` (exit status 130).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path

__all__ = ["launch", "main", "run_torchrun", "torchrun_command"]


def torchrun_command(recipe: str, overrides: list[str], nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "cppo_megatron.trainer.launch", recipe, *overrides]


def launch(args: argparse.Namespace) -> int:
    """Validate the recipe against the process count, then run torchrun; its exit status
    (130 when this process was asked to stop by SIGINT / SIGTERM)."""
    from .config import load_recipe

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
    try:
        import megatron.core  # noqa: F401
    except ImportError as exc:
        return fail(f"backend=megatron needs megatron-core ({exc}): pip install 'cppo-megatron[megatron]'")
    if getattr(args, "resume", False):
        from .checkpoint import checkpoints

        if not checkpoints(Path(recipe.out_dir)):
            return fail(f"--resume: no checkpoint under {recipe.out_dir}/checkpoints; run without --resume to start")
    if recipe.rollout.engine == "vllm":
        from ..rollout.vllm import INSTALL_HINT, vllm_distribution

        if vllm_distribution() is None:  # say it once, before N processes fail on it
            return fail(INSTALL_HINT)
    tp, pp = recipe.megatron.tp, recipe.megatron.pp
    if nproc % (tp * pp):
        return fail(f"--nproc {nproc} is not divisible by megatron.tp * megatron.pp = {tp} * {pp}")
    env = os.environ.copy()
    if recipe.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # honour device=cpu on a CUDA machine
    elif recipe.device == "cuda":
        import torch

        if not torch.cuda.is_available():  # pragma: no branch - CUDA present: only on a GPU machine
            return fail("device=cuda but no CUDA device is visible; use device=auto or device=cpu")
    # torchrun would set 1 thread per process; the trainer sets its own from recipe.threads
    env.setdefault("OMP_NUM_THREADS", str(max(1, (recipe.threads or os.cpu_count() or 1) // nproc)))
    overrides = list(args.overrides)
    cmd = torchrun_command(args.recipe, overrides + (["--resume"] if getattr(args, "resume", False) else []), nproc)
    print(f"launching {nproc} processes (tp={tp} pp={pp} dp={nproc // (tp * pp)}): {' '.join(cmd[1:])}",
          file=sys.stderr, flush=True)
    return run_torchrun(cmd, env, Path(recipe.out_dir))


def run_torchrun(cmd: list[str], env: dict[str, str], out_dir: Path) -> int:
    """Run the torchrun command (the boundary a test of a refusal stubs) and return its exit status, 130
    when the ranks stopped on SIGINT / SIGTERM after a checkpoint (``out_dir``'s interrupted marker)."""
    from .loop import INTERRUPTED_MARKER

    marker = out_dir / INTERRUPTED_MARKER
    started = time.time()
    proc = subprocess.Popen(cmd, env=env)
    stopped = []

    def forward(signum, frame):  # a scheduler's SIGTERM reaches the ranks through torchrun
        stopped.append(signum)
        if signum == signal.SIGTERM:
            proc.send_signal(signal.SIGTERM)
        # SIGINT: Ctrl-C in a terminal reaches torchrun and the ranks directly

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = proc.wait()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    if stopped or (code == 0 and marker.exists() and marker.stat().st_mtime >= started):
        return 130  # the ranks stopped on a signal, after a checkpoint
    if code != 0:
        print(f"cppo-megatron train: the job failed (torchrun exit status {code}); the lines above name the "
              "failed rank and what it was doing", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    """Entry point of every rank: ``python -m cppo_megatron.trainer.launch RECIPE [key=value ...] [--resume]``."""
    parser = argparse.ArgumentParser(prog="cppo_megatron.trainer.launch")
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args(argv)
    import torch
    import torch.distributed as dist

    from .config import load_recipe

    # megatron-core warns about optional CUDA kernels (apex, TE) on every rank: keep the
    # console to rank 0's progress and its other warnings
    warnings.filterwarnings("ignore", module=r"megatron\.")
    rank = int(os.environ.get("RANK", 0))
    if rank != 0:
        warnings.simplefilter("ignore")
    recipe = load_recipe(args.recipe, args.overrides)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":  # pragma: no cover - CUDA only
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=timedelta(seconds=recipe.megatron.collective_timeout_s))
    trainer = None
    code = 0
    summary: dict = {}
    try:
        from .loop import Trainer

        trainer = Trainer(recipe, resume=args.resume)
        summary = trainer.run()  # interrupted: exit 0 (torchrun would call 130 a failure); the launcher says 130
    except BaseException as exc:  # noqa: BLE001 - every failure names the rank and what it was doing
        where = "setup" if trainer is None else f"step {trainer.step + 1}, phase {trainer.phase}"
        first = (str(exc).splitlines() or [""])[0][:300]
        sys.stderr.write(f"cppo-megatron train: rank {rank} failed at {where}: {type(exc).__name__}: {first}\n")
        sys.stderr.flush()
        if os.environ.get("CPPO_MEGATRON_DEBUG"):
            import traceback

            traceback.print_exc()
        # peers may be blocked in a collective with this rank: leave without the teardown
        # collectives so torchrun sees the failure at once and stops the others
        os._exit(130 if isinstance(exc, KeyboardInterrupt) else 1)
    _teardown(trainer)
    if summary and not summary.get("interrupted"):
        line = (f"done: accuracy {summary['accuracy_before']:.3f} -> {summary['accuracy_after']:.3f}, "
                f"{summary['steps']} RL steps in {summary['rl_wall_s']:.0f} s")
        if "balance/imbalance" in summary:
            line += (f"; workload max/mean {summary['balance/imbalance']:.3f} "
                     f"(without redistribution {summary['balance/imbalance_without']:.3f})")
        print(line + f"; report: {recipe.out_dir}/report.md", flush=True)
    return code


def _teardown(trainer) -> None:
    """After a run that ended (a failed one leaves through ``os._exit``, so there is always a trainer)."""
    import torch.distributed as dist

    from ..megatron import destroy_parallel

    destroy_parallel()
    trainer.close()
    if dist.is_initialized():  # vLLM's shutdown may already have taken the default group down
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
