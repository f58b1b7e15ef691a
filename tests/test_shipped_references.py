"""What ships points only inside the repository: no docstring, comment or doc sends a reader
to the project's private notes (``../shared/docs/...``), which a user's checkout does not have."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHIPPED = ["cppo_megatron", "docs", "recipes", "scripts", "patches", "examples", "README.md", "pyproject.toml"]
OUTSIDE = re.compile(r"shared/docs|platform-notes\.md|\.\./shared\b")


def test_shipped_files_do_not_point_outside_the_repository():
    hits = []
    for top in SHIPPED:
        root = REPO / top
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for f in files:
            if f.suffix not in (".py", ".md", ".yaml", ".yml", ".sh", ".toml", ".txt", ".patch", ".json"):
                continue
            for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
                if OUTSIDE.search(line):
                    hits.append(f"{f.relative_to(REPO)}:{n}: {line.strip()}")
    assert hits == []
