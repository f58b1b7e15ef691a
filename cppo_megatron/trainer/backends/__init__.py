"""Policy backends of the step pipeline (``base.PolicyBackend``): ``HFBackend`` (one
process) and ``MegatronBackend`` (megatron-core shards under torchrun; imported lazily)."""

from .base import PassResult, PolicyBackend, TrainRows, UpdateResult
from .hf import HFBackend

__all__ = ["HFBackend", "PassResult", "PolicyBackend", "TrainRows", "UpdateResult"]
