"""List the shipped recipes: one line each with the command that runs it, the model, the layout
and the cluster size. They come with the package (a wheel carries a copy of the repository's
recipes/), so any command that takes a recipe file also takes its name:

  cppo-megatron recipes                      (every recipe and --cpu override file)
  cppo-megatron recipes --host verl          (only veRL's)
  cppo-megatron recipes --show qwen2.5-7b-math-megatron-cppo --host verl   (print the file)
  cppo-megatron verl qwen2.5-7b-math-megatron-cppo --cppo-dry-run          (run one by name)
"""

from __future__ import annotations

import argparse
import json


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", choices=("train", "verl", "openrlhf"), default=None,
                        help="only the recipes of this command (train: the embedded trainer)")
    parser.add_argument("--json", action="store_true", help="one JSON object per line instead of the table")
    parser.add_argument("--paths", action="store_true", help="add each file's path (where this install keeps it)")
    parser.add_argument("--show", metavar="NAME", default=None,
                        help="print one recipe file (by name or path; --host picks the folder when the name is in "
                             "several)")


def run(args: argparse.Namespace) -> int:
    from .. import recipes

    if args.show:
        path = recipes.resolve(args.show, host=args.host)
        print(f"# {path}")
        print(path.read_text(), end="")
        return 0
    rows = recipes.catalogue(args.host)
    if args.json:
        for r in rows:
            print(json.dumps({"name": r.name, "host": r.host, "kind": r.kind, "model": r.model, "layout": r.layout,
                              "cluster": r.cluster, "path": str(r.path)}))
        return 0
    header = ("NAME", "HOST", "MODEL", "LAYOUT", "CLUSTER") + (("PATH",) if args.paths else ())
    table = [(r.name, r.host, r.model, r.layout, r.cluster) + ((str(r.path),) if args.paths else ()) for r in rows]
    widths = [max(len(str(row[i])) for row in [header, *table]) for i in range(len(header))]
    for row in [header, *table]:
        print("  ".join(str(cell).ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    print(f"\n{len(rows)} files in {recipes.root()}; run one with `cppo-megatron HOST NAME` "
          "(train, verl or openrlhf; an override file goes after --cpu)")
    return 0
