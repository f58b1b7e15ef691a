"""What a CPU recipe needs before veRL starts: the start model and the data, built once.

A recipe's ``cppo_cpu`` group (not a veRL key; veRL ignores it) names them:

    cppo_cpu:
      warmup_recipe: tiny_cpu.yaml      # an embedded-trainer recipe (relative to recipes/)
      model_dir: runs/verl_tiny/model   # HF model exported from that recipe's warm-up
      data_dir: runs/verl_tiny/data     # train.parquet / test.parquet of the recipe's task
      eval_problems: 200                # rows of test.parquet
      run_dir: runs/verl_tiny/NAME      # metrics.jsonl (veRL's own metrics, every step)
      warmup_overrides: [...]           # the warm-up recipe's settings changed for this start model
      vocab_multiple: 8                 # optional: pad the exported vocabulary (Megatron TP; cpu/vocab.py)
      unpadded_model_dir: runs/verl_tiny/model   # optional, with vocab_multiple: the unpadded export of
                                        # the same warm-up, copied and padded instead of a second warm-up

``prepare_cpu_run(config)`` makes the paths absolute (Ray workers do not share the driver's
working directory), runs the warm-up and the export when ``model_dir`` has no model (with
``vocab_multiple`` and ``unpadded_model_dir``: copies that unpadded export of the same warm-up —
built there first when missing, so the FSDP recipes reuse it too — and pads the copy), writes
the parquet files when missing, and points the process environment at the CPU platform.
Each part is a timed phase (``phases.Phases``). The warm-up runs with the torch threads that
``phases.choose_threads`` picks from the cores and load at that moment, unless
``warmup_overrides`` sets ``threads``. What the warm-up reached is kept beside the model
(``cppo_start_model.json``) and printed when a later run reuses it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ....recipes import root as recipes_root
from ... import vllm_shm
from ...cpu_run import CpuRun
from ..diagnostics import AUDIT_ENV, CLOCK_ENV, KEYS_ENV
from ..runconfig import export_plugin_to_workers
from .phases import Phases, choose_threads, machine_load
from .vllm import CPU_ENV as VLLM_CPU_ENV
from .vllm import is_vllm_rollout
from .vllm import prepare_config as prepare_vllm

__all__ = ["CPU_ENV", "CpuRun", "ray_address", "build_start_model", "ensure_inputs", "is_cpu_run", "prepare_cpu_run",
           "prepare_disaggregated_sync",
           "start_model_info", "write_data"]

RECIPES_DIR = recipes_root()  # the clone's recipes/, or the copy an installed wheel carries
# set in the driver and in every Ray process of a CPU run
CPU_ENV = {"VERL_PLATFORM": "cpu", "RAY_AUTH_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
GROUP = "cppo_cpu"
START_MODEL_INFO = "cppo_start_model.json"  # what the warm-up reached, beside the exported model
SHM_REGISTRY = "shm_segments.txt"  # in the run dir: what vLLM's processes recorded (integrations/vllm_shm.py)


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
    (``MODEL_DIR/../warmup``) with its report and ``warmup.pt``; ``MODEL_DIR/cppo_start_model.json``
    records what it reached (held-out accuracy, SFT steps, seconds, threads).

    ``overrides`` are the warm-up recipe's ``key=value`` settings; without ``threads=N`` the
    threads come from ``choose_threads()`` (cores free right now)."""
    import time

    from ....trainer.export import export_warmup

    model_dir = Path(model_dir)
    overrides = tuple(str(o) for o in overrides)
    if not any(o.split("=", 1)[0].strip() == "threads" for o in overrides):
        overrides = (f"threads={choose_threads()}", *overrides)
    overrides = ("log.progress=false", "log.tensorboard=false", *overrides)
    t0 = time.perf_counter()
    result = export_warmup(_warmup_recipe(str(warmup_recipe)), model_dir, overrides=overrides)
    seconds = time.perf_counter() - t0
    run_dir = model_dir.parent / "warmup"
    last = _last_warmup_record(run_dir / "metrics.jsonl")
    threads = next(int(o.split("=", 1)[1]) for o in overrides if o.split("=", 1)[0].strip() == "threads")
    info = {"accuracy": last.get("warmup/accuracy"), "eval_problems": int(last.get("warmup/problems", 0)),
            "sft_steps": int(last.get("warmup/step", 0)), "seconds": round(seconds, 1), "threads": threads,
            "warmup_recipe": str(warmup_recipe), "overrides": list(overrides)}
    (model_dir / START_MODEL_INFO).write_text(json.dumps(info, indent=2) + "\n")
    return result


def _last_warmup_record(path: Path) -> dict:
    """The last ``warmup/*`` evaluation the warm-up logged ({} when none)."""
    last: dict = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            rec = json.loads(line) if line.strip() else {}
            if rec.get("kind") == "warmup" and "warmup/accuracy" in rec:
                last = rec
    return last


def start_model_info(model_dir: str | Path) -> dict | None:
    """``cppo_start_model.json`` of an exported start model (None when it has none)."""
    path = Path(model_dir) / START_MODEL_INFO
    return json.loads(path.read_text()) if path.is_file() else None


