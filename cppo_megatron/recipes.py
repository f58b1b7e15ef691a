"""The shipped recipes, by name: a clone's ``recipes/`` or the copy a wheel carries.

``recipes/`` stays at the top of the repository; a wheel carries a copy as package data
(``cppo_megatron/_recipes/``, made at build time by setup.py), so a pip user runs a recipe by
name where a clone user gives its path. Both work everywhere a command takes a recipe:

    cppo-megatron recipes                                   # one line per recipe
    cppo-megatron verl qwen2.5-7b-math-megatron-cppo --cppo-dry-run
    cppo-megatron verl recipes/verl/qwen2.5-7b-math-megatron-cppo.yaml --cppo-dry-run   # same file

    from cppo_megatron import recipes
    recipes.resolve("qwen2.5-7b-math-megatron-cppo", host="verl")   # -> Path of the YAML file
    recipes.catalogue()                                               # [RecipeInfo, ...]

A name is a file stem (``tiny_cpu``), optionally with its folder (``verl/tiny_cpu_cppo``), a
``.yaml`` suffix or a leading ``recipes/``. An existing file always wins over a name. Folders:
the top level holds the embedded trainer's recipes (``cppo-megatron train``), ``verl/`` veRL's,
``openrlhf/`` OpenRLHF's; each host command looks in its own folder first.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["HOSTS", "RecipeInfo", "arg_type", "catalogue", "describe", "resolve", "root"]

PACKAGED = Path(__file__).resolve().parent / "_recipes"
REPOSITORY = Path(__file__).resolve().parents[1] / "recipes"
# folder -> the command that runs its recipes ("" is the top level: the embedded trainer)
HOSTS = {"": "train", "verl": "verl", "openrlhf": "openrlhf"}
SUFFIXES = (".yaml", ".yml")


def root() -> Path:
    """The recipes directory in use: the wheel's packaged copy when this install has one, else
    the clone's ``recipes/`` (which may be missing in a bare install: ``resolve`` says so)."""
    return PACKAGED if PACKAGED.is_dir() else REPOSITORY


def _folder(host: str | None) -> str | None:
    if host is None:
        return None
    for folder, command in HOSTS.items():
        if host in (folder, command):
            return folder
    raise ValueError(f"host {host!r}: choose from {sorted(set(HOSTS.values()))}")


def resolve(arg: str | os.PathLike, host: str | None = None) -> Path:
    """The recipe (or override file, reward file) ``arg`` names: ``arg`` itself when it is a file,
    else the shipped file of that name: in ``host``'s folder (``train``: the top level, ``verl``,
    ``openrlhf``), in every folder when ``host`` is None, or where a qualified name
    (``verl/cpu_toy``) says. Raises FileNotFoundError saying what was looked for when none, or
    several folders, match."""
    path = Path(arg).expanduser()
    if path.is_file():
        return path
    text = Path(os.fspath(arg)).as_posix()
    if text.startswith("recipes/"):  # a clone's path, given where there is no clone
        text = text[len("recipes/"):]
    names = [text] if text.endswith((*SUFFIXES, ".py")) else [text + ".yaml", text + ".yml", text]
    base = root()
    folder = _folder(host)
    if "/" in text:  # qualified: verl/tiny_cpu_cppo
        order = [""]
    elif folder is None:  # any folder; more than one match is ambiguous
        order = list(HOSTS)
    else:  # the host's own folder only: `cppo-megatron verl tiny_cpu` is not the embedded recipe
        order = [folder]
    found: list[Path] = []
    for where in order:
        for name in names:
            cand = base / where / name if where else base / name
            if cand.is_file():
                found.append(cand)
                break
    if len(found) == 1:
        return found[0]
    if found:
        options = ", ".join(str(f.relative_to(base).with_suffix("")) for f in found)
        raise FileNotFoundError(f"recipe {os.fspath(arg)!r} is ambiguous: {options}; give the folder too")
    where = f"{base}" if base.is_dir() else "this install (it carries no recipes)"
    raise FileNotFoundError(f"recipe {os.fspath(arg)!r}: no such file, and no shipped recipe of that name in {where}; "
                            "`cppo-megatron recipes` lists them")


