"""cppo_megatron/megatron is the megatron-core library: it must not import the trainer,
the rollout engines or the tasks (dependencies point inward)."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "cppo_megatron"


def _imports(path: Path) -> set[str]:
    """Absolute names of the cppo_megatron modules a file imports (relative imports resolved)."""
    here = ["cppo_megatron", *path.parent.relative_to(PKG).parts]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m.startswith("cppo_megatron")}


def test_megatron_package_imports_no_trainer_rollout_or_tasks():
    bad = {}
    for f in sorted((PKG / "megatron").rglob("*.py")):
        hits = [m for m in _imports(f) if m.split(".")[1:2] in (["trainer"], ["rollout"], ["tasks"])]
        if hits:
            bad[f.name] = hits
    assert not bad, bad
    # the check itself sees a violation: the trainer imports the megatron package's siblings
    assert any(m.startswith("cppo_megatron.rollout") for m in _imports(PKG / "trainer" / "loop.py"))
