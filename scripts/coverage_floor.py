#!/usr/bin/env python3
"""Branch coverage of the modules every branch of which a test must reach, against a floor per module.

The modules are those [tool.coverage.run] ``include`` names in pyproject.toml (core/, trainer/,
megatron/, the hosts' hooks, preflights, accounting, sizing, the watchdog and ``wrap``). The
coverage data comes from a pytest run with ``--cov`` (scripts/test.sh measures its foreground
pytest); the floor lives in tests/coverage_floor.json, one number per module: coverage.py's
percent with branches ((lines run + branches taken) / (lines + branches)).

    python scripts/coverage_floor.py                 # check: exit 1 naming each module below its floor
    python scripts/coverage_floor.py --write         # raise the floors to what this data measured
    python scripts/coverage_floor.py --write --allow-lower  # also lower them (say why in the commit)
    python scripts/coverage_floor.py --data FILE     # another data file (default: $COVERAGE_FILE or .coverage)

A floor only rises: ``--write`` keeps a module's old floor where this run measured less, unless
``--allow-lower``. A module in scope without a floor (a new file) fails the check until
``--write`` adds it; a floor whose module is gone fails it until ``--write`` drops it. A module
whose branches depend on timing (a poll loop that may or may not go round once more) has a
``slack`` entry in the file, ``{"points": 1.0, "why": "..."}``: ``--write`` sets its floor that
many points below what it measured, so one run's luck does not fail the next.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLOOR = ROOT / "tests" / "coverage_floor.json"
GROUPS = {  # for the report's subtotals only; the floor is per module
    "core": "cppo_megatron/core/",
    "trainer": "cppo_megatron/trainer/",
    "megatron": "cppo_megatron/megatron/",
    "hosts (hooks, preflights, accounting, sizing, watchdog, wrap)": "cppo_megatron/integrations/",
}
NOTE = ("Branch coverage floor per module (scripts/coverage_floor.py; regenerate with "
        "`python scripts/coverage_floor.py --write` after a full `bash scripts/test.sh`). A floor only rises.")


def in_scope(include: list[str]) -> list[str]:
    """Every module of the package that an ``include`` pattern names, as a path relative to the repo."""
    found = []
    for path in sorted((ROOT / "cppo_megatron").rglob("*.py")):
        if any(fnmatch.fnmatch(str(path), pattern) for pattern in include):
            found.append(path.relative_to(ROOT).as_posix())
    return found


def measure(data_file: Path) -> dict[str, dict]:
    """Per module in scope: lines, branches and what the data says ran; modules no test imported count
    as measured with nothing run."""
    import coverage

    if not data_file.is_file():
        sys.exit(f"coverage_floor: no coverage data at {data_file}: run pytest with --cov first "
                 "(bash scripts/test.sh does), or name the data file with --data")
    cov = coverage.Coverage(data_file=str(data_file), config_file=str(ROOT / "pyproject.toml"))
    cov.load()
    include = list(cov.config.run_include or [])
    if not include:
        sys.exit("coverage_floor: pyproject.toml [tool.coverage.run] names no include patterns")
    modules = in_scope(include)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "coverage.json"
        # morfs: every module in scope, so that one no test imported is reported (all of it missing)
        cov.json_report(morfs=[str(ROOT / m) for m in modules], outfile=str(out), ignore_errors=False)
        files = json.loads(out.read_text())["files"]
    by_rel = {Path(name).resolve().relative_to(ROOT).as_posix(): f for name, f in files.items()}
    result = {}
    for module in modules:
        f = by_rel.get(module)
        if f is None:
            continue  # nothing to measure (an empty __init__.py)
        s = f["summary"]
        result[module] = {
            "lines": s["num_statements"], "lines_run": s["covered_lines"],
            "branches": s.get("num_branches", 0), "branches_taken": s.get("covered_branches", 0),
            "percent": float(s["percent_covered"]),
            "missing_lines": f.get("missing_lines", []),
            "missing_branches": [f"{a}->{'exit' if b < 0 else b}" for a, b in f.get("missing_branches", [])],
        }
    return result


def floor_of(percent: float) -> float:
    """The floor a measurement sets: rounded down to 0.1 (a floor never above what was measured)."""
    return math.floor(percent * 10 + 1e-9) / 10


def report(measured: dict[str, dict], floors: dict[str, float]) -> None:
    print(f"{'module':58} {'branches':>11} {'lines':>11} {'cover':>6} {'floor':>6}")
    for module, m in measured.items():
        fl = floors.get(module)
        print(f"{module:58} {m['branches_taken']:>5}/{m['branches']:<5} {m['lines_run']:>5}/{m['lines']:<5} "
              f"{m['percent']:5.1f}% {'' if fl is None else f'{fl:5.1f}%':>6}")
    for group, prefix in GROUPS.items():
        ms = [m for name, m in measured.items() if name.startswith(prefix)]
        b, bt = sum(m["branches"] for m in ms), sum(m["branches_taken"] for m in ms)
        n, nr = sum(m["lines"] for m in ms), sum(m["lines_run"] for m in ms)
        total = 100.0 * (bt + nr) / max(1, b + n)
        print(f"  {group}: branches {bt}/{b} ({100.0 * bt / max(1, b):.1f}%), with lines {total:.1f}%")


def check(measured: dict[str, dict], floors: dict[str, float]) -> list[str]:
    """One message per module below its floor, without a floor, or with a floor and no longer there."""
    problems = []
    for module, m in measured.items():
        if module not in floors:
            problems.append(f"{module} has no coverage floor (a new module?): give its branches tests, then run "
                            "`python scripts/coverage_floor.py --write`")
        elif floor_of(m["percent"]) < floors[module]:
            unreached = ", ".join(m["missing_branches"][:12] + [f"line {n}" for n in m["missing_lines"][:12]])
            problems.append(f"{module}: branch coverage fell to {m['percent']:.1f}% (floor {floors[module]:.1f}%); "
                            f"not reached: {unreached}. Add a test that reaches them, or, where the code went "
                            "away on purpose, lower the floor with `python scripts/coverage_floor.py --write "
                            "--allow-lower` and say why in the commit")
    for module in floors:
        if module not in measured:
            problems.append(f"{module} has a coverage floor but is no longer in scope or no longer exists: "
                            "run `python scripts/coverage_floor.py --write` to drop it")
    return problems


def write(measured: dict[str, dict], floors: dict[str, float], allow_lower: bool, path: Path,
          slack: dict[str, dict] | None = None) -> None:
    """Write the floors this measurement sets (less each module's slack), keeping a higher old floor
    unless ``allow_lower``; modules no longer measured are dropped."""
    slack = slack or {}
    new = {}
    for module, m in measured.items():
        value = floor_of(m["percent"] - float(slack.get(module, {}).get("points", 0.0)))
        old = floors.get(module)
        if old is not None and value < old:
            if not allow_lower:
                print(f"coverage_floor: kept {module} at {old:.1f}% (measured {value:.1f}%; --allow-lower lowers it)")
                value = old
            else:
                print(f"coverage_floor: LOWERED {module} from {old:.1f}% to {value:.1f}%")
        new[module] = value
    kept_slack = {module: entry for module, entry in slack.items() if module in new}
    path.write_text(json.dumps({"note": NOTE, "floors": new, "slack": kept_slack}, indent=1) + "\n")
    print(f"coverage_floor: wrote {len(new)} floors to {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path(os.environ.get("COVERAGE_FILE", ROOT / ".coverage")),
                        help="coverage data file of a full test run (default: $COVERAGE_FILE, else .coverage)")
    parser.add_argument("--floor", type=Path, default=FLOOR, help="the floor file (default: %(default)s)")
    parser.add_argument("--write", action="store_true", help="raise the floors to this run's measurement")
    parser.add_argument("--allow-lower", action="store_true", help="with --write: also lower floors")
    parser.add_argument("--quiet", action="store_true", help="no per-module table")
    args = parser.parse_args(argv)
    measured = measure(args.data)
    saved = json.loads(args.floor.read_text()) if args.floor.is_file() else {}
    floors, slack = saved.get("floors", {}), saved.get("slack", {})
    if not args.quiet:
        report(measured, floors)
    if args.write:
        write(measured, floors, args.allow_lower, args.floor, slack)
        return 0
    problems = check(measured, floors)
    for p in problems:
        print(f"coverage_floor: {p}", file=sys.stderr)
    if not problems:
        print(f"coverage_floor: {len(measured)} modules at or above their floors ({args.floor})")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
