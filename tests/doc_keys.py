"""Output keys as the docs document them: tables headed `| file | where | keys |` in
README.md and docs/**/*.md. Tests compare them with the files a real run writes."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_TICKED = re.compile(r"`([^`]+)`")


def documented_keys(file_name: str) -> dict[str, list[str]]:
    """{where: [keys]} for one output file (e.g. "speedup.json"), from every doc table."""
    found: dict[str, list[str]] = {}
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        in_table = False
        for line in doc.read_text().splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.strip().startswith("|") else None
            if cells is None:
                in_table = False
                continue
            if cells[:3] == ["file", "where", "keys"]:
                in_table = True
                continue
            if in_table and len(cells) == 3 and cells[0] == f"`{file_name}`":
                where = _TICKED.sub(r"\1", cells[1])
                found.setdefault(where, []).extend(_TICKED.findall(cells[2]))
    return found


def missing_keys(data: dict, file_name: str) -> list[str]:
    """Documented keys of ``file_name`` that ``data`` (its parsed content) lacks, as "where: key"."""
    spec = documented_keys(file_name)
    assert spec, f"no documented keys for {file_name}"
    missing = []
    for where, keys in spec.items():
        if where == "top level":
            objects = [data]
        elif where.endswith("[]"):
            objects = data[where[:-2]]
            assert objects, f"{file_name}: {where} is empty"
        else:
            objects = [data[where]]
        for obj in objects:
            missing += [f"{where}: {k}" for k in keys if k not in obj]
    return sorted(set(missing))
