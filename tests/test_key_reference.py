"""docs/reference/keys.md is generated from the config dataclasses (scripts/gen_key_reference.py)
and lists every key once: a field added, renamed or re-documented without regenerating it fails here."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from cppo_megatron.config import CPPOConfig
from cppo_megatron.trainer.config import RECIPE_KEYS, recipe_fields

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gen_key_reference.py"


def _generator():
    spec = importlib.util.spec_from_file_location("gen_key_reference", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _listed_keys(text: str) -> list[str]:
    return re.findall(r"^\| `([^`]+)` \|", text, flags=re.M)


def test_the_key_reference_is_up_to_date():
    gen = _generator()
    assert gen.OUT.read_text() == gen.render(), (
        f"docs/reference/keys.md is out of date with the config dataclasses; regenerate it: {gen.REGENERATE}")


def test_every_key_is_listed_once_with_its_help_and_host():
    gen = _generator()
    text = gen.render()
    listed = _listed_keys(text)
    assert len(listed) == len(set(listed)), "a key is listed twice"
    missing, unknown = sorted(set(RECIPE_KEYS) - set(listed)), sorted(set(listed) - set(RECIPE_KEYS))
    assert not missing and not unknown, (missing, unknown)
    assert "cppo.selective.p_easy" in listed and "cppo.early_stop.segment_tokens" in listed  # sections flattened
    fields = dict(recipe_fields())
    rows = dict(zip(listed, (line for line in text.splitlines() if line.startswith("| `")), strict=True))
    for key, f in fields.items():
        assert f.metadata["help"].replace("|", "\\|") in rows[key], key
    # the host column: every cppo key names its hosts, the trainer-only keys say so
    cppo = [r for k, r in rows.items() if k.startswith("cppo.")]
    assert len(cppo) == len([k for k in RECIPE_KEYS if k.startswith("cppo.")])
    assert all("trainer" in r or "veRL" in r for r in cppo)
    assert "| trainer (veRL and OpenRLHF refuse it) |" in rows["cppo.keep_mass"]
    assert "OpenRLHF (synchronous loop)" in rows["cppo.early_stop.enabled"]
    assert "OpenRLHF (synchronous loop)" in rows["cppo.selective.enabled"]
    assert "| `0.875`" not in rows["cppo.pruning_rate"] and "| float \\| null | `null` |" in rows["cppo.pruning_rate"]
    assert rows["seed"].startswith("| `seed` | int | `0` |")  # types come from the annotations
    assert "| `cppo.early_stop.timeout_s` | float | `600.0` | > 0 | veRL, OpenRLHF |" in rows["cppo.early_stop.timeout_s"]


def test_the_host_notes_name_existing_keys():
    gen = _generator()
    keys = {f"cppo.{k}" for k in CPPOConfig.__dataclass_fields__} | set(RECIPE_KEYS)
    for key in gen.HOSTS:
        if key.endswith("."):
            assert any(k.startswith(key) for k in RECIPE_KEYS), f"HOSTS names no section {key!r}"
        else:
            assert key in keys, f"HOSTS names {key!r}, which is no key"


def test_check_mode_names_the_regenerate_command(tmp_path, monkeypatch, capsys):
    gen = _generator()
    stale = tmp_path / "keys.md"
    stale.write_text("old\n")
    monkeypatch.setattr(gen, "OUT", stale)
    monkeypatch.setattr(gen, "ROOT", tmp_path)
    assert gen.main(["--check"]) == 1
    assert "scripts/gen_key_reference.py" in capsys.readouterr().err
    assert gen.main([]) == 0 and stale.read_text() == gen.render()
    assert gen.main(["--check"]) == 0
