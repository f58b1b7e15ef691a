"""cppo_megatron/core is the innermost layer: it imports nothing of ours from outside it (not
even config.py) and no third-party package but torch and numpy — every import statement,
including those inside functions and ``if TYPE_CHECKING:`` blocks (design.md, "Dependencies
point inward")."""

import ast
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "cppo_megatron"
CORE = PKG / "core"
ALLOWED_THIRD_PARTY = {"torch", "numpy"}


def _imported_modules(path: Path, package_root: Path = PKG) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path``; relative imports are
    resolved against the file's package (``from ..config import X`` in core/a.py is
    ``cppo_megatron.config``)."""
    here = [package_root.name, *path.parent.relative_to(package_root).parts]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                if node.level > len(here):
                    raise AssertionError(f"{path}:{node.lineno}: relative import above the package root")
                base = here[: len(here) - node.level + 1]
                out.append((node.lineno, ".".join(base + ([node.module] if node.module else []))))
            else:
                out.append((node.lineno, node.module or ""))
        elif isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names)
    return out


def outside_imports(path: Path, package_root: Path = PKG) -> list[str]:
    """``file:line module`` for each import of ``path`` that leaves the core: a module of
    ours outside ``cppo_megatron.core``, or a package that is neither the standard library
    nor torch / numpy."""
    core = f"{package_root.name}.core"
    bad = []
    for line, mod in _imported_modules(path, package_root):
        top = mod.split(".")[0]
        if top == package_root.name:
            ok = mod == core or mod.startswith(core + ".")
        else:
            ok = top in ALLOWED_THIRD_PARTY or top in sys.stdlib_module_names
        if not ok:
            bad.append(f"{path.relative_to(package_root.parent)}:{line} {mod}")
    return bad


def test_core_imports_nothing_from_outside_it():
    files = sorted(CORE.rglob("*.py"))
    assert len(files) >= 9  # advantage, allocation, balance, loss, pipeline, sampling, selection, settings, ...
    bad = [hit for f in files for hit in outside_imports(f)]
    assert bad == [], "the core must import only itself, torch, numpy and the standard library:\n" + "\n".join(bad)


def test_the_check_sees_every_kind_of_violation(tmp_path):
    """A file placed in a copy of the layout: an upward import of ours, one hidden in a
    TYPE_CHECKING block, a lazy third-party import inside a function, and the allowed ones."""
    core = tmp_path / "cppo_megatron" / "core"
    core.mkdir(parents=True)
    f = core / "planted.py"
    f.write_text(
        "from __future__ import annotations\n"
        "import math\n"
        "from typing import TYPE_CHECKING\n"
        "import numpy as np\n"
        "import torch.distributed\n"
        "from .settings import CPPOConfig\n"
        "from . import balance\n"
        "from ..config import ESTIMATOR_NAME\n"
        "if TYPE_CHECKING:\n"
        "    from ..trainer.config import Recipe\n"
        "def f():\n"
        "    from omegaconf import OmegaConf\n"
        "    import cppo_megatron.distributed\n"
    )
    got = outside_imports(f, tmp_path / "cppo_megatron")
    assert got == [
        "cppo_megatron/core/planted.py:8 cppo_megatron.config",
        "cppo_megatron/core/planted.py:10 cppo_megatron.trainer.config",
        "cppo_megatron/core/planted.py:12 omegaconf",
        "cppo_megatron/core/planted.py:13 cppo_megatron.distributed",
    ]


def test_config_module_builds_on_the_core_settings():
    """The circle is gone in the other direction too: config.py re-exports the core's type,
    so the old import paths name one class."""
    import cppo_megatron
    import cppo_megatron.config as config
    import cppo_megatron.core as core
    from cppo_megatron.core import settings

    assert cppo_megatron.CPPOConfig is config.CPPOConfig is core.CPPOConfig is settings.CPPOConfig
    assert config.METRICS is settings.METRICS and config.ADV_NORMS is core.ADV_NORMS
    assert all(m.startswith("cppo_megatron.core") for _, m in _imported_modules(PKG / "config.py")
               if m.startswith("cppo_megatron"))
