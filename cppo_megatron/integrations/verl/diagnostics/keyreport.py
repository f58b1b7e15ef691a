"""Which keys of a recipe a real veRL run read: the recipe's keys against a key trace.

    CPPO_VERL_KEYS=runs/verl_toy/keys_7b cppo-megatron verl recipes/verl/qwen2.5-7b-math-megatron-cppo.yaml \\
        --cpu recipes/verl/cpu_toy.yaml
    python -m cppo_megatron.integrations.verl.diagnostics.keyreport recipes/verl/qwen2.5-7b-math-megatron-cppo.yaml \\
        --cpu recipes/verl/cpu_toy.yaml --trace runs/verl_toy/keys_7b

For every key the recipe file sets (its own lines, not its defaults), one row: the recipe's
value, whether the override file replaced it, and where veRL's code read it in the run
(``keytrace``: file:line in the installed veRL, the process, the value it saw). A key counts as
read by veRL when a frame of veRL's package read it, or read a mapping above it as a whole
(``ray_kwargs.ray_init`` handed to ``ray.init``). Reads by cppo-megatron itself (the ``cppo``
group, allocation) are listed apart. Exit status 1 when a key the override file leaves alone
was read by nobody.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ....recipes import arg_type as recipe_arg
from ..overrides import SKIP, flatten
from . import keytrace

__all__ = ["KeyRow", "combined_markdown", "composed_config", "interpolation_aliases", "key_rows", "main", "markdown",
           "recipe_leaves"]

RECIPE_SKIP = ("hydra", "defaults")
VERL_SITE = "verl" + os.sep


@dataclass
class KeyRow:
    """One recipe key: its value, the override's, and the reads the trace saw."""

    key: str
    recipe: Any
    override: Any = None
    overridden: bool = False
    verl_sites: list[str] = field(default_factory=list)
    verl_values: list[str] = field(default_factory=list)
    processes: list[str] = field(default_factory=list)
    other_sites: list[str] = field(default_factory=list)

    @property
    def read_by_verl(self) -> bool:
        return bool(self.verl_sites)

    @property
    def status(self) -> str:
        if self.overridden:
            return "overridden"
        if self.read_by_verl:
            return "read by veRL"
        if self.other_sites:
            return "read by cppo-megatron"
        return "not read"


def recipe_leaves(path: str | os.PathLike) -> list[tuple[str, Any]]:
    """(dotted key, value) for every leaf a recipe file sets itself (not hydra's own keys)."""
    import yaml

    data = yaml.safe_load(Path(path).read_text()) or {}
    return flatten({k: v for k, v in data.items() if k not in RECIPE_SKIP})


# Ray process titles -> the role veRL gives the process
ROLES = (("WorkerDict", "worker"), ("TaskRunner", "TaskRunner"), ("AgentLoop", "agent loop"),
         ("RewardLoop", "reward loop"), ("HFRollout", "rollout server"))


def _process_name(cmdline: str) -> str:
    for marker, role in ROLES:
        if marker in cmdline:
            return role
    return "driver" if not cmdline.startswith("ray::") else cmdline.removeprefix("ray::").split(".", 1)[0]


_REF = re.compile(r"\$\{(?:oc\.select:)?([A-Za-z_][A-Za-z0-9_.]*)")


def interpolation_aliases(config: Any) -> dict[str, list[str]]:
    """``target -> [keys whose value interpolates it]`` in a composed, unresolved config: veRL
    reads ``data.max_response_length`` as ``actor_rollout_ref.rollout.response_length:
    ${oc.select:data.max_response_length,...}``, so a read of the alias is a read of the target."""
    from omegaconf import OmegaConf

    out: dict[str, list[str]] = {}
    tree = OmegaConf.to_container(config, resolve=False)

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{path}.{k}" if path else str(k))
        elif isinstance(node, str):
            for target in _REF.findall(node):
                out.setdefault(target, []).append(path)

    walk(tree, "")
    return out


def composed_config(recipe: str | os.PathLike, override_file: str | os.PathLike | None = None) -> Any:
    """The recipe composed by hydra with the override file's keys, as ``cppo-megatron verl`` does
    (unresolved; no CPPO changes)."""
    from hydra import compose, initialize_config_dir

    from ..main import recipe_args
    from ..overrides import file_overrides

    args = recipe_args([str(recipe)], file_overrides(override_file) if override_file else [])
    path = next(a.split("=", 1)[1] for a in args if a.startswith("--config-path="))
    name = next(a.split("=", 1)[1] for a in args if a.startswith("--config-name="))
    with initialize_config_dir(config_dir=path, version_base=None):
        return compose(config_name=name, overrides=[a for a in args if not a.startswith("--")])


def _readers(key: str, aliases: dict[str, list[str]]) -> dict[str, str]:
    """``key`` and every key that interpolates it (transitively): {reader key: how it names key}."""
    found = {key: key}
    todo = [key]
    while todo:
        for alias in aliases.get(todo.pop(), ()):
            if alias not in found:
                found[alias] = alias
                todo.append(alias)
    return found


