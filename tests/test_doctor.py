"""`cppo-megatron doctor`'s per-backend check: a real import, its version, and what it says
when a backend is missing or shadowed."""

from __future__ import annotations

import sys

from cppo_megatron.commands.doctor import check


def test_an_installed_backend_is_importable_with_its_version():
    import numpy

    row = check("numpy", "numpy", "numpy", "core")
    assert row["importable"] is True and row["version"] == numpy.__version__


def test_a_missing_backend_names_the_import_error():
    row = check("nothing", "cppo_no_such_backend", "cppo-no-such-backend", "x")
    assert row["importable"] is False and row["version"] is None
    assert row["note"].startswith("ModuleNotFoundError: No module named 'cppo_no_such_backend'")


def test_a_bare_folder_of_the_same_name_is_not_the_backend(tmp_path, monkeypatch):
    # doctor run from a directory holding e.g. ray/ (a run's output folder): Python imports the
    # folder as an empty namespace package
    (tmp_path / "cppo_shadowed_backend").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        row = check("shadowed", "cppo_shadowed_backend", "cppo-shadowed-backend", "x")
    finally:
        sys.modules.pop("cppo_shadowed_backend", None)
    assert row["importable"] is False and row["version"] is None
    assert "not installed" in row["note"] and str(tmp_path / "cppo_shadowed_backend") in row["note"]
