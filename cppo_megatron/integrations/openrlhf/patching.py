"""``cppo-megatron patch openrlhf``: the CPPO hook as a source patch on an OpenRLHF checkout.

For runs that start OpenRLHF unmodified (``python -m openrlhf.cli.train_ppo_ray`` or
``ray job submit``). The patch (``patches/openrlhf/openrlhf-0.11.2-cppo-hook.patch``)
adds four lines at the end of ``openrlhf/trainer/ppo_utils/experience_maker.py``: when
``$CPPO_OPENRLHF_CONFIG`` is set, ``hook.install_from_env`` wraps
``RemoteExperienceMaker`` as the launcher does; without it the module is unchanged
OpenRLHF. It is applied with GNU ``patch`` to the installed package or to ``--target``.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from .pinned import PINNED_VERSION, check_drift, installed_version, openrlhf_dir

PATCH_NAME = f"openrlhf-{PINNED_VERSION}-cppo-hook.patch"
PATCHED_FILE = "openrlhf/trainer/ppo_utils/experience_maker.py"


def default_patch_file() -> Path:
    """The patch in this checkout's ``patches/openrlhf`` folder."""
    return Path(__file__).resolve().parents[3] / "patches" / "openrlhf" / PATCH_NAME


def default_target() -> Path:
    """The folder holding the installed ``openrlhf`` package (site-packages or a checkout)."""
    return openrlhf_dir().parent


def _patch(target: Path, patch_file: Path, *flags: str) -> subprocess.CompletedProcess:
    exe = shutil.which("patch")
    if exe is None:
        raise RuntimeError("GNU patch is not installed (apt-get install patch)")
    return subprocess.run(
        [exe, "-p1", "--forward", "--batch", "-d", str(target), "-i", str(patch_file), *flags],
        capture_output=True,
        text=True,
        check=False,
    )


def status(target: Path, patch_file: Path) -> str:
    """``applicable``, ``applied`` or ``conflict`` for ``target`` (the folder containing openrlhf/)."""
    if not (target / PATCHED_FILE).is_file():
        raise ValueError(f"{target / PATCHED_FILE} does not exist: --target must contain the openrlhf package")
    if not patch_file.is_file():
        raise ValueError(f"patch file {patch_file} does not exist")
    if _patch(target, patch_file, "--dry-run").returncode == 0:
        return "applicable"
    if _patch(target, patch_file, "--dry-run", "--reverse").returncode == 0:
        return "applied"
    return "conflict"


def apply(target: Path, patch_file: Path, *, reverse: bool = False) -> str:
    """Apply (or with ``reverse`` remove) the patch; returns the status afterwards."""
    state = status(target, patch_file)
    wanted = "applicable" if reverse else "applied"
    if state == wanted:
        return state
    if state == "conflict":
        raise RuntimeError(f"the patch does not apply to {target / PATCHED_FILE} (OpenRLHF {installed_version()}?)")
    result = _patch(target, patch_file, *(["--reverse"] if reverse else []), "--no-backup-if-mismatch")
    if result.returncode != 0:
        raise RuntimeError(f"patch failed: {result.stdout}{result.stderr}")
    return status(target, patch_file)


def run_patch(action: str, target: str | None = None, patch_file: str | None = None) -> int:
    """The ``cppo-megatron patch openrlhf`` command: action is check, apply or revert."""
    root = Path(target) if target else default_target()
    pfile = Path(patch_file) if patch_file else default_patch_file()
    version = installed_version()
    print(f"OpenRLHF {version or 'not installed'} (pinned {PINNED_VERSION}); target {root / PATCHED_FILE}")
    if target is None:
        drift = check_drift()
        for line in drift:
            print(f"drift: {line}")
        if drift:
            print("the hooked OpenRLHF code differs from the pinned version: check the hook before relying on it")
    if action == "check":
        state = status(root, pfile)
        print(f"patch {pfile.name}: {state}")
        return 0 if state in ("applicable", "applied") else 1
    state = apply(root, pfile, reverse=(action == "revert"))
    print(f"patch {pfile.name}: {state}")
    if state == "applied":
        print("set CPPO_OPENRLHF_CONFIG in the Ray workers' environment to turn CPPO on "
              "(see docs/integrations/openrlhf.md)")
    return 0
