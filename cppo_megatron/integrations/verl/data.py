"""Our tasks as veRL parquet files (``data.train_files`` / ``data.val_files``).

veRL's RL dataset reads one row per prompt: ``data_source`` (which scorer), ``prompt`` (chat
messages; veRL applies the tokenizer's chat template), ``ability``, ``reward_model``
(``{"style": "rule", "ground_truth": answer}``) and ``extra_info`` (split, index; and the
question where the scorer grades steps against it: the worked-arithmetic task). The
prompts are the embedded trainer's (``task.prompt_template`` applied), so a model exported
from its warm-up sees in veRL exactly what it was trained on.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .reward import DATA_SOURCE, NEEDS_QUESTION, data_source_for

__all__ = ["VerlData", "task_rows", "write_task_parquet"]


@dataclass(frozen=True)
class VerlData:
    """The files written and their row counts."""

    train: Path
    test: Path
    train_rows: int
    test_rows: int


def task_rows(problems, split: str, prompt_template: str = "{question}", data_source: str = DATA_SOURCE) -> list[dict]:
    """veRL rows for ``problems`` (``tasks.Problem``), in order."""
    if split not in ("train", "test"):
        raise ValueError(f"task_rows: split must be 'train' or 'test', got {split!r}")
    with_question = data_source in NEEDS_QUESTION
    return [
        {
            "data_source": data_source,
            "prompt": [{"role": "user", "content": prompt_template.format(question=p.question)}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(p.answer)},
            "extra_info": {"split": split, "index": i, **({"question": p.question} if with_question else {})},
        }
        for i, p in enumerate(problems)
    ]


def write_task_parquet(task, out_dir: str | Path, *, prompt_template: str = "{question}",
                       test_rows: int | None = None) -> VerlData:
    """Write ``task``'s train and test problems as ``OUT_DIR/train.parquet`` and
    ``OUT_DIR/test.parquet`` (the first ``test_rows`` test problems when given)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        source = data_source_for(task.name)
    except ValueError as exc:
        raise ValueError(f"write_task_parquet: {exc}") from None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    test = list(task.test)[: test_rows] if test_rows else list(task.test)
    paths = {}
    for split, problems in (("train", list(task.train)), ("test", test)):
        path = out / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(task_rows(problems, split, prompt_template, source)), path)
        paths[split] = path
    return VerlData(paths["train"], paths["test"], len(task.train), len(test))
