"""Build step that pyproject.toml cannot declare: the wheel carries a copy of ``recipes/``.

The recipes stay at the top of the repository (one copy in git); building a wheel copies them into
the package as ``cppo_megatron/_recipes/`` (YAML recipes, override files and the reward functions
the OpenRLHF recipes name), where ``cppo_megatron.recipes`` finds them when there is no clone.
An editable install needs no copy: it finds the clone's ``recipes/``. Everything else is in
pyproject.toml.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

RECIPES = Path(__file__).resolve().parent / "recipes"
PACKAGED = Path("cppo_megatron") / "_recipes"
SUFFIXES = (".yaml", ".yml", ".py")


class build_py_with_recipes(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        target = Path(self.build_lib) / PACKAGED
        if target.exists():  # a recipe removed since the last build must not stay in the wheel
            shutil.rmtree(target)
        for src in sorted(RECIPES.rglob("*")):
            if src.is_file() and src.suffix in SUFFIXES and "__pycache__" not in src.parts:
                dest = target / src.relative_to(RECIPES)
                self.mkpath(str(dest.parent))
                self.copy_file(str(src), str(dest), preserve_mode=False)


setup(cmdclass={"build_py": build_py_with_recipes})
