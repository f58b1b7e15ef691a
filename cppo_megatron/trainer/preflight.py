"""Check what a recipe points at before any work starts.

``load_recipe`` checks the keys; ``check_inputs`` checks the things behind them — the
model directory or GGUF file, the data files, ``init_checkpoint``, ``--resume``, the
device, the rollout engine — and whether the data fits the model: every prompt plus its
reference answer within the model's positions, every reference answer within
``rollout.max_new_tokens``. ``cppo-megatron train`` runs it before the warm-up, and before
torchrun for ``--nproc`` runs, so a mistake ends in one line and exit status 2 instead
of a traceback minutes later (or a run that trains at 0 accuracy because no answer fits).

    inputs = check_inputs(load_recipe("recipes/tiny_cpu.yaml"))
    Trainer(recipe, task=inputs.task).run()
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..tasks import Task, build_task
from .config import Recipe, RecipeError

# A data set where at least this share of rows cannot fit is an error (the run could not
# learn them); below it, the rows are counted in a warning.
FIT_ERROR_FRACTION = 0.5

_WEIGHT_FILES = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")
# transformers 5 builds an empty tokenizer (one token) from a directory without these
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


@dataclass(frozen=True)
class DataFit:
    """How the task's rows fit the model, in tokens of the run's tokenizer.

    ``rows``: train + test rows checked. ``too_long_for_positions``: rows whose prompt +
    reference answer + EOS exceed ``max_position`` (0 when the model's limit is unknown).
    ``too_long_for_rollout``: rows whose reference answer exceeds ``max_new_tokens``.
    ``longest_sequence`` / ``longest_answer``: the values the two keys would need.
    """

    rows: int
    max_position: int | None
    max_new_tokens: int
    too_long_for_positions: int
    too_long_for_rollout: int
    longest_sequence: int
    longest_answer: int


@dataclass(frozen=True)
class CheckedInputs:
    """What ``check_inputs`` built and found: the task (hand it to ``Trainer(task=...)`` to
    skip loading it twice), the tokenizer, the data fit and one-line warnings."""

    task: Task
    tokenizer: Any
    fit: DataFit
    warnings: tuple[str, ...]


def check_inputs(recipe: Recipe, *, resume: bool = False) -> CheckedInputs:
    """Check the model, data, checkpoint and device the recipe names; RecipeError otherwise.

    ``resume`` also checks that ``out_dir`` holds a checkpoint (``backend: hf``; the
    megatron launcher checks its own). Loads the data set and the tokenizer, not the model
    weights.
    """
    _check_device(recipe.device)
    _check_engine(recipe)
    max_position = _check_model(recipe)
    if recipe.init_checkpoint and not Path(recipe.init_checkpoint).is_file():
        raise RecipeError(f"init_checkpoint {recipe.init_checkpoint} does not exist; give a .pt file written by a "
                          "run (out_dir/warmup.pt or out_dir/checkpoints/step_*.pt) or remove the key")
    if resume:
        from .checkpoint import checkpoints

        if not checkpoints(Path(recipe.out_dir)):
            raise RecipeError(f"--resume: no checkpoint under {Path(recipe.out_dir) / 'checkpoints'}; "
                              "check out_dir, or drop --resume to start a new run")
    task = _build_task(recipe)
    tok = _build_tokenizer(recipe, task)
    fit = measure_fit(task, tok, prompt_template=recipe.task.prompt_template, max_position=max_position,
                      max_new_tokens=recipe.rollout.max_new_tokens)
    problem = describe_fit(fit, task.name, position_key=_position_key(recipe))
    notes: list[str] = []
    if problem is not None:
        worst = max(fit.too_long_for_positions, fit.too_long_for_rollout)
        if worst >= FIT_ERROR_FRACTION * fit.rows:
            raise RecipeError(problem)
        notes.append(f"warning: {problem}")
    return CheckedInputs(task=task, tokenizer=tok, fit=fit, warnings=tuple(notes))


def measure_fit(task: Task, tok: Any, *, prompt_template: str, max_position: int | None,
                max_new_tokens: int) -> DataFit:
    """Token lengths of every train and test row against the two limits.

    A row's sequence is ``tok.prompt_ids(prompt_template.format(question=...))`` followed
    by ``tok.encode(task.sft_target(row))`` and EOS — what the warm-up trains on; its
    answer is that target without EOS, what a rollout must write within max_new_tokens.
    """
    problems: Sequence = list(task.train) + list(task.test)
    too_pos = too_new = 0
    longest_seq = longest_answer = 0
    for i, p in enumerate(problems):
        try:
            prompt = prompt_template.format(question=p.question)
        except (KeyError, IndexError, ValueError) as exc:
            raise RecipeError(f"task.prompt_template {prompt_template!r} cannot be filled ({exc!r}); "
                              "use {question} where the problem goes and double other braces") from exc
        try:
            n_prompt = len(tok.prompt_ids(prompt))
            n_answer = len(tok.encode(task.sft_target(p)))
        except ValueError as exc:  # a character tokenizer that lacks a character
            raise RecipeError(f"task {task.name} row {i}: {exc}; change task.prompt_template or use a model "
                              "with a byte-level tokenizer") from exc
        seq = n_prompt + n_answer + 1
        longest_seq = max(longest_seq, seq)
        longest_answer = max(longest_answer, n_answer)
        too_pos += max_position is not None and seq > max_position
        too_new += n_answer > max_new_tokens
    return DataFit(rows=len(problems), max_position=max_position, max_new_tokens=max_new_tokens,
                   too_long_for_positions=int(too_pos), too_long_for_rollout=int(too_new),
                   longest_sequence=longest_seq, longest_answer=longest_answer)


def describe_fit(fit: DataFit, task_name: str, *, position_key: str) -> str | None:
    """One line naming the counts and the keys to change; None when every row fits."""
    parts, fixes = [], []
    if fit.too_long_for_positions:
        parts.append(f"{fit.too_long_for_positions} of {fit.rows} rows need more than {position_key}="
                     f"{fit.max_position} positions for prompt + answer (longest {fit.longest_sequence})")
        fixes.append(f"raise {position_key} to >= {fit.longest_sequence}" if position_key == "model.max_position"
                     else f"shorten the prompts ({position_key} is the model's own limit)")
    if fit.too_long_for_rollout:
        parts.append(f"{fit.too_long_for_rollout} of {fit.rows} reference answers are longer than "
                     f"rollout.max_new_tokens={fit.max_new_tokens} tokens (longest {fit.longest_answer})")
        fixes.append(f"raise rollout.max_new_tokens to >= {fit.longest_answer}")
    if not parts:
        return None
    return (f"task {task_name} does not fit the model: {'; '.join(parts)}; "
            f"{' and '.join(fixes)}, or use shorter data")


# ---------------------------------------------------------------------- the pieces
def _check_device(device: str) -> None:
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise RecipeError("device=cuda but torch sees no CUDA device; use device=cpu or device=auto")


def _check_engine(recipe: Recipe) -> None:
    if recipe.rollout.engine == "vllm":
        from ..rollout.vllm import INSTALL_HINT, vllm_distribution

        if vllm_distribution() is None:
            raise RecipeError(f"rollout.engine=vllm: {INSTALL_HINT}")


def _check_model(recipe: Recipe) -> int | None:
    """The model's position limit (None when it is not known without loading the weights)."""
    m = recipe.model
    if m.source == "config":
        return m.max_position
    assert m.path is not None  # validate_recipe: hf_dir and gguf need model.path
    if m.source == "gguf":
        from .models import resolve_gguf

        try:
            resolve_gguf(m.path)
        except FileNotFoundError as exc:
            raise RecipeError(f"{exc}; set model.path to a .gguf file (or smollm2)") from exc
        return None  # the limit sits among the GGUF metadata; reading it costs seconds
    path = Path(m.path)
    layout = ("a directory saved by save_pretrained (config.json, *.safetensors, tokenizer files) "
              "with model.source=hf_dir")
    if not path.is_dir():
        what = "is a file" if path.exists() else "does not exist"
        hint = "; for a .gguf file use model.source=gguf" if path.suffix == ".gguf" else ""
        raise RecipeError(f"model.path {m.path} {what}; give {layout}{hint}")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise RecipeError(f"model.path {m.path} has no config.json, so it is not an HF model directory; give {layout}")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise RecipeError(f"model.path {m.path}: config.json is not valid JSON ({exc}); re-save the model") from exc
    if not isinstance(config, dict) or "model_type" not in config:
        raise RecipeError(f"model.path {m.path}: config.json has no model_type, so transformers cannot tell the "
                          f"architecture; give {layout}")
    if not any(any(path.glob(pattern)) for pattern in _WEIGHT_FILES):
        raise RecipeError(f"model.path {m.path} has no weight files (*.safetensors or *.bin); give {layout}")
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        raise RecipeError(f"model.path {m.path} has no tokenizer files ({', '.join(_TOKENIZER_FILES)}); save the "
                          "tokenizer into it too (tokenizer.save_pretrained(model.path))")
    limit = config.get("max_position_embeddings")
    return int(limit) if isinstance(limit, int) else None


def _position_key(recipe: Recipe) -> str:
    return "model.max_position" if recipe.model.source == "config" else "max_position_embeddings"


def _build_task(recipe: Recipe) -> Task:
    t = recipe.task
    for key in ("path", "test_path"):
        value = getattr(t, key)
        if value and t.name in ("gsm8k", "math") and not Path(value).is_file():
            raise RecipeError(f"task.{key} {value} does not exist; give a .jsonl or .parquet file "
                              f"in {t.name.upper()} format (docs/trainer.md, Bring your own)")
    try:
        return build_task(t)
    except (ValueError, FileNotFoundError, ImportError) as exc:
        raise RecipeError(f"task.name={t.name}: {exc}") from exc


def _build_tokenizer(recipe: Recipe, task: Task) -> Any:
    from .models import build_tokenizer

    try:
        return build_tokenizer(recipe.model, task.alphabet)
    except (OSError, ValueError) as exc:  # transformers raises OSError for unreadable tokenizer files
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RecipeError(f"model.path {recipe.model.path}: cannot load its tokenizer ({first}); "
                          "the directory needs tokenizer files (tokenizer.json or tokenizer_config.json)") from exc
