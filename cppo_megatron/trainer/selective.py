"""Selective rollout (GRESO) in the embedded trainer: skip prompts before generation.

``SelectiveRollout`` is the core's driver (``core.selective_run.SelectiveRun``: history, rates,
counters, the rules every host shares) with what is the trainer's own:

    begin_step(step, sampler)  a step starts; its groups move the rates once the sampler has
                               passed over the prompts (``sampler.total_drawn``)
    draw(sampler, n)           a round's prompt ids, from the prompt sampler in order
    end_step(...)              the step's generated groups (dynamic sampling's dropped groups
                               too), easy by the task's correctness; ``selective/*`` metrics

The decisions depend on (cppo.seed, step, prompt id, history, rates) only. Every rank draws the
same ids from the same sampler and records the same global rewards (``RolloutBatch.rewards`` /
``correct`` cover all rows on every rank), so the history and the decisions are identical on every
rank (the trainer compares ``fingerprint()`` after each step).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from ..config import CPPOConfig
from ..core import PromptSampler, check_int
from ..core.selective_run import SelectiveRun

__all__ = ["STATE_KEY", "SelectiveRollout"]

STATE_KEY = "selective"  # its entry in trainer.pt


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class SelectiveRollout(SelectiveRun):
    """History, exploration rates and counters of one run (``cppo.selective.enabled``).

    Args:
        cfg: the run's ``CPPOConfig`` (its ``selective`` section; ``seed`` seeds the draws).
        group_size: G, completions per prompt.
        num_prompts: prompts in the training set (bounds the draws of one round).
        warn: where the run's warnings go (a short round, a forced keep; each once a run); None:
            nowhere (the other ranks of a run). Default: stderr.
    """

    def __init__(self, cfg: CPPOConfig, *, group_size: int, num_prompts: int,
                 warn: Callable[[str], None] | None = _stderr) -> None:
        super().__init__(cfg, num_prompts=num_prompts, group_size=group_size, warn=warn)

    def begin_step(self, step: int, sampler: PromptSampler) -> None:
        """Start step ``step``; a step that starts before the sampler's first pass over the prompts
        has ended does not adapt the rates (unless ``cppo.selective.adapt_after_first_epoch`` is false)."""
        self.start_step(step, drawn_before=sampler.total_drawn)

    def draw(self, sampler: PromptSampler, n: int) -> list[int]:
        """Up to ``n`` prompt ids to generate, from ``sampler.draw`` in order (``SelectiveRun.fill``)."""
        return self.fill(sampler.draw, n).kept.tolist()

    def end_step(self, prompt_ids: torch.Tensor, rewards: torch.Tensor, correct: torch.Tensor,
                 completion_lengths: torch.Tensor) -> dict[str, float]:
        """Record the step's generated groups, adapt the rates, count; ``selective/*`` metrics.

        Args:
            prompt_ids: [P] int64 dataset index of each generated group, draw order
                (``RolloutBatch.prompt_ids``; every rank holds all of them).
            rewards, correct: [P * G] float per completion, prompt-major (global); a group is
                easy when every completion is correct (the task's correctness, whatever the
                reward weights).
            completion_lengths: [P * G] int64 tokens generated per completion.
        """
        ids = torch.as_tensor(prompt_ids, dtype=torch.int64)
        G = check_int("group_size", self.group_size, minimum=1)
        if rewards.numel() != ids.numel() * G or correct.numel() != ids.numel() * G:
            raise ValueError(f"{rewards.numel()} rewards and {correct.numel()} correctness flags for {ids.numel()} "
                             f"groups x G={G}: give one per completion, prompt-major")
        group = torch.arange(ids.numel()).repeat_interleave(G)  # positions keep a repeated prompt's groups apart
        return self.file_groups(ids, rewards, group, easy_values=correct, completion_lengths=completion_lengths)
