"""Check, apply or revert the CPPO source patch for a framework whose run you start unmodified.

  cppo-megatron patch openrlhf --check            # applicable / applied / conflict
  cppo-megatron patch openrlhf --apply            # patch the installed OpenRLHF
  cppo-megatron patch openrlhf --apply --target ~/src/OpenRLHF   # or a checkout
  cppo-megatron patch openrlhf --revert

Each framework's patch logic lives in its integration folder
(``cppo_megatron/integrations/<framework>/patching.py``, function ``run_patch``).
"""

from __future__ import annotations

import argparse
import importlib

# framework -> module providing run_patch(action, target=None, patch_file=None) -> int
FRAMEWORKS: dict[str, str] = {
    "openrlhf": "cppo_megatron.integrations.openrlhf.patching",
}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("framework", choices=sorted(FRAMEWORKS), help="which framework's patch")
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--check", dest="action", action="store_const", const="check", help="report whether it applies")
    action.add_argument("--apply", dest="action", action="store_const", const="apply", help="apply it (idempotent)")
    action.add_argument("--revert", dest="action", action="store_const", const="revert", help="remove it")
    parser.add_argument("--target", help="folder containing the framework package (default: the installed one)")
    parser.add_argument("--patch-file", help="patch file (default: the one in patches/<framework>/)")


def run(args: argparse.Namespace) -> int:
    module = importlib.import_module(FRAMEWORKS[args.framework])
    try:
        return int(module.run_patch(args.action, target=args.target, patch_file=args.patch_file))
    except (ValueError, RuntimeError) as exc:
        print(f"cppo-megatron patch {args.framework}: {exc}")
        return 1
