#!/usr/bin/env python3
"""The hosts' GPU pins, read from the registry, and pip's answer to our install lines next to them.

    python scripts/host_pins.py record  [--python PY312] [--out tests/data/host_pins.json] [HOST ...]
    python scripts/host_pins.py resolve [--python PY312] [HOST ...]

``record`` runs pip's resolver in ``--dry-run --ignore-installed --report`` mode on each host's own
install (``verl[vllm]==0.9.1``, ``verl[sglang]==0.9.1``, ``openrlhf[vllm]==0.11.2``, megatron-core's
Python 3.12 releases) and keeps, per host, what it resolved (name -> version) and the raw
``Requires-Dist`` lines of the host's own distributions (verl, vllm, sglang, openrlhf, deepspeed,
megatron-core) as pip read them from the real wheels' METADATA on PyPI. tests/test_host_pins.py
compares our pyproject.toml against that file offline; re-record when a host moves. OpenRLHF pins
flash-attn 2.8.3, an sdist whose metadata step needs torch and CUDA: it resolves with a stand-in
wheel declaring the sdist's own Requires-Dist (torch, einops), noted as ``standins`` in the data.

``resolve`` runs the documented GPU install of each host (``HOST_INSTALLS``, the lines the docs
show: the host's pins and ``cppo-megatron[extras]`` from this clone) through pip's resolver, prints
what it keeps of the host's key pins and the seconds it took, and exits 1 when one fails.
Both need the registry (minutes; run by hand or with CPPO_RESOLVER_TESTS=1, never in CI).

``--python`` is the interpreter whose pip resolves (default: this one); the hosts' images run
Python 3.12, so give a 3.12 one (e.g. ``python3.12 -m venv /tmp/py312`` and its bin/python). pip runs
with no configuration file and PyPI as the only index, so a machine's local mirrors and caps on
torch do not change the answer.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "tests" / "data" / "host_pins.json"
INDEX = "https://pypi.org/simple"

# host -> how to resolve its own install, and whose Requires-Dist lines to keep
HOSTS: dict[str, dict] = {
    "verl[vllm]==0.9.1": {"requirements": ["verl[vllm]==0.9.1"], "dists": ["verl", "vllm"]},
    # veRL 0.9.1's sglang extra does not resolve on its own (sglang 0.5.12 pins transformers==5.6.0,
    # which verl 0.9.1 excludes): its lines are read with --no-deps, no resolved set
    "verl[sglang]==0.9.1": {"requirements": ["verl[sglang]==0.9.1"], "dists": ["verl", "sglang"],
                            "no_deps_fallback": ["verl==0.9.1", "sglang==0.5.12"]},
    # flash-attn 2.8.3 is an sdist whose metadata step imports torch (and wants CUDA): pip cannot
    # resolve openrlhf's pins as they are on a machine without them. It resolves with a stand-in wheel
    # for flash-attn that declares what the sdist declares (its PKG-INFO and setup.py: torch, einops)
    "openrlhf[vllm]==0.11.2": {"requirements": ["openrlhf[vllm]==0.11.2"], "dists": ["openrlhf", "vllm", "deepspeed"],
                               "standins": {"flash-attn": ("2.8.3", ["torch", "einops"])}},
    "megatron-core==0.17.1": {"requirements": ["megatron-core==0.17.1"], "dists": ["megatron-core"]},
    "megatron-core==0.18.2": {"requirements": ["megatron-core==0.18.2"], "dists": ["megatron-core"]},
    "megatron-core==0.19.2": {"requirements": ["megatron-core==0.19.2"], "dists": ["megatron-core"]},
}

# the GPU install of each host as the docs give it (tests/test_host_pins.py checks the docs show
# exactly these); `resolve` swaps cppo-megatron for this clone and reports the host's key pins.
# verl[sglang]==0.9.1 has none: it does not resolve on its own (HOSTS), the docs say what to do
HOST_INSTALLS: dict[str, dict] = {
    "verl[vllm]==0.9.1": {"ours": "cppo-megatron[verl,megatron]", "keep": ["torch", "vllm", "verl", "transformers"]},
    "openrlhf[vllm]==0.11.2": {"ours": "cppo-megatron[openrlhf]",
                               "keep": ["torch", "vllm", "openrlhf", "transformers", "deepspeed", "ray"]},
    "megatron-core==0.18.2": {"ours": "cppo-megatron[train,megatron]", "keep": ["torch", "megatron-core", "transformers"]},
}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pip_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_INDEX_URL=INDEX, PIP_DISABLE_PIP_VERSION_CHECK="1",
               PIP_DEFAULT_TIMEOUT="180")
    return env


def dry_run(python: str, args: list[str]) -> tuple[dict | None, str, float]:
    """pip's --dry-run report of ``args`` (None when it fails), its last error lines, seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [python, "-m", "pip", "install", "--dry-run", "--ignore-installed", "-q", "--report", str(report), *args]
        t0 = time.perf_counter()
        out = subprocess.run(cmd, capture_output=True, text=True, env=pip_env())
        seconds = time.perf_counter() - t0
        lines = [ln for ln in (out.stdout + out.stderr).splitlines() if ln.strip() and not ln.startswith("WARNING")]
        if out.returncode != 0 or not report.is_file():
            return None, "\n".join(lines[-25:]), seconds
        return json.loads(report.read_text()), "", seconds


