"""An override file: one YAML mapping of veRL config keys applied over a recipe (``--cpu FILE``).

``recipes/verl/cpu_toy.yaml`` is the one such file: it runs any Megatron cluster recipe of
``recipes/verl`` on a CPU machine at toy size. Its keys are nested like a recipe's; each leaf
becomes a hydra ``++key=value`` override placed between the recipe and the command line's own
overrides, so the order of precedence is recipe < file < command line, and a key the recipe does
not set (``cppo_cpu``, ``trainer.device``) is added. A top-level ``description`` is text for
people and is skipped.

    file_overrides("recipes/verl/cpu_toy.yaml")
    # ['++cppo_cpu.warmup_recipe=tiny_cpu.yaml', ..., "++data.train_files='${cppo_cpu.data_dir}/train.parquet'", ...]
"""

from __future__ import annotations

import math
import os
from typing import Any

__all__ = ["FLAG", "OverrideFileError", "file_overrides", "flatten", "hydra_value", "split_flag"]

FLAG = "--cpu"
SKIP = ("description",)


class OverrideFileError(ValueError):
    """A bad ``--cpu`` argument or override file (the CLI prints it as one line, exit 2)."""


def hydra_value(value: Any, key: str = "value") -> str:
    """``value`` (a YAML scalar, list or mapping) in hydra's override grammar. Strings are
    single-quoted (so ``:``, ``,``, ``=`` and spaces need nothing) and keep ``${...}``
    interpolations, which hydra resolves in quoted strings too."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise OverrideFileError(f"{key}: {value!r} has no hydra override form; use a finite number")
        return repr(value)
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(hydra_value(v, key) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{hydra_value(v, f'{key}.{k}')}" for k, v in value.items()) + "}"
    raise OverrideFileError(f"{key}: {value!r} ({type(value).__name__}) is not a YAML scalar, list or mapping")


def flatten(mapping: dict, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, leaf value) pairs of a nested mapping, in file order. An empty mapping is a
    leaf (``{}``); lists are leaves (they replace the recipe's list whole)."""
    out: list[tuple[str, Any]] = []
    for key, value in mapping.items():
        if not isinstance(key, str) or not key or "." in key:
            raise OverrideFileError(f"override file: key {prefix}{key!r} must be a plain name "
                                    "(nest mappings instead of dots)")
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out += flatten(value, path + ".")
        else:
            out.append((path, value))
    return out


def file_overrides(path: str | os.PathLike) -> list[str]:
    """The hydra ``++key=value`` overrides of an override file (see the module docstring).
    Errors name the file and the key."""
    import yaml

    path = os.fspath(path)
    if not os.path.isfile(path):
        from ...recipes import resolve

        try:  # a shipped override file by name: --cpu cpu_toy
            path = os.fspath(resolve(path, host="verl"))
        except FileNotFoundError:
            raise OverrideFileError(f"{FLAG} {path!r}: no such override file (e.g. recipes/verl/cpu_toy.yaml, "
                                    "or its name cpu_toy)") from None
    with open(path) as f:
        data = yaml.safe_load(f)
    if not isinstance(data, dict):
        raise OverrideFileError(f"{FLAG} {path}: expected a mapping of veRL config keys at the top, "
                                f"got {type(data).__name__}")
    body = {k: v for k, v in data.items() if k not in SKIP}
    if not body:
        raise OverrideFileError(f"{FLAG} {path}: no keys to override")
    return [f"++{key}={hydra_value(value, key)}" for key, value in flatten(body)]


def split_flag(argv: list[str]) -> tuple[list[str], str | None]:
    """``argv`` without ``--cpu FILE`` / ``--cpu=FILE``, and FILE (None when absent)."""
    out, found = [], None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == FLAG or arg.startswith(FLAG + "="):
            if found is not None:
                raise OverrideFileError(f"{FLAG} given twice ({found!r} and another): give one override file")
            if arg == FLAG:
                if i + 1 >= len(argv) or argv[i + 1].startswith("-") or "=" in argv[i + 1]:
                    raise OverrideFileError(f"{FLAG} needs a file: {FLAG} recipes/verl/cpu_toy.yaml")
                found = argv[i + 1]
                i += 2
                continue
            found = arg.split("=", 1)[1]
            if not found:
                raise OverrideFileError(f"{FLAG}= needs a file: {FLAG}=recipes/verl/cpu_toy.yaml")
        else:
            out.append(arg)
        i += 1
    return out, found
