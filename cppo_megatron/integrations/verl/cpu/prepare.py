"""What a CPU recipe needs before veRL starts: the start model and the data, built once.

A recipe's ``cppo_cpu`` group (not a veRL key; veRL ignores it) names them:

    cppo_cpu:
      warmup_recipe: tiny_cpu.yaml      # an embedded-trainer recipe (relative to recipes/)
      model_dir: runs/verl_tiny/model   # HF model exported from that recipe's warm-up
      data_dir: runs/verl_tiny/data     # train.parquet / test.parquet of the recipe's task
      eval_problems: 200                # rows of test.parquet
      run_dir: runs/verl_tiny/NAME      # metrics.jsonl (veRL's own metrics, every step)
      vocab_multiple: 8                 # optional: pad the exported vocabulary (Megatron TP; cpu/vocab.py)

``prepare_cpu_run(config)`` makes the paths absolute (Ray workers do not share the driver's
working directory), runs the warm-up and the export when ``model_dir`` has no model, writes
the parquet files when missing, and points the process environment at the CPU platform.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ..audit import ENV as AUDIT_ENV
from ..runconfig import export_plugin_to_workers

__all__ = ["CPU_ENV", "CpuRun", "build_start_model", "is_cpu_run", "prepare_cpu_run", "write_data"]

RECIPES_DIR = Path(__file__).resolve().parents[4] / "recipes"
# set in the driver and in every Ray process of a CPU run
CPU_ENV = {"VERL_PLATFORM": "cpu", "RAY_AUTH_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
GROUP = "cppo_cpu"


@dataclass(frozen=True)
class CpuRun:
    """The prepared paths of a CPU run and what was built now (False: reused)."""

    model_dir: Path
    data_dir: Path
    run_dir: Path
    built_model: bool
    wrote_data: bool

    def describe(self) -> str:
        return (f"cpu mode: model {self.model_dir} ({'exported now' if self.built_model else 'reused'}), "
                f"data {self.data_dir} ({'written now' if self.wrote_data else 'reused'}), "
                f"metrics {self.run_dir / 'metrics.jsonl'}")


def is_cpu_run(config: Any) -> bool:
    """``trainer.device == "cpu"`` in a veRL config."""
    trainer = config.get("trainer", None) if hasattr(config, "get") else None
    return trainer is not None and str(trainer.get("device", "")) == "cpu"


def _warmup_recipe(name: str) -> Path:
    p = Path(name)
    for cand in (p, RECIPES_DIR / p):
        if cand.is_file():
            return cand.resolve()
    raise FileNotFoundError(f"{GROUP}.warmup_recipe={name!r}: no such file here or under {RECIPES_DIR}")


def build_start_model(warmup_recipe: str | Path, model_dir: str | Path, *, overrides: tuple[str, ...] = ()):
    """Run ``warmup_recipe``'s supervised warm-up (no RL step) and export the result as an HF
    model directory; returns the ``ExportResult``. The warm-up run lives beside the model
    (``MODEL_DIR/../warmup``) with its report and ``warmup.pt``."""
    from ....trainer.export import export_warmup

    return export_warmup(_warmup_recipe(str(warmup_recipe)), model_dir, overrides=overrides)


def write_data(warmup_recipe: str | Path, data_dir: str | Path, eval_problems: Optional[int]):
    """The warm-up recipe's task as veRL parquet (same problems, same prompt template)."""
    from ....tasks import build_task
    from ....trainer.config import load_recipe
    from ..data import write_task_parquet

    recipe = load_recipe(_warmup_recipe(str(warmup_recipe)))
    return write_task_parquet(build_task(recipe.task), data_dir, prompt_template=recipe.task.prompt_template,
                              test_rows=eval_problems)


def prepare_cpu_run(config: Any) -> Optional[CpuRun]:
    """Prepare a CPU run in place (see the module docstring); None when ``trainer.device`` is
    not ``cpu``. Also sets ``CPU_ENV`` in this process and in ``ray_kwargs`` for Ray's."""
    from omegaconf import open_dict

    if not is_cpu_run(config):
        return None
    group = config.get(GROUP, None)
    if group is None:
        raise ValueError(
            f"trainer.device=cpu needs a {GROUP} group (warmup_recipe, model_dir, data_dir, run_dir): "
            "start from recipes/verl/tiny_cpu_cppo.yaml"
        )
    for key in ("warmup_recipe", "model_dir", "data_dir", "run_dir"):
        if not group.get(key):
            raise ValueError(f"{GROUP}.{key} is not set; see recipes/verl/tiny_cpu_cppo.yaml")
    with open_dict(config):
        for key in ("model_dir", "data_dir", "run_dir"):
            group[key] = str(Path(group[key]).expanduser().resolve())
    model_dir, data_dir, run_dir = (Path(group[k]) for k in ("model_dir", "data_dir", "run_dir"))
    built = not (model_dir / "config.json").is_file()
    if built:
        print(f"cpu mode: no model in {model_dir}; running the warm-up of {group.warmup_recipe} and exporting it")
        build_start_model(group.warmup_recipe, model_dir)
        if group.get("vocab_multiple"):
            from .vocab import pad_vocab

            pad_vocab(model_dir, int(group.vocab_multiple))
    wrote = not ((data_dir / "train.parquet").is_file() and (data_dir / "test.parquet").is_file())
    if wrote:
        write_data(group.warmup_recipe, data_dir, group.get("eval_problems"))
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {**CPU_ENV, "VERL_FILE_LOGGER_PATH": str(run_dir / "metrics.jsonl")}
    if os.environ.get(AUDIT_ENV):
        env[AUDIT_ENV] = str(Path(os.environ[AUDIT_ENV]).resolve())
    os.environ.update(env)
    export_plugin_to_workers(config, env)  # the Ray runtime env every Ray process starts with
    return CpuRun(model_dir, data_dir, run_dir, built, wrote)