def _metadata(report: dict) -> dict[str, dict]:
    return {canonical(i["metadata"]["name"]): i["metadata"] for i in report["install"]}


def standin_wheels(directory: Path, standins: dict[str, tuple[str, list[str]]]) -> list[str]:
    """Write a metadata-only wheel for each unbuildable sdist (name -> (version, Requires-Dist)) into
    ``directory``; returns the pip options that let the resolver take them (``--find-links``)."""
    import zipfile

    for name, (version, requires) in standins.items():
        dist = f"{name.replace('-', '_')}-{version}"
        meta = "\n".join(["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}",
                          *(f"Requires-Dist: {r}" for r in requires)]) + "\n"
        wheel = "Wheel-Version: 1.0\nGenerator: scripts/host_pins.py\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        with zipfile.ZipFile(directory / f"{dist}-py3-none-any.whl", "w") as zf:
            zf.writestr(f"{dist}.dist-info/METADATA", meta)
            zf.writestr(f"{dist}.dist-info/WHEEL", wheel)
            zf.writestr(f"{dist}.dist-info/RECORD", "")
    return ["--find-links", str(directory)] if standins else []


def record(python: str, out: Path, only: list[str]) -> int:
    old = json.loads(out.read_text()) if only and out.is_file() else {"hosts": {}}
    hosts = dict(old["hosts"])
    for host, spec in HOSTS.items():
        if only and host not in only:
            continue
        reqs = list(spec["requirements"])
        with tempfile.TemporaryDirectory() as tmp:
            standins = spec.get("standins", {})
            report, err, seconds = dry_run(python, [*standin_wheels(Path(tmp), standins), *reqs])
        entry: dict = {"install": reqs, "seconds": round(seconds, 1)}
        if standins:
            entry["standins"] = {f"{name} {version}": requires for name, (version, requires) in standins.items()}
        if report is None:
            entry["resolved"] = None
            entry["resolution_error"] = [ln.strip() for ln in err.splitlines() if ln.strip().startswith(
                ("verl", "sglang", "vllm", "openrlhf", "ERROR", "The conflict"))][:8]
            report, err2, _ = dry_run(python, ["--no-deps", *spec.get("no_deps_fallback", reqs)])
            if report is None:
                sys.exit(f"host_pins: {host}: neither resolved nor readable with --no-deps:\n{err}\n{err2}")
        else:
            entry["resolved"] = dict(sorted((canonical(i["metadata"]["name"]), i["metadata"]["version"])
                                            for i in report["install"]))
        meta = _metadata(report)
        entry["requires_dist"] = {f"{canonical(d)} {meta[canonical(d)]['version']}": meta[canonical(d)].get("requires_dist") or []
                                  for d in spec["dists"] if canonical(d) in meta}
        entry["python"] = report["environment"]["python_full_version"]
        entry["pip"] = report["pip_version"]
        hosts[host] = entry
        state = "resolved" if entry["resolved"] is not None else "did not resolve"
        print(f"host_pins: {host}: {state} in {seconds:.0f} s ({len(entry['resolved'] or {})} packages)", flush=True)
    data = {
        "source": f"pip install --dry-run --ignore-installed --report, index {INDEX} only (no config file): "
                  "resolved versions, and Requires-Dist as pip read it from the wheels' METADATA "
                  "(sdists: as pip built their metadata)",
        "recorded": datetime.date.today().isoformat(),
        "recorder": "python scripts/host_pins.py record",
        "hosts": {h: hosts[h] for h in HOSTS if h in hosts},
    }
    if only and old.get("recorded") not in (None, data["recorded"]):  # a partial re-record keeps the others' date
        data["recorded"] = f"{old['recorded']}, re-recorded {', '.join(only)}: {data['recorded']}"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    print(f"host_pins: wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    return 0


def resolve(python: str, hosts: list[str]) -> int:
    failed = 0
    recorded = json.loads(DEFAULT_OUT.read_text())["hosts"] if DEFAULT_OUT.is_file() else {}
    for host in hosts or list(HOST_INSTALLS):
        spec = HOST_INSTALLS[host]
        if host in recorded and recorded[host].get("resolved") is None:
            why = "; ".join(recorded[host].get("resolution_error", [])[:1])
            print(f"skip {host}: the host's own install does not resolve, without cppo-megatron too "
                  f"(recorded {json.loads(DEFAULT_OUT.read_text())['recorded']}: {why}); the offline check "
                  "compares our ranges with its Requires-Dist instead")
            continue
        extras = spec["ours"].split("[", 1)[1]
        with tempfile.TemporaryDirectory() as tmp:  # flash-attn cannot be built here (HOSTS says why)
            report, err, seconds = dry_run(python, [*standin_wheels(Path(tmp), HOSTS[host].get("standins", {})),
                                                    host, f"{ROOT}[{extras}"])
        shown = f"pip install --dry-run --ignore-installed {host!r} {spec['ours']!r}"
        if report is None:
            failed += 1
            print(f"FAIL {shown} ({seconds:.0f} s):\n{err}")
            continue
        got = {canonical(i["metadata"]["name"]): i["metadata"]["version"] for i in report["install"]}
        keep = ", ".join(f"{k} {got.get(k, '-')}" for k in spec["keep"])
        alone = recorded.get(host, {}).get("resolved") or {}
        moved = sorted(f"{k} {v} -> {got.get(k, 'gone')}" for k, v in alone.items() if got.get(k) != v)
        same = (f"; all {len(alone)} packages of the host's own install kept at its versions" if alone and not moved
                else f"; the host's own install changed: {', '.join(moved)}" if moved else "")
        print(f"ok   {shown}: resolved {len(got)} packages in {seconds:.0f} s, Python "
              f"{report['environment']['python_full_version']}; {keep}; cppo-megatron {got.get('cppo-megatron')}"
              f"{same}; added: {', '.join(sorted(set(got) - set(alone))) if alone else '-'}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["record", "resolve"])
    p.add_argument("hosts", nargs="*", help="only these hosts (default: all; record merges them into the file)")
    p.add_argument("--python", default=sys.executable, help="the interpreter whose pip resolves (the hosts run 3.12)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="record: where the data goes")
    a = p.parse_intermixed_args(argv)
    known = HOSTS if a.what == "record" else HOST_INSTALLS
    unknown = [h for h in a.hosts if h not in known]
    if unknown:
        p.error(f"unknown host(s) {unknown}; choose from {list(known)}")
    if a.what == "record":
        return record(a.python, a.out, a.hosts)
    return resolve(a.python, a.hosts)


if __name__ == "__main__":
    sys.exit(main())
