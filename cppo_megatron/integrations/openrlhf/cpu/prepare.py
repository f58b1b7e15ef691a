"""What an OpenRLHF CPU run needs before OpenRLHF starts: the start model, the data, the
environment, and the flags the CPU mode requires.

A recipe's ``cpu:`` section switches the mode on and names the pieces (all optional):

    cpu:
      warmup_recipe: tiny_cpu.yaml          # embedded-trainer recipe (relative to recipes/)
      model_dir: runs/openrlhf_tiny/model   # HF model exported from that recipe's warm-up
      data_dir: runs/openrlhf_tiny/data     # train.jsonl / test.jsonl of its task
      run_dir: runs/openrlhf_tiny/NAME      # metrics.jsonl (+ OpenRLHF's checkpoints)
      eval_problems: 200                    # rows of test.jsonl
      eval_before_train: true               # one evaluation at step 0 (the "before")
      threads: 1                            # torch threads per process
      kv_cache_gb: 1                        # vLLM's CPU KV cache per engine
      num_gpus: 16                          # logical GPUs Ray offers (slots, not hardware)
      max_steps: 20                         # --data.max_samples = max_steps x the final
                                            # --rollout.batch_size (after allocation)

The openrlhf flags refer to the prepared paths as ``${CPPO_CPU_MODEL_DIR}``,
``${CPPO_CPU_DATA_DIR}`` and ``${CPPO_CPU_RUN_DIR}``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ....recipes import root as recipes_root
from ... import vllm_shm
from ...cpu_run import CpuRun
from . import worker_env

__all__ = ["CPU_FLAGS", "CpuRun", "FIELDS", "cache_dir", "max_steps_flags", "prepare", "required_flags", "write_jsonl"]

RECIPES_DIR = recipes_root()  # the clone's recipes/, or the copy an installed wheel carries
FIELDS = {
    "warmup_recipe": "tiny_cpu.yaml", "model_dir": "runs/openrlhf_tiny/model", "data_dir": "runs/openrlhf_tiny/data",
    "run_dir": "runs/openrlhf_tiny/run", "eval_problems": 200, "eval_before_train": False, "threads": 1,
    "kv_cache_gb": 1.0, "num_gpus": 16, "max_steps": None,
}
MAX_STEPS_ENV = "CPPO_CPU_MAX_STEPS"
SHM_REGISTRY = "shm_segments.txt"  # in the run dir: what vLLM's processes recorded (integrations/vllm_shm.py)
# flags every CPU run gets (after the recipe's: they win): attention without flash-attn; the
# weight sync over gloo (OpenRLHF's default is NCCL / CUDA IPC); reward/critic groups sized 1
# (their num_gpus_per_node default 8 would make Ray wait forever for logical GPUs)
CPU_FLAGS = (
    "--ds.attn_implementation", "sdpa",
    "--vllm.sync_backend", "gloo",
    "--reward.num_gpus_per_node", "1",
    "--critic.num_gpus_per_node", "1",
)  # fmt: skip
PATH_VARS = {"model_dir": "CPPO_CPU_MODEL_DIR", "data_dir": "CPPO_CPU_DATA_DIR", "run_dir": "CPPO_CPU_RUN_DIR"}


def cache_dir() -> Path:
    """Persistent cache of compiled DeepSpeed CPU ops (``$CPPO_CACHE_DIR`` or ~/.cache/cppo-megatron)."""
    root = os.environ.get("CPPO_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "cppo-megatron")
    return Path(root) / "torch_extensions"


def settings(section: Any) -> dict:
    """The ``cpu:`` section with defaults; unknown keys are refused by name."""
    if section is None or section is True:
        section = {}
    if not isinstance(section, dict):
        raise ValueError(f"recipe: 'cpu' must be a mapping of {sorted(FIELDS)}, got {section!r}")
    unknown = sorted(set(section) - set(FIELDS))
    if unknown:
        raise ValueError(f"recipe: unknown cpu field(s) {unknown}; known: {sorted(FIELDS)}")
    return {**FIELDS, **section}


def _warmup_recipe(name: str) -> Path:
    p = Path(name)
    for cand in (p, RECIPES_DIR / p):
        if cand.is_file():
            return cand.resolve()
    raise FileNotFoundError(f"cpu.warmup_recipe={name!r}: no such file here or under {RECIPES_DIR}")


def write_jsonl(warmup_recipe: str | Path, data_dir: str | Path, eval_problems: int | None) -> tuple[Path, Path]:
    """The warm-up recipe's task as OpenRLHF prompt files (``train.jsonl``, ``test.jsonl``).

    Each row carries the prompt under ``question`` and ``problem`` and the answer under
    ``answer`` and ``solution`` (the keys of the GSM8K and MATH recipes), plus ``datasource``.
    """
    from ....tasks import build_task
    from ....trainer.config import load_recipe

    recipe = load_recipe(_warmup_recipe(str(warmup_recipe)))
    task = build_task(recipe.task)
    out = Path(data_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for split, problems in (("train", list(task.train)), ("test", list(task.test)[: eval_problems or None])):
        path = out / f"{split}.jsonl"
        with open(path.with_suffix(".partial"), "w") as f:
            for p in problems:
                prompt = recipe.task.prompt_template.format(question=p.question)
                f.write(json.dumps({"question": prompt, "problem": prompt, "answer": str(p.answer),
                                    "solution": str(p.answer), "datasource": task.name}) + "\n")
        os.replace(path.with_suffix(".partial"), path)
        paths.append(path)
    return paths[0], paths[1]


def prepare(section: Any, *, build: bool = True) -> CpuRun:
    """Resolve the paths, build the start model and data when missing (``build``), and set the
    CPU environment in this process (``os.environ``; the launcher passes ``env`` to Ray)."""
    s = settings(section)
    paths = {k: Path(str(s[k])).expanduser().resolve() for k in PATH_VARS}
    model_dir, data_dir, run_dir = paths["model_dir"], paths["data_dir"], paths["run_dir"]
    built = wrote = False
    if build:
        if not (model_dir / "config.json").is_file():
            from ....trainer.export import export_warmup

            print(f"cpu mode: no model in {model_dir}; running the warm-up of {s['warmup_recipe']} and exporting it")
            export_warmup(_warmup_recipe(str(s["warmup_recipe"])), model_dir, overrides=(f"threads={s['threads']}",))
            built = True
        if not ((data_dir / "train.jsonl").is_file() and (data_dir / "test.jsonl").is_file()):
            write_jsonl(s["warmup_recipe"], data_dir, s["eval_problems"])
            wrote = True
        run_dir.mkdir(parents=True, exist_ok=True)
    env = worker_env(str(cache_dir()), kv_cache_gb=float(s["kv_cache_gb"]), threads=int(s["threads"]))
    env.update({var: str(paths[k]) for k, var in PATH_VARS.items()})
    from .. import metrics

    env[metrics.ENV] = str(run_dir / "metrics.jsonl")
    if s["eval_before_train"]:
        env[metrics.EVAL_BEFORE_ENV] = "1"
    if s["max_steps"] is not None:
        if not isinstance(s["max_steps"], int) or s["max_steps"] < 1:
            raise ValueError(f"recipe: cpu.max_steps must be an integer >= 1, got {s['max_steps']!r}")
        env[MAX_STEPS_ENV] = str(s["max_steps"])
    from ..diagnostics import AUDIT_ENV

    if os.environ.get(AUDIT_ENV):
        env[AUDIT_ENV] = str(Path(os.environ[AUDIT_ENV]).resolve())
    # where vLLM's processes record the shared memory they make; the launcher removes it at the end
    registry = Path(os.environ.get(vllm_shm.REGISTRY_ENV) or run_dir / SHM_REGISTRY)
    env[vllm_shm.REGISTRY_ENV] = str(registry.resolve())
    os.environ.update(env)
    return CpuRun(model_dir, data_dir, run_dir, built, wrote, env=env)


def required_flags(forwarded: list[str]) -> list[str]:
    """The CPU mode's flags after the run's own; refuses what cannot work on CPU. Also logs
    to TensorBoard in the run directory (which writes ``metrics.jsonl`` too) unless the run
    names its own ``--logger.tensorboard_dir``."""
    if "--vllm.sync_with_ray" in forwarded:
        raise ValueError(
            "--vllm.sync_with_ray cannot work in the OpenRLHF CPU mode: Ray's gloo collective group would reuse "
            "the actor's DeepSpeed process group; remove it (the CPU mode syncs weights over its own gloo group)"
        )
    if "--ds.packing_samples" in forwarded:
        raise ValueError("--ds.packing_samples needs flash-attn, which the OpenRLHF CPU mode does not have; remove it")
    logs = []
    if "--logger.tensorboard_dir" not in forwarded and os.environ.get(PATH_VARS["run_dir"]):
        logs = ["--logger.tensorboard_dir", os.path.join(os.environ[PATH_VARS["run_dir"]], "tensorboard")]
    return [*forwarded, *CPU_FLAGS, *logs]


def max_steps_flags(rollout_batch_size: int) -> list[str]:
    """``--data.max_samples`` for ``cpu.max_steps`` steps of ``rollout_batch_size`` prompts (the
    final, allocated count), or nothing when the recipe sets no ``max_steps``."""
    steps = os.environ.get(MAX_STEPS_ENV)
    if not steps:
        return []
    return ["--data.max_samples", str(int(steps) * int(rollout_batch_size))]
