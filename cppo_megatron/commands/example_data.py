"""Write a small GSM8K-format data set (train.jsonl, test.jsonl) to try bring-your-own data.

  cppo-megatron example-data DIR
  cppo-megatron train recipes/byod_gsm8k_cpu.yaml task.path=DIR/train.jsonl task.test_path=DIR/test.jsonl

Rows are short arithmetic word problems generated offline, with the fields a real GSM8K
file has: {"question": "Mia has 23 pens. Mia gets 45 more. How many pens now?",
"answer": "23+45=68\\n#### 68"}. Train and test questions are disjoint. Swap in your own
GSM8K files in the train command (docs/trainer.md, Bring your own).
"""

from __future__ import annotations

import argparse


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out_dir", help="directory to write train.jsonl and test.jsonl into (created)")
    parser.add_argument("--train-size", type=int, default=4000, help="training rows (default 4000)")
    parser.add_argument("--test-size", type=int, default=500, help="held-out rows (default 500)")
    parser.add_argument("--seed", type=int, default=0, help="decides every row (default 0)")


def run(args: argparse.Namespace) -> int:
    from ..tasks.word_problems import write_gsm8k_example

    train, test = write_gsm8k_example(args.out_dir, train_size=args.train_size, test_size=args.test_size,
                                      seed=args.seed)
    print(f"wrote {args.train_size} rows to {train} and {args.test_size} rows to {test} (GSM8K format)")
    return 0
