"""Package metadata that fits the hosts: every requirement of pyproject.toml (base and every
extra) is a range that holds what veRL's, OpenRLHF's and megatron-core's GPU stacks pin
(tests/data/host_pins.json, recorded from the real wheels by scripts/host_pins.py), and the
docs give each host's GPU install as one command that this check covers.

Offline and fast. The same install lines through pip's real resolver need the registry and
minutes: ``CPPO_RESOLVER_TESTS=1 CPPO_RESOLVER_PYTHON=/path/to/python3.12`` runs them
(``test_documented_installs_resolve``), as ``python scripts/host_pins.py resolve`` does.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import re
import subprocess
import sys

import pytest
from packaging.specifiers import SpecifierSet

from tests import host_pins as hp

DATA = hp.load_data()
HOSTS = list(DATA["hosts"])
DOCS = ("README.md", "docs/integrations/verl.md", "docs/integrations/openrlhf.md")


def _script():
    spec = importlib.util.spec_from_file_location("host_pins_script", hp.ROOT / "scripts" / "host_pins.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SCRIPT = _script()


def test_no_exact_pin_in_the_package_metadata():
    assert hp.exact_pins() == [], "exact pins belong in constraints/cpu-venv.txt, ranges in pyproject.toml"


@pytest.mark.parametrize("host", HOSTS)
def test_metadata_fits_the_hosts_pins(host):
    found = hp.conflicts(host, DATA)
    assert not found, "our metadata conflicts with the host's GPU pins:\n  " + "\n  ".join(map(str, found))


def test_planted_exact_pin_fails_naming_the_package():
    project = hp.pyproject()
    planted = copy.deepcopy(project)
    verl = planted["project"]["optional-dependencies"]["verl"]
    verl[:] = [line for line in verl if not line.startswith("fastapi")] + ["fastapi==0.165.0"]
    assert hp.exact_pins(planted) == ["extra 'verl': fastapi==0.165.0"]
    found = hp.conflicts("verl[vllm]==0.9.1", DATA, planted)
    assert {c.package for c in found} == {"fastapi"}
    text = "\n".join(map(str, found))
    # the package, our specifier, the host's (vLLM 0.24.0's line and what the host's install resolves)
    assert "fastapi: ours 'fastapi==0.165.0' (extra 'verl')" in text
    assert "'fastapi[standard]<0.137.0,>=0.133.0' (Requires-Dist of vllm 0.24.0)" in text
    assert "resolves fastapi 0.136.3" in text
    # OpenRLHF's vLLM 0.29.0 bounds fastapi the same way
    assert {c.package for c in hp.conflicts("openrlhf[vllm]==0.11.2", DATA, planted)} == {"fastapi"}


def test_markers_are_evaluated_for_the_hosts_python():
    """A pin that only applies below Python 3.12 does not bind a 3.12 host; one for 3.12 does."""
    project = copy.deepcopy(hp.pyproject())
    extras = project["project"]["optional-dependencies"]
    extras["megatron"] = ["megatron-core==0.16.1; python_version < '3.12'"]
    assert hp.conflicts("megatron-core==0.18.2", DATA, project) == []
    extras["megatron"] = ["megatron-core==0.16.1; python_version >= '3.12'"]
    assert [c.package for c in hp.conflicts("megatron-core==0.18.2", DATA, project)] == ["megatron-core"]


def test_extras_are_followed_through_the_hosts_lines():
    """verl[vllm] asks for verl[verl-core]: its TransferQueue bound binds; lines of extras nobody selects do not."""
    specs = hp.host_specs(DATA["hosts"]["verl[vllm]==0.9.1"], "verl[vllm]==0.9.1")
    assert [s.line for s in specs["transferqueue"] if s.source == "verl 0.9.1"] == ["TransferQueue>=0.1.10; extra == \"verl-core\""]
    assert {s.line for s in specs["torch"]} == {"==2.11.0", "torch==2.11.0; extra == \"vllm\"", "torch==2.11.0"}
    # megatron-core is asked for by verl's `megatron` and `cpu` extras only, neither of which vllm selects
    assert "megatron-core" not in specs


@pytest.mark.parametrize("a, b, meets", [
    (">=0.115", ">=0.133.0,<0.137.0", True),
    ("==0.165.0", ">=0.133.0,<0.137.0", False),
    (">=5.5.3,<5.20", "==5.15.0", True),
    (">=5.5.3,<5.20", "!=5.6.0,<5.11,>=5.5.3", True),
    ("<5.11", ">=5.11", False),
    ("<=0.10.0", ">0.10.0", False),
    (">0.9.1,<0.9.2", "==0.9.1", False),
    ("~=0.8", "<0.8", False),
    ("!=1.0", "==1.0", False),
    ("", "==2.11.0", True),
])
def test_intersects(a, b, meets):
    assert hp.intersects(SpecifierSet(a), SpecifierSet(b)) is meets


def test_data_holds_the_hosts_named_pins_and_its_source():
    assert DATA["recorded"] and "Requires-Dist" in DATA["source"] and "--dry-run" in DATA["source"]
    assert set(HOSTS) == set(SCRIPT.HOSTS)
    for host, entry in DATA["hosts"].items():
        assert entry["python"].startswith("3.12"), host  # the GPU images' Python
    r = DATA["hosts"]["verl[vllm]==0.9.1"]["resolved"]
    assert (r["verl"], r["torch"], r["vllm"], r["transformers"]) == ("0.9.1", "2.11.0", "0.24.0", "5.9.0")
    o = DATA["hosts"]["openrlhf[vllm]==0.11.2"]
    assert (o["resolved"]["vllm"], o["resolved"]["transformers"], o["resolved"]["deepspeed"], o["resolved"]["ray"]) == (
        "0.29.0", "5.15.0", "0.19.6", "2.55.0")
    # flash-attn's CUDA sdist cannot give its metadata here: a stand-in wheel declares the sdist's own lines
    assert o["standins"] == {"flash-attn 2.8.3": ["torch", "einops"]} and o["resolved"]["flash-attn"] == "2.8.3"
    assert "flash-attn==2.8.3" in o["requires_dist"]["openrlhf 0.11.2"]
    # veRL 0.9.1's own sglang extra does not resolve (sglang 0.5.12 pins transformers 5.6.0, which
    # verl excludes): checked against its Requires-Dist lines only
    s = DATA["hosts"]["verl[sglang]==0.9.1"]
    assert s["resolved"] is None and "transformers==5.6.0" in s["requires_dist"]["sglang 0.5.12"]
    mcore = [h for h in HOSTS if h.startswith("megatron-core")]
    assert len(mcore) >= 3  # one per 3.12-only minor release (0.17, 0.18, 0.19)


def _documented_installs() -> dict[str, list[str]]:
    """host -> the documented GPU install lines `pip install "HOST" "cppo-megatron[...]"`."""
    found: dict[str, list[str]] = {}
    pattern = re.compile(r"""pip install ["']([^"']+)["'] ["'](cppo-megatron\[[^"']+\])["']""")
    for doc in DOCS:
        for line in (hp.ROOT / doc).read_text().splitlines():
            m = pattern.search(line)
            if m:
                found.setdefault(m.group(1), []).append(f"{doc}: {m.group(2)}")
    return found


def test_docs_give_each_host_one_install_command_that_the_check_covers():
    shown = _documented_installs()
    for host, spec in SCRIPT.HOST_INSTALLS.items():
        assert host in shown, f"no doc shows the GPU install of {host} ({spec['ours']})"
        assert all(line.endswith(spec["ours"]) for line in shown[host]), (host, shown[host])
        assert host in DATA["hosts"], host  # its pins are recorded, so test_metadata_fits_the_hosts_pins checks it
        extras = spec["ours"].split("[", 1)[1].rstrip("]").split(",")
        assert set(extras) <= set(hp.pyproject()["project"]["optional-dependencies"]), extras
    assert set(shown) <= set(SCRIPT.HOST_INSTALLS), f"a documented install the check does not know: {set(shown)}"


@pytest.mark.skipif(os.environ.get("CPPO_RESOLVER_TESTS") != "1",
                    reason="pip's resolver against PyPI takes minutes: CPPO_RESOLVER_TESTS=1 runs it")
def test_documented_installs_resolve():
    python = os.environ.get("CPPO_RESOLVER_PYTHON", sys.executable)
    out = subprocess.run([sys.executable, str(hp.ROOT / "scripts" / "host_pins.py"), "resolve", "--python", python],
                         capture_output=True, text=True, timeout=3600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
