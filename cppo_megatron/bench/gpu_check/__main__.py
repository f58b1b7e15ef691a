"""A torchrun rank of the megatron check's TP/PP part:
``python -m cppo_megatron.bench.gpu_check --megatron-worker SPEC.json`` (started by gpu-check)."""

import sys

from .megatron_check import megatron_worker

if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--megatron-worker":
        sys.exit(megatron_worker(sys.argv[2]))
    sys.exit("usage: python -m cppo_megatron.bench.gpu_check --megatron-worker SPEC.json (used by gpu-check)")