def arg_type(*hosts: str | None):
    """An argparse ``type=`` for a recipe argument: ``arg`` unchanged when it is a file, else the
    path of the shipped recipe it names (in ``hosts``' folders, tried in order), else ``arg``
    unchanged (the command's loader then reports the missing file as it always did)."""

    def convert(arg: str) -> str:
        if Path(arg).expanduser().is_file():
            return arg
        for host in hosts or (None,):
            try:
                return str(resolve(arg, host))
            except FileNotFoundError:
                continue
        return arg

    convert.__name__ = "recipe"
    return convert


@dataclass(frozen=True)
class RecipeInfo:
    """One shipped file: its name (``folder/stem``), the command that runs it, and what it trains
    on how many devices. ``kind`` is ``recipe`` or ``override`` (a ``--cpu`` file)."""

    name: str
    host: str
    kind: str
    model: str
    layout: str
    cluster: str
    path: Path

    def line(self, width: int = 36) -> str:
        return f"{self.name:<{width}} {self.host:<9} {self.model:<28} {self.layout:<34} {self.cluster}"


def _load(path: Path) -> dict:
    import yaml

    with open(path) as f:
        data = yaml.safe_load(f)
    return data if isinstance(data, dict) else {}


def _merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for key, value in top.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _verl_config(path: Path, depth: int = 0) -> tuple[dict, list[str]]:
    """A veRL recipe merged over the recipes it builds on (``defaults`` entries that are files
    beside it), and the names of the package configs it starts from (``cppo_ppo_trainer``, ...)."""
    data = _load(path)
    merged: dict = {}
    bases: list[str] = []
    for entry in data.get("defaults") or []:
        if not isinstance(entry, str) or entry == "_self_":
            continue
        sibling = path.parent / f"{entry}.yaml"
        if sibling.is_file() and depth < 8:
            parent, parent_bases = _verl_config(sibling, depth + 1)
            merged, bases = _merge(merged, parent), bases + parent_bases
        else:
            bases.append(entry)
    return _merge(merged, {k: v for k, v in data.items() if k not in ("defaults", "hydra")}), bases


def _get(data: dict, dotted: str, default: Any = None) -> Any:
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def _model_name(value: Any) -> str:
    text = str(value)
    if "cppo_cpu.model_dir" in text or "CPPO_CPU_MODEL_DIR" in text:
        return "tiny Qwen2 (warm-up export)"
    return text


def _describe_verl(path: Path, data: dict) -> RecipeInfo:
    name = path.stem
    bases: list[str] = []
    if "defaults" not in data and "hydra" not in data:  # an override file (--cpu)
        cfg, kind = data, "override"
    else:
        (cfg, bases), kind = _verl_config(path), "recipe"
    strategy = _get(cfg, "actor_rollout_ref.actor.strategy")
    if strategy is None:  # the package config it starts from decides (cppo_ppo_megatron_trainer)
        megatron = any("megatron" in b for b in bases) or _get(cfg, "actor_rollout_ref.actor.megatron") is not None
    else:
        megatron = "megatron" in str(strategy)
    nodes = int(_get(cfg, "trainer.nnodes", 1) or 1)
    gpus = int(_get(cfg, "trainer.n_gpus_per_node", 8 if kind == "recipe" else 1) or 1)
    world = nodes * gpus
    tp = int(_get(cfg, "actor_rollout_ref.actor.megatron.tensor_model_parallel_size", 1) or 1)
    pp = int(_get(cfg, "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size", 1) or 1)
    cp = int(_get(cfg, "actor_rollout_ref.actor.megatron.context_parallel_size", 1) or 1)
    if megatron:
        dp = world // (tp * pp * cp) if world % (tp * pp * cp) == 0 else "?"
        layout = f"Megatron TP{tp} x PP{pp}" + (f" x CP{cp}" if cp > 1 else "") + f" x DP{dp}"
    else:
        layout = f"{str(strategy or 'fsdp').upper()} DP{world}"
    rollout = _get(cfg, "actor_rollout_ref.rollout.name")
    if rollout:
        layout += f", {rollout} rollout"
    cpu = str(_get(cfg, "trainer.device", "")) == "cpu"
    cluster = f"CPU, {world} worker process{'es' if world > 1 else ''}" if cpu else \
        f"{nodes} node{'s' if nodes > 1 else ''} x {gpus} GPUs"
    model = _model_name(_get(cfg, "actor_rollout_ref.model.path", "-"))
    if kind == "override":
        layout = f"--cpu override: {layout}"
    return RecipeInfo(name, "verl", kind, model, layout, cluster, path)