def write_data(warmup_recipe: str | Path, data_dir: str | Path, eval_problems: int | None):
    """The warm-up recipe's task as veRL parquet (same problems, same prompt template)."""
    from ....tasks import build_task
    from ....trainer.config import load_recipe
    from ..data import write_task_parquet

    recipe = load_recipe(_warmup_recipe(str(warmup_recipe)))
    return write_task_parquet(build_task(recipe.task), data_dir, prompt_template=recipe.task.prompt_template,
                              test_rows=eval_problems)


def _warmup_settings(recipe: str, overrides) -> tuple[str, tuple[str, ...]]:
    """What decides a start model: the warm-up recipe's file name and its overrides, less the
    ones that only change how it runs (torch threads, progress bars, TensorBoard)."""
    keep = tuple(str(o) for o in overrides or () if not str(o).startswith(("threads=", "log.")))
    return Path(str(recipe)).name, keep


def _build(group: Any, model_dir: Path, phases: Phases, *, pad: bool) -> None:
    """The warm-up of ``group.warmup_recipe`` exported to ``model_dir`` as a timed phase (and
    its vocabulary padded to ``group.vocab_multiple`` when ``pad``)."""
    overrides = [str(o) for o in (group.get("warmup_overrides", None) or [])]
    threads = next((o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0].strip() == "threads"), None)
    if threads is None:
        threads = str(choose_threads())
        overrides.insert(0, f"threads={threads}")
    cores, load = machine_load()
    sized = [o for o in overrides if not o.startswith("threads=")]
    what = (f"building the start model in {model_dir} (supervised warm-up of {group.warmup_recipe}"
            f"{' with ' + ' '.join(sized) if sized else ''}, "
            f"{threads} torch thread(s): {cores} usable cores, load {load:.1f})")
    with phases.phase("model", what, "building the start model") as note:
        build_start_model(group.warmup_recipe, model_dir, overrides=tuple(overrides))
        if pad:
            from .vocab import pad_vocab

            pad_vocab(model_dir, int(group.vocab_multiple))
        info = start_model_info(model_dir) or {}
        if info.get("accuracy") is not None:
            note["result"] = (f"held-out accuracy {info['accuracy']:.3f} on {info['eval_problems']} problems "
                              f"after {info['sft_steps']} SFT steps")


def _reusable(group: Any, source: Path) -> str:
    """Why ``source`` (an exported start model) cannot stand in for ``group``'s warm-up; "" when
    it can: it records the same warm-up recipe and overrides (``cppo_start_model.json``)."""
    if not (source / "config.json").is_file():
        return f"{source} has no model"
    info = start_model_info(source)
    if info is None:
        return f"{source} records no warm-up ({START_MODEL_INFO} missing)"
    have = _warmup_settings(info.get("warmup_recipe", ""), info.get("overrides", ()))
    want = _warmup_settings(group.warmup_recipe, group.get("warmup_overrides", None) or ())
    if have != want:
        return f"{source} was warmed up with {have[0]} {list(have[1])}, this recipe asks for {want[0]} {list(want[1])}"
    return ""


def ensure_inputs(group: Any, model_dir: Path, data_dir: Path, phases: Phases) -> tuple[bool, bool]:
    """Build the start model (``group.warmup_recipe`` + ``group.warmup_overrides``) when
    ``model_dir`` has none and write the parquet data when ``data_dir`` lacks it, each as a
    timed phase; returns (made the model now, wrote the data).

    With ``vocab_multiple`` and ``unpadded_model_dir`` the padded model is a copy of that
    unpadded export of the same warm-up (built there first when missing, so the unpadded
    recipes reuse it too), padded: one warm-up serves both. A model there from another warm-up
    is left alone and this one is built on its own (the line says why)."""
    import shutil

    built = not (model_dir / "config.json").is_file()
    source = group.get("unpadded_model_dir", None) if group.get("vocab_multiple") else None
    if built and source:
        source = Path(str(source)).expanduser().resolve()
        built_source = not (source / "config.json").is_file()
        if built_source:
            _build(group, source, phases, pad=False)
        why = _reusable(group, source)
        if why:
            phases.say(f"not reusing the unpadded start model: {why}")
            _build(group, model_dir, phases, pad=True)
        else:
            from .vocab import pad_vocab

            what = (f"copying the start model {source} to {model_dir} and padding its vocabulary to a "
                    f"multiple of {int(group.vocab_multiple)}")
            before = phases.durations["model"] if built_source else 0.0  # the warm-up just run counts too
            with phases.phase("model", what, "copying the start model") as note:
                if model_dir.exists():
                    shutil.rmtree(model_dir)
                shutil.copytree(source, model_dir)
                rows = pad_vocab(model_dir, int(group.vocab_multiple))
                info = start_model_info(model_dir) or {}
                acc = info.get("accuracy")
                note["result"] = (f"{rows} vocabulary rows"
                                  + (f", held-out accuracy {acc:.3f}" if isinstance(acc, (int, float)) else ""))
            phases.durations["model"] += before
    elif built:
        _build(group, model_dir, phases, pad=bool(group.get("vocab_multiple")))
    wrote = not ((data_dir / "train.parquet").is_file() and (data_dir / "test.parquet").is_file())
    if wrote:
        with phases.phase("data", f"writing the data as veRL parquet to {data_dir}", "writing the data") as note:
            d = write_data(group.warmup_recipe, data_dir, group.get("eval_problems"))
            note["result"] = f"{d.train_rows} train, {d.test_rows} test problems"
    return built, wrote


