"""OpenRLHF recipes: a YAML file with a ``cppo`` section (CPPOConfig fields, or null for
plain GRPO) and an ``openrlhf`` section (``train_ppo_ray`` flags without the leading
``--``; ``true`` is a switch, ``false`` leaves it off, a list gives several values).

A ``cpu`` section runs the recipe on a machine without a GPU (``cpu/prepare.py``); a CPU
override file (``--cpu FILE``: its ``cpu`` section and ``openrlhf`` flags, applied over the
recipe's) runs a cluster recipe there at toy size (``merge_cpu_override``).

``${RECIPE_DIR}`` in a value is the recipe's folder (e.g. a reward function shipped
next to it); other ``${VAR}`` are taken from the environment.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from ...config import RENAMED, CPPOConfig, flatten_keys, nest_keys

SECTIONS = ("description", "cppo", "openrlhf", "cpu")


def load_recipe(path: str | os.PathLike) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"recipe {str(path)!r} does not exist (give a file, or a shipped recipe's name: "
                         "`cppo-megatron recipes --host openrlhf`)")
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"recipe {path}: expected a mapping at the top, got {type(data).__name__}")
    unknown = sorted(set(data) - set(SECTIONS))
    if unknown:
        raise ValueError(f"recipe {path}: unknown section(s) {unknown}; known: {list(SECTIONS)}")
    if not isinstance(data.get("openrlhf"), dict) or not data["openrlhf"]:
        raise ValueError(f"recipe {path}: the 'openrlhf' section must map flags to values")
    cppo = data.get("cppo")
    if cppo is not None and not isinstance(cppo, dict):
        raise ValueError(f"recipe {path}: 'cppo' must be a mapping of CPPOConfig fields or null")
    if cppo is not None:  # nested sections, dotted keys and deprecated flat names (a FutureWarning each)
        try:
            data["cppo"] = nest_keys(CPPOConfig, cppo, where="cppo", renamed=RENAMED)
        except ValueError as exc:
            raise ValueError(f"recipe {path}: {exc}") from None
    data["_dir"] = str(path.resolve().parent)
    return data


def _expand(value: Any, recipe_dir: str) -> str:
    text = str(value).replace("${RECIPE_DIR}", recipe_dir)
    return os.path.expandvars(text)


def openrlhf_flags(recipe: dict[str, Any]) -> list[str]:
    """The ``openrlhf`` section as train_ppo_ray arguments."""
    out: list[str] = []
    for key, value in recipe["openrlhf"].items():
        flag = f"--{key}"
        if value is True:
            out.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, (list, tuple)):
            out += [flag, *(_expand(v, recipe["_dir"]) for v in value)]
        else:
            out += [flag, _expand(value, recipe["_dir"])]
    return out


def launcher_argv(recipe: dict[str, Any]) -> list[str]:
    """Arguments for ``cppo_megatron.integrations.openrlhf.train.main``."""
    cppo = recipe.get("cppo")
    head = (["--cppo.off"] if cppo is None  # one --cppo.KEY=VALUE per leaf key, dotted through sections
            else [f"--cppo.{k}={yaml.safe_dump(v).splitlines()[0]}" for k, v in flatten_keys(cppo).items()])
    return head + openrlhf_flags(recipe)


def merge_cpu_override(recipe: dict[str, Any], path: str | os.PathLike) -> dict[str, Any]:
    """``recipe`` with a CPU override file applied: the file's ``cpu`` section replaces the
    recipe's, its ``openrlhf`` flags replace the recipe's values of the same flags (the rest of
    the recipe stays as written). The file may hold only ``description``, ``cpu`` and ``openrlhf``."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"cpu override {str(path)!r} does not exist")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"cpu override {path}: expected a mapping at the top")
    unknown = sorted(set(data) - {"description", "cpu", "openrlhf"})
    if unknown:
        raise ValueError(f"cpu override {path}: unknown section(s) {unknown}; known: description, cpu, openrlhf")
    if not isinstance(data.get("openrlhf") or {}, dict):
        raise ValueError(f"cpu override {path}: 'openrlhf' must map flags to values")
    out = dict(recipe)
    out["cpu"] = data.get("cpu") or {}
    flags = dict(recipe["openrlhf"])
    for key, value in (data.get("openrlhf") or {}).items():
        flags[key] = value
    out["openrlhf"] = flags
    out["_cpu_override"] = str(path.resolve())
    return out
