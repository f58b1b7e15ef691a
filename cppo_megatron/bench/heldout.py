"""Greedy held-out accuracy of policy snapshots, one evaluator for every arm of a study
(``bench/verl_study.py``): the snapshots a run's clock kept are graded after the run, the same
way for each arm."""

from __future__ import annotations

import math
from pathlib import Path

__all__ = ["Evaluator"]


class Evaluator:
    """Greedy held-out accuracy of a policy, the same for every arm: the exported model's
    architecture and tokenizer, the prompts veRL builds (the chat template over the task's
    prompt), HF generate with temperature 0, and the reward function veRL trains with
    (``integrations/verl/reward.compute_score``'s ``acc``).

    Args:
        model_dir: the exported start model (architecture, tokenizer, start weights).
        warmup_recipe: the embedded recipe whose task gives the held-out problems.
        problems: how many test problems (the first ones; veRL's test.parquet holds a prefix).
        max_new_tokens: ``data.max_response_length`` of the runs.
    """

    def __init__(self, model_dir: Path, warmup_recipe: str, problems: int, max_new_tokens: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from ..recipes import resolve as resolve_recipe
        from ..rollout import HFEngine
        from ..tasks import build_task
        from ..trainer.config import load_recipe

        if problems < 1 or max_new_tokens < 1:
            raise ValueError(f"Evaluator: problems and max_new_tokens must be >= 1, got {problems}, {max_new_tokens}")
        recipe = load_recipe(resolve_recipe(warmup_recipe, host="train"))  # an embedded-trainer recipe
        task = build_task(recipe.task)
        if problems > len(task.test):
            raise ValueError(f"--eval-problems {problems}: the task has {len(task.test)} test problems")
        self.problems = list(task.test)[:problems]
        from ..integrations.verl.reward import data_source_for

        self.data_source = data_source_for(task.name)
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.start = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self.prompts = [
            list(self.tok.apply_chat_template(
                [{"role": "user", "content": recipe.task.prompt_template.format(question=p.question)}],
                add_generation_prompt=True, tokenize=True, return_dict=False))
            for p in self.problems
        ]
        eos = self.model.generation_config.eos_token_id
        eos = eos[0] if isinstance(eos, (list, tuple)) else eos
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else eos
        self.engine = HFEngine(self.model, pad_id=pad, eos_id=eos, device=torch.device("cpu"), shared=True)
        self.max_new_tokens = int(max_new_tokens)
        self._cache: dict[str, dict] = {}

    def accuracy(self, weights: Path | None = None) -> dict:
        """``{"accuracy", "stderr", "problems"}`` of ``weights`` (a saved state dict; None: the
        start model). Results are cached per file content (size and mtime)."""
        import torch

        from ..integrations.verl.reward import compute_score
        from ..rollout import SamplingParams

        key = "start" if weights is None else f"{Path(weights).resolve()}:{Path(weights).stat().st_mtime_ns}"
        if key in self._cache:
            return self._cache[key]
        state = self.start if weights is None else torch.load(weights, map_location="cpu")
        self.model.load_state_dict(state)
        out = self.engine.generate(self.prompts, SamplingParams(n=1, temperature=0.0,
                                                                max_new_tokens=self.max_new_tokens))
        correct = 0.0
        for toks, p in zip(out.tokens, self.problems, strict=True):
            text = str(self.tok.decode(toks, skip_special_tokens=True))  # one sequence: a str
            correct += compute_score(self.data_source, text, str(p.answer), {"question": p.question})["acc"]
        n = len(self.problems)
        acc = correct / n
        res = {"accuracy": acc, "stderr": math.sqrt(max(acc * (1 - acc), 1e-12) / n), "problems": n}
        self._cache[key] = res
        return res