def _describe_openrlhf(path: Path, data: dict) -> RecipeInfo:
    name = path.stem
    kind = "recipe" if "cppo" in data else "override"
    flags = data.get("openrlhf") or {}
    model = _model_name(flags.get("actor.model_name_or_path", "-"))
    zero = flags.get("ds.zero_stage")
    engines = int(flags.get("vllm.num_engines", 0) or 0)
    vtp = int(flags.get("vllm.tensor_parallel_size", 1) or 1)
    nodes = int(flags.get("actor.num_nodes", 1) or 1)
    gpus = int(flags.get("actor.num_gpus_per_node", 1) or 1)
    layout = (f"DeepSpeed ZeRO-{zero}" if zero is not None else "DeepSpeed") + f" x {nodes * gpus}"
    if engines:
        layout += f", vLLM {engines} x TP{vtp}"
    colocated = bool(flags.get("train.colocate_all_models") or flags.get("train.colocate_all"))
    total = nodes * gpus + (0 if colocated else engines * vtp)
    cluster = f"CPU, {total} logical GPUs" if data.get("cpu") else f"{total} GPUs"
    if kind == "override":
        layout, cluster = "--cpu override: the recipe's layout", "CPU"
    return RecipeInfo(name, "openrlhf", kind, model, layout, cluster, path)


def _describe_train(path: Path, data: dict) -> RecipeInfo:
    model = data.get("model") or {}
    source = model.get("source", "config")
    if source == "config":
        what = (f"{model.get('arch', 'qwen2')} h{model.get('hidden_size', 128)} x{model.get('num_layers', 4)} "
                "layers (random init)")
    else:
        what = f"{source}: {Path(str(model.get('path', '-'))).name}"
    if data.get("backend") == "megatron":
        meg = data.get("megatron") or {}
        tp, pp = int(meg.get("tp", 1)), int(meg.get("pp", 1))
        layout, cluster = f"Megatron TP{tp} x PP{pp} x DP (--nproc / {tp * pp})", "1 machine, torchrun --nproc N"
    else:
        layout, cluster = "1 process (HF model)", "1 machine (CPU or 1 GPU)"
    return RecipeInfo(path.stem, "train", "recipe", what, layout, cluster, path)


def describe(path: str | os.PathLike) -> RecipeInfo:
    """Host, model, layout and cluster size of one recipe file, read from the YAML (veRL recipes
    with the local recipes they build on; keys a recipe leaves to veRL's defaults are shown as
    veRL's: FSDP, TP 1, 8 GPUs on one node)."""
    path = Path(path)
    data = _load(path)
    folder = path.parent.name
    if folder == "verl":
        return _describe_verl(path, data)
    if folder == "openrlhf":
        return _describe_openrlhf(path, data)
    return _describe_train(path, data)


def catalogue(host: str | None = None) -> list[RecipeInfo]:
    """Every shipped recipe and override file, embedded trainer first, then veRL, then OpenRLHF."""
    base = root()
    if not base.is_dir():
        raise FileNotFoundError(f"no recipes directory at {base}: this install carries no recipes")
    folder = _folder(host)
    out = []
    for where in HOSTS:
        if folder is not None and where != folder:
            continue
        d = base / where if where else base
        for path in sorted(p for p in d.iterdir() if p.suffix in SUFFIXES and p.is_file()):
            out.append(describe(path))
    return out
