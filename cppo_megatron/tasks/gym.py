"""reasoning-gym generators (extra ``data``): ``gsm_symbolic`` (100 GSM8K templates) and
any other procedural dataset it ships, with its own answer checker."""

from __future__ import annotations

from .._optional import require
from .answers import extract_answer
from .base import Problem, Score, Task


def gym_task(name: str, *, train_size: int, test_size: int, seed: int) -> Task:
    rg = require("reasoning_gym", f"the reasoning-gym task {name!r}")
    try:
        train_ds = rg.create_dataset(name, size=train_size, seed=seed)
        test_ds = rg.create_dataset(name, size=test_size, seed=seed + 1_000_003)
    except Exception as exc:  # noqa: BLE001 - reasoning-gym raises various types for bad names
        raise ValueError(f"reasoning-gym has no usable dataset {name!r}: {exc}") from exc

    def problems(ds) -> list[Problem]:
        return [Problem(e["question"], str(e["answer"]), {"entry": e}) for e in ds]

    train, test = problems(train_ds), problems(test_ds)
    train_text = {p.question for p in train}
    test = [p for p in test if p.question not in train_text] or test

    def score(completion: str, problem: Problem) -> Score:
        predicted, formatted = extract_answer(completion)
        if predicted is None:
            return Score(0.0, 0.0)
        value = float(test_ds.score_answer(predicted, problem.meta["entry"]))
        return Score(correct=1.0 if value >= 1.0 else 0.0, formatted=1.0 if formatted else 0.0)

    def target(p: Problem) -> str:
        cot = p.meta["entry"].get("metadata", {}).get("answer_cot")
        return f"{cot}\n<answer>{p.answer}</answer>" if cot else f"<answer>{p.answer}</answer>"

    return Task(f"reasoning_gym:{name}", train, test, score, target, description=f"reasoning-gym {name}")
