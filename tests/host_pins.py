"""Our package metadata against the hosts' GPU pins (tests/data/host_pins.json), offline.

The data holds, per host install (``verl[vllm]==0.9.1``, ...), what pip resolved for the host
alone on Python 3.12 and the raw ``Requires-Dist`` lines of the host's own distributions, read
from the real wheels on PyPI by ``python scripts/host_pins.py record`` (its ``source`` and
``recorded`` fields say how and when). ``conflicts(host)`` names every requirement of ours
(base and every extra, markers evaluated for the host's Python) that the host's pins exclude:
the version the host's own install resolves must satisfy our specifier, and our specifier must
intersect each specifier the host's distributions put on the same package.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "host_pins.json"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def load_data(path: Path = DATA) -> dict:
    return json.loads(path.read_text())


def pyproject(path: Path = ROOT / "pyproject.toml") -> dict:
    import tomllib

    return tomllib.loads(path.read_text())


def our_requirements(project: dict | None = None) -> list[tuple[str, Requirement]]:
    """(where, requirement) for the base dependencies and every extra of pyproject.toml."""
    project = (project or pyproject())["project"]
    out = [("dependencies", Requirement(line)) for line in project.get("dependencies", [])]
    for extra, lines in project.get("optional-dependencies", {}).items():
        out += [(f"extra {extra!r}", Requirement(line)) for line in lines]
    return out


def environment(python: str, extra: str = "") -> dict[str, str]:
    """The marker environment of a Linux x86-64 GPU image with this Python."""
    v = Version(python)
    return {"python_version": f"{v.major}.{v.minor}", "python_full_version": str(v), "sys_platform": "linux",
            "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
            "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": extra}


def applies(marker: Marker | None, python: str, extras: set[str] | frozenset[str] = frozenset()) -> bool:
    if marker is None:
        return True
    return any(marker.evaluate(environment(python, e)) for e in {"", *extras})


def _near(version: str) -> list[Version]:
    """``version``, a version just above it and one just below it: the points where two
    specifier sets' intervals can meet."""
    try:
        v = Version(version.rstrip(".*").rstrip("."))
    except InvalidVersion:
        return []
    rel = v.release
    out = [v, Version(".".join(map(str, (*rel, 0, 0, 1))))]
    nonzero = [i for i, part in enumerate(rel) if part]
    if nonzero:
        i = nonzero[-1]
        out.append(Version(".".join(map(str, (*rel[:i], rel[i] - 1, 99999)))))
    return out


def intersects(a: SpecifierSet, b: SpecifierSet) -> bool:
    """Whether some version satisfies both sets. Exact for pins (``==X``), for intervals and
    exclusions: a non-empty intersection holds one of its bounds or a point next to one."""
    candidates = {Version("0"), Version("99999")}
    for spec in (*a, *b):
        candidates.update(_near(spec.version))
    return any(a.contains(v, prereleases=True) and b.contains(v, prereleases=True) for v in candidates)


@dataclass(frozen=True)
class HostSpec:
    source: str  # "verl 0.9.1" (a Requires-Dist line) or "resolved" (the host's own install)
    specifier: SpecifierSet
    line: str


@dataclass(frozen=True)
class Conflict:
    package: str
    where: str  # our extra
    ours: str  # our requirement line
    host: str
    theirs: str  # the host's specifier and where it comes from

    def __str__(self) -> str:
        return f"{self.host}: {self.package}: ours {self.ours!r} ({self.where}), the host's {self.theirs}"


def host_specs(entry: dict, host: str) -> dict[str, list[HostSpec]]:
    """package -> the constraints the host puts on it: the version its own install resolves
    (when it resolves) and each applicable Requires-Dist line of its recorded distributions.
    Extras are followed from the host's install line (``verl[vllm]`` -> vllm, and the verl-core
    extra it asks for) through the recorded distributions."""
    python = entry["python"]
    dists = {}
    for key, lines in entry["requires_dist"].items():
        name, _, version = key.partition(" ")
        dists[canonical(name)] = (key, [Requirement(line) for line in lines])
    wanted: dict[str, set[str]] = {d: set() for d in dists}
    root = Requirement(host)
    wanted.setdefault(canonical(root.name), set()).update(root.extras)
    changed = True
    while changed:  # extras asking for other extras (verl[vllm] -> verl[verl-core])
        changed = False
        for dist, (_, reqs) in dists.items():
            for req in reqs:
                target = canonical(req.name)
                if target in wanted and applies(req.marker, python, wanted[dist]) and not req.extras <= wanted[target]:
                    wanted[target] |= req.extras
                    changed = True
    out: dict[str, list[HostSpec]] = {}
    for name, version in (entry.get("resolved") or {}).items():
        out.setdefault(canonical(name), []).append(HostSpec("resolved", SpecifierSet(f"=={version}"), f"=={version}"))
    for dist, (key, reqs) in dists.items():
        for req in reqs:
            if req.specifier and applies(req.marker, python, wanted[dist]):
                out.setdefault(canonical(req.name), []).append(HostSpec(key, req.specifier, str(req)))
    return out


def conflicts(host: str, data: dict | None = None, project: dict | None = None) -> list[Conflict]:
    """Every requirement of ours that ``host``'s pins exclude (empty: our metadata fits it)."""
    data = data or load_data()
    entry = data["hosts"][host]
    specs = host_specs(entry, host)
    out = []
    for where, req in our_requirements(project):
        if not applies(req.marker, entry["python"]):
            continue
        for spec in specs.get(canonical(req.name), []):
            if spec.source == "resolved":
                version = Version(str(spec.specifier).lstrip("="))
                ok = req.specifier.contains(version, prereleases=True)
                theirs = f"install resolves {req.name} {version} on Python {entry['python']}"
            else:
                ok = intersects(req.specifier, spec.specifier)
                theirs = f"{spec.line!r} (Requires-Dist of {spec.source})"
            if not ok:
                out.append(Conflict(canonical(req.name), where, str(req), host, theirs))
    return out


def exact_pins(project: dict | None = None) -> list[str]:
    """Requirements of pyproject.toml that pin one version (``==``/``===``): none may."""
    return [f"{where}: {req}" for where, req in our_requirements(project)
            if any(s.operator in ("==", "===") for s in req.specifier)]
