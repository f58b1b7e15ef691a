"""scripts/coverage_floor.py: the check that fails CI when a module's branch coverage falls below
its floor (tests/coverage_floor.json), and ``--write``, which only raises floors.

The pure parts (``check``, ``write``, ``floor_of``) are pinned on hand-made measurements; ``main``
once end to end on a real coverage.py data file that names one module in scope."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("coverage_floor_script", ROOT / "scripts" / "coverage_floor.py")
assert _spec is not None and _spec.loader is not None
cf = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = cf
_spec.loader.exec_module(cf)

A, B = "cppo_megatron/core/a.py", "cppo_megatron/core/b.py"


def measured(percent: float, missing_branches=(), missing_lines=()) -> dict:
    return {"lines": 10, "lines_run": 9, "branches": 4, "branches_taken": 3, "percent": percent,
            "missing_branches": list(missing_branches), "missing_lines": list(missing_lines)}


def test_a_module_below_its_floor_fails_with_a_line_naming_it_and_what_no_test_reaches():
    problems = cf.check({A: measured(91.25, ["12->15", "30->exit"], [15]), B: measured(100.0)},
                        {A: 92.0, B: 100.0})
    assert problems == [
        f"{A}: branch coverage fell to 91.2% (floor 92.0%); not reached: 12->15, 30->exit, line 15. Add a test "
        "that reaches them, or, where the code went away on purpose, lower the floor with "
        "`python scripts/coverage_floor.py --write --allow-lower` and say why in the commit"]


def test_at_the_floor_passes_and_the_floor_is_compared_at_its_own_precision():
    # 92.04% rounds down to the 92.0 a --write of it would set: not a fall
    assert cf.check({A: measured(92.04)}, {A: 92.0}) == []
    assert cf.check({A: measured(91.99)}, {A: 92.0}) != []
    assert (cf.floor_of(92.04), cf.floor_of(92.09999), cf.floor_of(100.0), cf.floor_of(66.7)) == (92.0, 92.0, 100.0,
                                                                                                    66.7)


def test_a_module_without_a_floor_fails():
    assert cf.check({A: measured(100.0), B: measured(50.0)}, {A: 100.0}) == [
        f"{B} has no coverage floor (a new module?): give its branches tests, then run "
        "`python scripts/coverage_floor.py --write`"]


def test_a_floor_whose_module_is_gone_fails():
    assert cf.check({A: measured(100.0)}, {A: 100.0, B: 80.0}) == [
        f"{B} has a coverage floor but is no longer in scope or no longer exists: "
        "run `python scripts/coverage_floor.py --write` to drop it"]


def test_write_only_raises_floors_unless_allow_lower(tmp_path, capsys):
    path = tmp_path / "floor.json"
    now = {A: measured(80.07), B: measured(97.5)}
    cf.write(now, {A: 85.0, B: 90.0, "cppo_megatron/core/gone.py": 70.0}, False, path)
    assert json.loads(path.read_text())["floors"] == {A: 85.0, B: 97.5}  # A kept, B raised, gone dropped
    assert f"kept {A} at 85.0% (measured 80.0%; --allow-lower lowers it)" in capsys.readouterr().out
    cf.write(now, {A: 85.0, B: 90.0}, True, path)
    assert json.loads(path.read_text())["floors"] == {A: 80.0, B: 97.5}
    assert f"LOWERED {A} from 85.0% to 80.0%" in capsys.readouterr().out


def test_write_sets_a_timing_dependent_module_its_slack_below_the_measurement(tmp_path):
    path = tmp_path / "floor.json"
    slack = {A: {"points": 1.5, "why": "a poll loop"}, "cppo_megatron/core/gone.py": {"points": 1, "why": "x"}}
    cf.write({A: measured(96.0), B: measured(96.0)}, {}, False, path, slack)
    saved = json.loads(path.read_text())
    assert saved["floors"] == {A: 94.5, B: 96.0}
    assert saved["slack"] == {A: {"points": 1.5, "why": "a poll loop"}}  # a gone module's slack goes too


def _data_file(tmp_path: Path, module: str, lines: set[int]) -> Path:
    """A coverage.py data file (with arcs, as ``branch = true`` writes) that ran ``lines`` of
    ``module`` and nothing else."""
    import coverage

    data = coverage.CoverageData(basename=str(tmp_path / ".coverage"))
    ordered = sorted(lines)
    arcs = {(-1, ordered[0])} | set(zip(ordered, ordered[1:])) | {(ordered[-1], -1)}
    data.add_arcs({str(ROOT / module): arcs})
    data.write()
    return tmp_path / ".coverage"


def test_main_fails_naming_the_module_that_fell_and_write_then_passes(tmp_path, capsys):
    module = "cppo_megatron/core/pipeline.py"
    data = _data_file(tmp_path, module, {1, 2, 3})
    floor = tmp_path / "floor.json"
    in_scope = cf.in_scope(["*/cppo_megatron/core/*"])
    assert module in in_scope and "cppo_megatron/trainer/loop.py" not in in_scope
    floors = {m: 100.0 for m in cf.in_scope(cf_include())}
    floors.pop("cppo_megatron/core/__init__.py", None)
    floor.write_text(json.dumps({"floors": floors}))
    assert cf.main(["--data", str(data), "--floor", str(floor), "--quiet"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert any(line.startswith(f"coverage_floor: {module}: branch coverage fell to ") for line in err)
    assert cf.main(["--data", str(data), "--floor", str(floor), "--write", "--allow-lower", "--quiet"]) == 0
    written = json.loads(floor.read_text())["floors"]
    assert written[module] < 100.0 and written["cppo_megatron/trainer/loop.py"] == 0.0  # not imported: 0%
    assert cf.main(["--data", str(data), "--floor", str(floor), "--quiet"]) == 0
    assert "modules at or above their floors" in capsys.readouterr().out


def test_main_without_data_says_how_to_get_it(tmp_path):
    with pytest.raises(SystemExit, match="no coverage data at .*run pytest with --cov first"):
        cf.main(["--data", str(tmp_path / "none"), "--floor", str(tmp_path / "f.json")])


def cf_include() -> list[str]:
    import coverage

    return list(coverage.Coverage(config_file=str(ROOT / "pyproject.toml")).config.run_include or [])
