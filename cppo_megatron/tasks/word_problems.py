"""Short arithmetic word problems written as GSM8K-format rows, generated offline.

A stand-in for a user's own GSM8K file: ``question`` is one or two sentences, ``answer``
is the worked sum and the final answer after ``####`` exactly as GSM8K writes it::

    {"question": "Mia has 23 pens. She gets 45 more. How many pens now?",
     "answer": "23+45=68\\n#### 68"}

The problems are sized so a from-scratch byte-level model learns them on a CPU in
minutes (recipes/byod_gsm8k_cpu.yaml): two operands, + or -, answers >= 0. Train and test
rows are disjoint (a question's text decides its split, as in the arithmetic task).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from .base import draw_split

NAMES = ("Mia", "Tom", "Ana", "Sam", "Lea", "Max", "Ivy", "Ben")
ITEMS = ("pens", "cards", "apples", "stamps", "shells", "coins")
# (template, op): {n} name, {i} items, {a} {b} operands; "-" templates need a >= b
TEMPLATES = (
    ("{n} has {a} {i}. {n} gets {b} more. How many {i} now?", "+"),
    ("A box has {a} {i}. {n} adds {b}. How many {i} are in it?", "+"),
    ("{n} had {a} {i} and gave away {b}. How many are left?", "-"),
    ("{n} had {a} {i}, then lost {b}. How many {i} remain?", "-"),
)


def word_problem_rows(*, train_size: int, test_size: int, seed: int = 0,
                      min_operand: int = 10, max_operand: int = 99) -> tuple[list[dict], list[dict]]:
    """(train rows, test rows), each row ``{"question": str, "answer": "a+b=c\\n#### c"}``.

    Every question appears once; train and test share none. Seeded: the same arguments
    give the same rows.
    """
    for key, value in (("train_size", train_size), ("test_size", test_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"word problems: {key} must be an integer >= 1, got {value!r}")
    if not 0 <= min_operand <= max_operand:
        raise ValueError(f"word problems: need 0 <= min_operand <= max_operand, got {min_operand}, {max_operand}")
    span = max_operand - min_operand + 1
    # "-" templates only draw a >= b: about half the operand pairs
    space = len(NAMES) * len(ITEMS) * len(TEMPLATES) * span * (span + 1) // 2
    if train_size + test_size > space // 2:
        raise ValueError(f"word problems: train_size + test_size = {train_size + test_size} is more than half of "
                         f"the {space} distinct problems; lower the sizes or widen the operand range")
    test_fraction = min(0.5, 1.5 * test_size / (train_size + test_size))

    def draw(rng: random.Random) -> tuple[str, dict]:
        template, op = rng.choice(TEMPLATES)
        a, b = rng.randint(min_operand, max_operand), rng.randint(min_operand, max_operand)
        if op == "-" and a < b:
            a, b = b, a
        question = template.format(n=rng.choice(NAMES), i=rng.choice(ITEMS), a=a, b=b)
        result = a + b if op == "+" else a - b
        return question, {"question": question, "answer": f"{a}{op}{b}={result}\n#### {result}"}

    train, test = draw_split(seed, train_size, test_size, test_fraction, draw,
                             exhausted="word problems: could not draw enough distinct problems; lower the sizes or "
                                       "widen the operand range")
    return train, test


def write_gsm8k_example(out_dir: str | Path, *, train_size: int = 4000, test_size: int = 500,
                        seed: int = 0) -> tuple[Path, Path]:
    """Write ``out_dir/train.jsonl`` and ``out_dir/test.jsonl`` (GSM8K format); their paths."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"{out} is a file; give a directory to write train.jsonl and test.jsonl into")
    train, test = word_problem_rows(train_size=train_size, test_size=test_size, seed=seed)
    out.mkdir(parents=True, exist_ok=True)
    paths = out / "train.jsonl", out / "test.jsonl"
    for path, rows in zip(paths, (train, test), strict=True):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return paths