CPU_SYNC_BACKEND = "cpu"  # checkpoint_engine.BACKEND (not imported here: that module imports veRL's engine base)


def prepare_disaggregated_sync(config: Any) -> list[str]:
    """A CPU run in ``trainer.v1.trainer_mode=separate_async`` sends weights to its standalone rollout
    through a checkpoint engine; veRL's own need NCCL/cupy, HCCL, NIXL or Mooncake, and the mode
    refuses ``naive`` (``trainer_separate_async.py:68``). Select the CPU one (``checkpoint_engine.py``);
    returns one line per change."""
    from omegaconf import open_dict

    trainer = config.trainer
    mode = str(trainer.get("v1", {}).get("trainer_mode", "sync"))
    if not bool(trainer.get("use_v1", True)) or mode != "separate_async":
        return []
    rollout = config.actor_rollout_ref.rollout
    engine = rollout.get("checkpoint_engine", None) or {}
    have = str(engine.get("backend", "naive"))
    if have == CPU_SYNC_BACKEND:
        return []
    with open_dict(config):
        if rollout.get("checkpoint_engine", None) is None:
            rollout.checkpoint_engine = {}
        rollout.checkpoint_engine.backend = CPU_SYNC_BACKEND
    return [f"rollout.checkpoint_engine.backend={CPU_SYNC_BACKEND} (was {have}: separate_async sends weights across "
            "processes, and veRL's engines for that need GPUs; ours moves them over ZeroMQ)"]


# what only a Ray node started by this run can take (ray.init refuses them with an address)
NODE_RESOURCES = ("num_cpus", "num_gpus")


def ray_address(config: Any) -> str:
    """Which Ray a CPU run uses, made explicit in ``ray_kwargs.ray_init.address``:

    - none given: ``"local"``, a new single-node Ray of this run. Without it ``ray.init()``
      connects to whatever cluster ``ray start`` last left in ``/tmp/ray/ray_current_cluster``
      (or ``RAY_ADDRESS``; ``ray/_private/services.py:get_ray_address_from_environment``) — on a
      shared machine, someone else's;
    - a cluster's address (``ray start --head`` + ``ray start --address=...`` per node): its
      nodes declare their own CPUs and logical GPUs, so the single-node keys ``num_cpus`` /
      ``num_gpus`` are dropped (``ray.init`` refuses them when connecting).
    Returns the address used."""
    from omegaconf import open_dict

    with open_dict(config):
        ray_init = config.ray_kwargs.ray_init
        address = str(ray_init.get("address", None) or "local")
        ray_init.address = address
        if address != "local":
            for key in NODE_RESOURCES:
                if key in ray_init:
                    del ray_init[key]
    return address


def prepare_cpu_run(config: Any, phases: Phases | None = None) -> CpuRun | None:
    """Prepare a CPU run in place (see the module docstring); None when ``trainer.device`` is
    not ``cpu``. Also sets ``CPU_ENV`` in this process and in ``ray_kwargs`` for Ray's.
    ``phases`` times and prints the parts that do work (a new one when not given)."""
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
        for key in ("model_dir", "data_dir", "run_dir", "unpadded_model_dir"):
            if group.get(key):
                group[key] = str(Path(group[key]).expanduser().resolve())
    model_dir, data_dir, run_dir = (Path(group[k]) for k in ("model_dir", "data_dir", "run_dir"))
    for line in [*prepare_vllm(config), *prepare_disaggregated_sync(config)]:  # what vLLM / separate_async need
        print(f"cpu mode: {line}")
    built, wrote = ensure_inputs(group, model_dir, data_dir, phases or Phases())
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {**CPU_ENV, "VERL_FILE_LOGGER_PATH": str(run_dir / "metrics.jsonl")}
    if is_vllm_rollout(config):
        env.update({k: os.environ.get(k, v) for k, v in VLLM_CPU_ENV.items()})  # the user's own values win
        # where vLLM's processes record the shared memory they make; the launcher removes it at the end
        registry = Path(os.environ.get(vllm_shm.REGISTRY_ENV) or run_dir / SHM_REGISTRY)
        env[vllm_shm.REGISTRY_ENV] = str(registry.resolve())
    for name in (AUDIT_ENV, KEYS_ENV, CLOCK_ENV):  # audit records, key trace, wall-clock mode: every process
        if os.environ.get(name):
            env[name] = str(Path(os.environ[name]).resolve())
    os.environ.update(env)
    export_plugin_to_workers(config, env)  # the Ray runtime env every Ray process starts with
    ray_address(config)
    return CpuRun(model_dir, data_dir, run_dir, built, wrote, start_model=start_model_info(model_dir))