def key_rows(recipe: str | os.PathLike, override_file: str | os.PathLike | None, trace_dir: str | os.PathLike,
             aliases: dict[str, list[str]] | None = None) -> list[KeyRow]:
    """One ``KeyRow`` per key the recipe sets, from the trace under ``trace_dir``; a read of a key
    that interpolates a recipe key counts for it (``aliases``: ``interpolation_aliases`` of the
    run's config, composed here when not given)."""
    import yaml

    if aliases is None:
        aliases = interpolation_aliases(composed_config(recipe, override_file))

    overrides: dict[str, Any] = {}
    if override_file:
        data = yaml.safe_load(Path(override_file).read_text()) or {}
        overrides = dict(flatten({k: v for k, v in data.items() if k not in SKIP}))
    records = keytrace.read(trace_dir)
    if not records:
        raise ValueError(f"{trace_dir}: no key-trace records (run with {keytrace.ENV}={trace_dir})")
    rows = []
    for key, value in recipe_leaves(recipe):
        row = KeyRow(key, value)
        if key in overrides:
            row.overridden, row.override = True, overrides[key]
        readers = _readers(key, aliases)
        for rec in records:
            k = rec["key"]
            exact = k in readers
            if not (exact or (rec["how"] == "whole" and any(r.startswith(k + ".") for r in readers))):
                continue
            site = rec["site"]
            if site.startswith(VERL_SITE):
                site = site if k == key or not exact else f"{site} (as {k})"
                if site not in row.verl_sites:
                    row.verl_sites.append(site)
                if exact and rec["value"] not in row.verl_values:
                    row.verl_values.append(rec["value"])
                proc = _process_name(rec["process"])
                if proc not in row.processes:
                    row.processes.append(proc)
            elif site not in row.other_sites:
                row.other_sites.append(site)
        rows.append(row)
    return rows


def _cell(value: Any) -> str:
    text = str(value).replace("|", "\\|")
    return text if len(text) <= 48 else text[:45] + "..."


def markdown(rows: list[KeyRow], *, max_sites: int = 2) -> str:
    """The rows as a markdown table, then one summary line."""
    out = ["| recipe key | recipe value | toy run | read by veRL at (first sites) | process | value read |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        toy = f"**{_cell(r.override)}**" if r.overridden else "as written"
        sites = ", ".join(f"`{s}`" for s in r.verl_sites[:max_sites]) + (
            f" (+{len(r.verl_sites) - max_sites})" if len(r.verl_sites) > max_sites else "")
        if not sites:
            sites = ("cppo-megatron: " + ", ".join(f"`{s}`" for s in r.other_sites[:max_sites])) if r.other_sites \
                else "—"
        values = ", ".join(_cell(v) for v in r.verl_values[:3]) or ("(as a whole)" if r.verl_sites else "")
        out.append(f"| `{r.key}` | {_cell(r.recipe)} | {toy} | {sites} | {', '.join(r.processes[:3])} | {values} |")
    kept = [r for r in rows if not r.overridden]
    verl = sum(r.read_by_verl for r in kept)
    ours = sum(1 for r in kept if not r.read_by_verl and r.other_sites)
    none = [r.key for r in kept if r.status == "not read"]
    out.append("")
    out.append(f"{len(rows)} keys in the recipe: {len(rows) - len(kept)} replaced by the override file; of the "
               f"{len(kept)} run as written, {verl} read by veRL, {ours} by cppo-megatron only, "
               f"{len(none)} by nobody{': ' + ', '.join(none) if none else ''}.")
    return "\n".join(out)


def combined_markdown(runs: list[tuple[str, list[KeyRow]]], *, max_sites: int = 2) -> str:
    """Several runs' rows (``[(label, key_rows(...)), ...]``, e.g. the 7B and 14B recipes) as one
    table: a row per key any recipe sets, the recipes' values, the override, where veRL read it
    (sites of all runs) and in which runs."""
    keys: list[str] = []
    for _, rows in runs:
        keys += [r.key for r in rows if r.key not in keys]
    out = ["| recipe key | recipe value | toy run | read by veRL at (first sites) | process | read in |",
           "|---|---|---|---|---|---|"]
    for key in keys:
        here = [(label, next(r for r in rows if r.key == key))
                for label, rows in runs if any(r.key == key for r in rows)]
        by_value: dict[str, list[str]] = {}
        for lb, r in here:
            by_value.setdefault(_cell(r.recipe), []).append(lb)
        value = next(iter(by_value)) if len(by_value) == 1 else "; ".join(
            f"{v} ({', '.join(lbs)})" for v, lbs in by_value.items())
        overrides = {str(r.override) for _, r in here if r.overridden}
        toy = " / ".join(f"**{_cell(o)}**" for o in sorted(overrides)) if overrides else "as written"
        sites: list[str] = []
        procs: list[str] = []
        for _, r in here:
            sites += [x for x in r.verl_sites if x not in sites]
            procs += [x for x in r.processes if x not in procs]
        others = sorted({x for _, r in here for x in r.other_sites})
        cell = ", ".join(f"`{x}`" for x in sites[:max_sites]) + (
            f" (+{len(sites) - max_sites})" if len(sites) > max_sites else "")
        if not cell:
            cell = ("cppo-megatron: " + ", ".join(f"`{x}`" for x in others[:max_sites])) if others else "—"
        readers = [lb for lb, r in here if r.read_by_verl or r.other_sites]
        read_in = ("all" if len(readers) == len(runs) else ", ".join(readers)) if readers else "none"
        out.append(f"| `{key}` | {value} | {toy} | {cell} | {', '.join(procs[:3])} | {read_in} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cppo_megatron.integrations.verl.diagnostics.keyreport",
        description="Which keys of a veRL recipe a run read (from its CPPO_VERL_KEYS trace).")
    parser.add_argument("recipe", type=recipe_arg("verl"), help="the recipe file the run started from")
    parser.add_argument("--cpu", dest="override_file", default=None, type=recipe_arg("verl"),
                        help="the override file the run applied (e.g. recipes/verl/cpu_toy.yaml)")
    parser.add_argument("--trace", required=True, help="the CPPO_VERL_KEYS directory of the run")
    args = parser.parse_args(argv)
    try:
        rows = key_rows(args.recipe, args.override_file, args.trace)
    except (OSError, ValueError) as exc:
        print(f"keyreport: {exc}", file=sys.stderr)
        return 2
    print(markdown(rows))
    return 1 if any(r.status == "not read" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
