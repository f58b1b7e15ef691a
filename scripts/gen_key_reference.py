"""Write docs/reference/keys.md, the key reference, from the config dataclasses.

Every key's type, default, allowed values and help come from the dataclass fields
(``CPPOConfig`` and its sections in ``cppo_megatron.core.settings``; the embedded trainer's
``Recipe`` in ``cppo_megatron.trainer.config``): the same metadata ``--help-recipe``, the
class docstrings and validation read. Which host reads a key is the one thing the fields do
not carry; ``HOSTS`` below says it, from the hosts' own checks (cited beside each entry).

    .venv/bin/python scripts/gen_key_reference.py          # rewrite docs/reference/keys.md
    .venv/bin/python scripts/gen_key_reference.py --check  # exit 1 when the file is out of date

tests/test_key_reference.py fails when the file differs from what this script writes.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "reference" / "keys.md"
REGENERATE = ".venv/bin/python scripts/gen_key_reference.py"

ALL_HOSTS = "trainer, veRL, OpenRLHF"
# Which host reads a key, where it is not every host (cppo.*) or the embedded trainer alone (the
# rest of the recipe). Each entry follows a host's refusal or warning, named in the comment.
HOSTS: dict[str, str] = {
    # integrations/verl/runconfig.py check_compatible, integrations/openrlhf/hook.py _check_config
    "cppo.metric": f"{ALL_HOSTS}; `importance`: trainer only (veRL and OpenRLHF refuse it)",
    # runconfig.check_compatible, openrlhf/train.py (a fixed k per step)
    "cppo.keep_mass": "trainer (veRL and OpenRLHF refuse it)",
    # runconfig.check_compatible, openrlhf/hook.check_settings: use the host's own DAPO filter
    "cppo.dynamic_sampling": "trainer (veRL and OpenRLHF refuse it; use their DAPO filter)",
    "cppo.max_refill_rounds": "trainer, with `dynamic_sampling` (OpenRLHF warns it has no effect)",
    # runconfig.check_compatible, openrlhf/hook.check_settings: both always balance into equal parts
    "cppo.equal_size": f"{ALL_HOSTS}; `false` set explicitly: trainer only (veRL and OpenRLHF refuse it)",
    # runconfig.check_compatible (norm_adv_by_std_in_grpo), openrlhf/hook.check_settings (the estimator)
    "cppo.adv_norm": f"{ALL_HOSTS} (veRL and OpenRLHF refuse a value that contradicts their estimator)",
    # the EarlyStopConfig help; runconfig.check_early_stop; nothing in integrations/openrlhf reads it
    "cppo.early_stop.": "trainer, veRL (V1 sync loop), OpenRLHF (synchronous loop)",
    "cppo.early_stop.features": "trainer, veRL and OpenRLHF (`logprob` only; their check_early_stop / check_args)",
    "cppo.early_stop.timeout_s": "veRL, OpenRLHF",
    # runconfig.check_compatible, openrlhf/hook.check_settings, trainer/config.py (backend=hf)
    "cppo.two_wave.": "trainer, `backend: hf` (veRL and OpenRLHF refuse it)",
    # the SelectiveConfig help
    "cppo.selective.": "trainer, veRL (V1 sync loop), OpenRLHF (synchronous loop)",
}

HOST_SPELLING = "\n".join([
    "| host | where the keys go | example |",
    "|---|---|---|",
    "| embedded trainer (`cppo-megatron train`) | the recipe YAML, or `key=value` overrides after it "
    "| `cppo-megatron train recipes/tiny_cpu.yaml cppo.pruning_rate=0.5` |",
    "| veRL (`cppo-megatron verl`) | the `cppo` group of the veRL config: the recipe's `cppo:` section or hydra "
    "overrides | `cppo-megatron verl tiny_cpu_cppo cppo.pruning_rate=0.5` |",
    "| OpenRLHF (`cppo-megatron openrlhf`) | the recipe's `cppo:` section, or `--cppo.KEY=VALUE` flags of the "
    "launcher | `cppo-megatron openrlhf tiny_cpu_cppo --cppo.pruning_rate=0.5` |",
]) + "\n"


def _type_name(hint: object) -> str:
    args = typing.get_args(hint)
    if args:
        return " \\| ".join(_type_name(a) for a in args)
    if hint is type(None):
        return "null"
    return getattr(hint, "__name__", str(hint))


def _value(value: object) -> str:
    if value is None or value is dataclasses.MISSING:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, str) else str(value)


def _hosts(key: str) -> str:
    if key in HOSTS:
        return HOSTS[key]
    section = next((p for p in HOSTS if p.endswith(".") and key.startswith(p)), None)
    if section:
        return HOSTS[section]
    return ALL_HOSTS if key.startswith("cppo.") else "trainer"


def _rows(cls: type, prefix: str) -> list[tuple[str, dataclasses.Field, object]]:
    """(dotted key, field, type hint) of every leaf key under ``cls``, sections flattened."""
    from cppo_megatron.core.settings import section_type

    hints = typing.get_type_hints(cls)
    out: list[tuple[str, dataclasses.Field, object]] = []
    for f in dataclasses.fields(cls):
        section = section_type(f)
        if section is not None:
            out += _rows(section, f"{prefix}{f.name}.")
        else:
            out.append((f"{prefix}{f.name}", f, hints[f.name]))
    return out


def _table(rows: list[tuple[str, dataclasses.Field, object]], *, hosts: bool) -> list[str]:
    from cppo_megatron.core.settings import allowed_words

    head = "| key | type | default | allowed | " + ("read by | " if hosts else "") + "meaning |"
    lines = [head, "|" + "---|" * (6 if hosts else 5)]
    for key, f, hint in rows:
        meta = f.metadata
        allowed = allowed_words(meta)
        help_text = meta.get("help", "").replace("|", "\\|")
        default = f.default if f.default is not dataclasses.MISSING else None
        cells = [f"`{key}`", _type_name(hint), f"`{_value(default)}`", allowed]
        if hosts:
            cells.append(_hosts(key))
        cells.append(help_text)
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def render() -> str:
    """The text of docs/reference/keys.md."""
    from cppo_megatron.core.settings import CPPOConfig, section_type
    from cppo_megatron.trainer.config import Recipe

    out = [
        "# Key reference",
        "",
        "<!-- Generated by scripts/gen_key_reference.py from the config dataclasses; do not edit by hand. -->",
        "",
        "Every CPPO key and every key of the embedded trainer's recipe: its type, default, allowed",
        "values and meaning come from the fields' metadata (the text `--help-recipe` prints and",
        "validation checks). Regenerate after changing a field:",
        "",
        "<!-- not-run: rewrites this file -->",
        "```bash",
        REGENERATE,
        "```",
        "",
        "## Where the keys go",
        "",
        HOST_SPELLING,
        "Host guides: [veRL](../integrations/verl.md), [OpenRLHF](../integrations/openrlhf.md),",
        "[the embedded trainer](../trainer.md), [Megatron](../integrations/megatron.md). veRL's and",
        "OpenRLHF's own keys are theirs; the guides name the few CPPO changes or checks.",
        "",
        "## CPPO keys (`cppo.*`, every host)",
        "",
        "`cppo.*` keys are the fields of `cppo_megatron.config.CPPOConfig` and its sections; a host",
        "refuses, before any work starts, a value it cannot honour (the *read by* column).",
    ]
    cppo_rows = _rows(CPPOConfig, "cppo.")
    sections = [""] + sorted({k.rsplit(".", 1)[0] + "." for k, _, _ in cppo_rows if k.count(".") > 1})
    for section in sections:
        rows = [r for r in cppo_rows if (r[0].count(".") == 1 if not section else r[0].startswith(section))]
        title = "top level" if not section else f"`{section.rstrip('.')}`"
        out += ["", f"### {title}", "", *_table(rows, hosts=True)]
    out += ["", "## Embedded trainer recipe keys (`cppo-megatron train`)", "",
            "The rest of a `cppo-megatron train` recipe (its `cppo` section is the table above);",
            "`cppo-megatron train --help-recipe [SECTION]` prints the same text."]
    rows = [r for r in _rows(Recipe, "") if not r[0].startswith("cppo.")]
    out += ["", "### top level", "", *_table([r for r in rows if "." not in r[0]], hosts=False)]
    for f in dataclasses.fields(Recipe):
        section = section_type(f)
        if section is None or f.name == "cppo":
            continue
        out += ["", f"### `{f.name}`: {f.metadata.get('help', '')}", "",
                *_table([r for r in rows if r[0].startswith(f"{f.name}.")], hosts=False)]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/reference/keys.md is out of date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.is_file() or OUT.read_text() != text:
            print(f"{OUT.relative_to(ROOT)} is out of date; regenerate it: {REGENERATE}", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
