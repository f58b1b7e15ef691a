"""What a recipe says about allocation: the batch per step, and whether the rollout engine can
hold the larger generation batch allocation asks for.

Allocation draws B / (1 - P) prompts a step instead of B, so the rollout generates G B / (1 - P)
completions; the update still trains B G. Nothing in the update grows; the rollout's memory does.
The sizes come from the project's memory code (``megatron/memory.py``: ``hf_parameters``,
``kv_cache_bytes``; ``trainer/sizing.py``: ``estimate``), not a new estimate:

- veRL and OpenRLHF generate with vLLM, whose KV-cache pool is fixed (``gpu_memory_utilization``
  of the device, less the weights): a batch larger than the pool holds decodes in waves, so it
  costs about linearly more and gains nothing from its size. Per engine replica: the KV cache of
  all its sequences at full length (prompt + response) against that pool, and vLLM's
  ``max_num_seqs``.
- the embedded trainer generates in chunks of ``rollout.max_batch_sequences`` (HF ``generate``)
  or with vLLM; ``trainer.sizing.estimate`` sizes the whole process with the chunk of the
  step's batch against this machine's (or ``megatron.device_memory_gb``'s) memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_DEVICE_GB", "EngineFit", "RecipeFacts", "read_recipe"]

DEFAULT_DEVICE_GB = 80.0  # one 80 GB GPU (A100 / H100) unless --device-gb says otherwise
VLLM_MAX_NUM_SEQS = 256  # vLLM's default when a recipe leaves max_num_seqs unset
GB = 1e9


@dataclass(frozen=True)
class EngineFit:
    """How the rollout takes ``sequences`` completions in one step.

    need_gb: memory to generate them all at once (KV cache per engine replica; the whole process
    for the embedded trainer); pool_gb: what is there; concurrent: sequences one replica decodes at
    a time; waves: rounds of decoding a replica needs (1 = the whole batch at once); how: where
    the numbers come from."""

    sequences: int
    need_gb: float
    pool_gb: float
    concurrent: int
    waves: int
    how: str

    @property
    def fits(self) -> bool:
        return self.waves == 1 and self.need_gb <= self.pool_gb


@dataclass(frozen=True)
class RecipeFacts:
    """A recipe's batch (``prompts`` per step, ``group_size`` completions each), its host, and
    ``fit(sequences)`` for its rollout engine (None when the model's size is unknown: ``why``)."""

    host: str
    path: str
    prompts: int
    group_size: int
    sizer: Any = None
    why: str = ""

    def fit(self, sequences: int) -> EngineFit | None:
        return self.sizer(sequences) if self.sizer is not None else None


def _local_hf_config(model: str):
    """The HF config of a local model directory, or None (a hub name cannot be read offline)."""
    if not model or not (Path(model) / "config.json").is_file():
        return None
    import transformers

    return transformers.AutoConfig.from_pretrained(model)


def _vllm_sizer(hf_config, *, replicas: int, tp: int, utilization: float, max_num_seqs: int, seq_len: int,
                device_gb: float, where: str):
    from ..megatron.memory import hf_parameters, kv_cache_bytes

    weights = hf_parameters(hf_config) * 2 / tp  # bf16 weights of one replica's shard
    pool = max(0.0, utilization * device_gb * GB - weights)
    per_seq = kv_cache_bytes(hf_config, 1, seq_len, "bfloat16") / tp

    def fit(sequences: int) -> EngineFit:
        per_replica = math.ceil(sequences / replicas)
        concurrent = min(max_num_seqs, int(pool // per_seq)) if per_seq > 0 else max_num_seqs
        return EngineFit(sequences, per_replica * per_seq / GB, pool / GB, min(concurrent, per_replica),
                         math.ceil(per_replica / concurrent) if concurrent else 0,
                         f"vLLM, {replicas} replica(s) x TP {tp}: KV of {per_replica} sequences x {seq_len} tokens "
                         f"({per_seq / 2**20:.2f} MiB each) vs {utilization:g} x {device_gb:g} GB less the weights; "
                         f"max_num_seqs {max_num_seqs} ({where}; a GPU of {device_gb:g} GB, --device-gb)")
    return fit


def _verl(path: str, overrides: list[str], device_gb: float) -> RecipeFacts:
    from ..bench.verl_study import compose

    cfg = compose(path, overrides)
    ro = cfg.actor_rollout_ref.rollout
    b, g = int(cfg.data.train_batch_size), int(ro.n)
    if str(ro.name) not in ("vllm", "sglang"):
        return RecipeFacts("verl", path, b, g, why=f"actor_rollout_ref.rollout.name={ro.name}: only a vLLM or SGLang "
                                                       "rollout is sized")
    model = str(cfg.actor_rollout_ref.model.path)
    hf = _local_hf_config(model)
    if hf is None:
        return RecipeFacts("verl", path, b, g, why=f"the model {model} is not a local directory with a config.json")
    tp = int(ro.get("tensor_model_parallel_size", 1) or 1)
    world = int(cfg.trainer.n_gpus_per_node) * int(cfg.trainer.nnodes)
    seq = int(cfg.data.max_prompt_length) + int(cfg.data.max_response_length)
    sizer = _vllm_sizer(hf, replicas=max(1, world // tp), tp=tp,
                        utilization=float(ro.get("gpu_memory_utilization", 0.5)),
                        max_num_seqs=int(ro.get("max_num_seqs", VLLM_MAX_NUM_SEQS) or VLLM_MAX_NUM_SEQS),
                        seq_len=seq, device_gb=device_gb, where="actor_rollout_ref.rollout.*")
    return RecipeFacts("verl", path, b, g, sizer)


def _openrlhf(path: str, data: dict, device_gb: float) -> RecipeFacts:
    import os

    flags = data.get("openrlhf") or {}
    b, g = int(flags.get("rollout.batch_size", 1024)), int(flags.get("rollout.n_samples_per_prompt", 1))
    model = str(flags.get("actor.model_name_or_path", ""))
    cpu = data.get("cpu") or {}
    model = model.replace("${CPPO_CPU_MODEL_DIR}", str(cpu.get("model_dir", "")))
    hf = _local_hf_config(os.path.expandvars(model))
    if hf is None:
        return RecipeFacts("openrlhf", path, b, g, why=f"the model {model} is not a local directory with a config.json")
    tp = int(flags.get("vllm.tensor_parallel_size", 1) or 1)
    sizer = _vllm_sizer(hf, replicas=max(1, int(flags.get("vllm.num_engines", 1) or 1)), tp=tp,
                        utilization=float(flags.get("vllm.gpu_memory_utilization", 0.95)),
                        max_num_seqs=VLLM_MAX_NUM_SEQS, seq_len=int(flags.get("data.max_len", 2048)),
                        device_gb=device_gb, where="openrlhf: vllm.*, data.max_len")
    return RecipeFacts("openrlhf", path, b, g, sizer)


def _trainer(path: str, overrides: list[str]) -> RecipeFacts:
    from ..trainer.config import load_recipe, replace_recipe
    from ..trainer.sizing import HEADROOM, estimate, machine_memory_gb

    recipe = load_recipe(path, overrides)
    g = recipe.rollout.group_size
    b = recipe.train.capacity // g
    chunk = recipe.rollout.max_batch_sequences
    limit, where = machine_memory_gb(recipe, 1)

    def fit(sequences: int) -> EngineFit:
        per_call = min(chunk, sequences)
        report = estimate(replace_recipe(recipe, **{"rollout.max_batch_sequences": per_call}), 1)
        return EngineFit(sequences, report.largest.total / GB, HEADROOM * limit, per_call,
                         math.ceil(sequences / per_call),
                         f"trainer.sizing.estimate with {per_call} sequences per generate call "
                         f"(rollout.max_batch_sequences {chunk}) vs {HEADROOM:.0%} of {limit:.1f} GB ({where})")
    return RecipeFacts("trainer", path, b, g, fit)


def read_recipe(path: str, overrides: list[str] | None = None, device_gb: float = DEFAULT_DEVICE_GB) -> RecipeFacts:
    """The facts of a veRL, OpenRLHF or embedded-trainer recipe (told by its folder or content).
    Raises FileNotFoundError for a missing recipe, ValueError for one that does not load."""
    from ..recipes import resolve

    if not (isinstance(device_gb, (int, float)) and device_gb > 0):
        raise ValueError(f"--device-gb must be > 0, got {device_gb!r}")
    file = resolve(path)
    import yaml

    data = yaml.safe_load(file.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"recipe {file} is not a YAML mapping")
    if "openrlhf" in data:
        return _openrlhf(str(file), data, device_gb)
    if file.parent.name == "verl" or "defaults" in data or "actor_rollout_ref" in data:
        return _verl(str(file), list(overrides or []), device_gb)
    return _trainer(str(file), list(overrides or []))
