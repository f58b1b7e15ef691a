"""Local data sets in the formats users already have on disk.

- GSM8K format: jsonl/parquet rows with ``question`` and ``answer``, the answer ending in
  ``#### <number>`` (the reasoning before it becomes the warm-up target).
- MATH format: rows with ``problem`` and ``solution`` containing ``\\boxed{...}`` (or an
  ``answer`` field). Answers are compared with math-verify when it is installed, else
  numerically / textually.

A malformed row is an error naming the file and line.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

from .answers import answers_match, extract_answer, last_boxed
from .base import Problem, Score, Task


def _rows(path: Path) -> Iterator[tuple[int, dict]]:
    if not path.exists():
        raise FileNotFoundError(f"data file {path} does not exist")
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as exc:
            raise ImportError("reading parquet needs pyarrow: pip install 'cppo-megatron[data]'") from exc
        for i, row in enumerate(pq.read_table(path).to_pylist(), start=1):
            yield i, row
        return
    if path.suffix not in (".jsonl", ".json"):
        raise ValueError(f"{path}: unsupported file type {path.suffix!r}; use .jsonl or .parquet")
    with path.open(encoding="utf-8") as fh:
        for i, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{i}: not valid JSON ({exc.msg})") from exc
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{i}: expected a JSON object, got {type(row).__name__}")
            yield i, row


def load_gsm8k(path: str | Path) -> list[Problem]:
    path = Path(path)
    out = []
    for i, row in _rows(path):
        if "question" not in row or "answer" not in row:
            raise ValueError(f"{path}:{i}: GSM8K rows need 'question' and 'answer' fields, got {sorted(row)}")
        answer_text = str(row["answer"])
        if "####" not in answer_text:
            raise ValueError(f"{path}:{i}: GSM8K answer has no '#### <number>' final answer: {answer_text[-60:]!r}")
        reasoning, final = answer_text.rsplit("####", 1)
        final = final.strip().replace(",", "")
        if not final:
            raise ValueError(f"{path}:{i}: empty final answer after '####'")
        out.append(Problem(str(row["question"]), final, {"line": i, "reasoning": reasoning.strip()}))
    if not out:
        raise ValueError(f"{path}: no problems found")
    return out


def load_math(path: str | Path) -> list[Problem]:
    path = Path(path)
    out = []
    for i, row in _rows(path):
        if "problem" not in row:
            raise ValueError(f"{path}:{i}: MATH rows need a 'problem' field, got {sorted(row)}")
        answer = row.get("answer")
        solution = str(row.get("solution", ""))
        if answer is None:
            answer = last_boxed(solution)
        if answer is None or str(answer).strip() == "":
            raise ValueError(f"{path}:{i}: no answer: give an 'answer' field or a \\boxed{{}} in 'solution'")
        out.append(Problem(str(row["problem"]), str(answer).strip(), {"line": i, "reasoning": solution}))
    if not out:
        raise ValueError(f"{path}: no problems found")
    return out


def score_math(completion: str, problem: Problem) -> Score:
    predicted, formatted = extract_answer(completion)
    correct = answers_match(predicted, problem.answer)
    if not correct and predicted is not None:
        correct = _math_verify(predicted, problem.answer)
    return Score(correct=1.0 if correct else 0.0, formatted=1.0 if formatted else 0.0)


def _math_verify(predicted: str, reference: str) -> bool:
    try:
        import math_verify
    except ImportError:
        return False
    try:
        return bool(math_verify.verify(math_verify.parse(f"${reference}$"), math_verify.parse(f"${predicted}$")))
    except Exception:  # noqa: BLE001 - an unparsable answer is simply wrong
        return False


def file_task(kind: str, path: str, *, test_path: str | None, test_size: int, seed: int) -> Task:
    """A task from a local file; without ``test_path`` a seeded ``test_size`` split is held out."""
    loader = load_gsm8k if kind == "gsm8k" else load_math
    problems = loader(path)
    if test_path:
        train, test = problems, loader(test_path)
    else:
        if len(problems) <= test_size:
            raise ValueError(f"{path}: {len(problems)} problems, not enough to hold out test_size={test_size}")
        order = list(range(len(problems)))
        random.Random(seed).shuffle(order)
        test = [problems[i] for i in order[:test_size]]
        train = [problems[i] for i in order[test_size:]]
    if kind == "gsm8k":
        target = lambda p: f"{p.meta.get('reasoning', '')}\n#### {p.answer}".strip()  # noqa: E731
    else:
        target = lambda p: f"\\boxed{{{p.answer}}}"  # noqa: E731
    return Task(kind, train, test, score_math, target, description=str(path))
