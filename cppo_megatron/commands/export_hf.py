"""Export an embedded-trainer model as an HF model directory (config, safetensors, tokenizer).

  cppo-megatron export-hf runs/tiny_cpu/warmup.pt runs/verl_tiny/model
  cppo-megatron export-hf runs/tiny_cpu/checkpoints/step_000040 OUT --recipe recipes/tiny_cpu.yaml

The run's recipe (RUN_DIR/recipe.yaml, written by `cppo-megatron train`) rebuilds the model
and its character tokenizer; the export maps that tokenizer to a real HF tokenizer with the
same ids (byte-level BPE, a chat template that renders the prompt the trainer used), so veRL,
vLLM or transformers load the directory with `from_pretrained`. docs/integrations/verl.md.
"""

from __future__ import annotations

import argparse
import sys

from ..recipes import arg_type as recipe_arg


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="RUN_DIR/warmup.pt, RUN_DIR/final.pt or RUN_DIR/checkpoints/step_NNNNNN")
    parser.add_argument("out_dir", help="directory to write (created; files in it are overwritten)")
    parser.add_argument("--recipe", default=None, type=recipe_arg("train"),
                        help="the run's recipe (default: recipe.yaml beside the checkpoint or its run directory)")


def run(args: argparse.Namespace) -> int:
    from ..trainer.export import export_run

    try:
        res = export_run(args.checkpoint, args.out_dir, recipe_path=args.recipe)
    except (FileNotFoundError, ValueError, TypeError) as exc:
        print(f"cppo-megatron export-hf: {exc}", file=sys.stderr)
        return 2
    added = f"; added {', '.join(repr(t) for t in res.added_tokens)}" if res.added_tokens else ""
    print(f"exported {res.num_parameters:,} parameters, vocabulary {res.vocab_size}{added} -> {res.out_dir}")
    return 0
