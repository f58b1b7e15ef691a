"""Selective rollout (GRESO) in the embedded trainer: skip prompts before generation.

``SelectiveRollout`` holds what persists across steps (the per-prompt ``SelectiveHistory``,
the ``ExplorationRates`` and running counters) and does three small things a step needs:

    draw(n)         fill_batch over the prompt sampler: skipped prompts are replaced, so a
                    round still generates n prompts (fewer only when ``max_draws`` runs out)
    end_step(batch) record the outcome of every generated group (dynamic sampling's dropped
                    groups too) keyed by the dataset's prompt index, adapt the rates, and
                    return the step's ``selective/*`` metrics

The decisions come from the core (``core.selective``) and depend on (cppo.seed, step,
prompt id, history, rates) only. Every rank draws the same ids from the same sampler and
records the same global rewards (``RolloutBatch.rewards`` / ``correct`` cover all rows on
every rank), so the history and the decisions are identical on every rank.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable
from typing import Any

import torch

from ..config import CPPOConfig
from ..core import (
    ExplorationRates,
    FilledBatch,
    OutcomeCounts,
    PromptSampler,
    SelectiveHistory,
    adapt_from_config,
    check_int,
    count_rounds,
    estimate_tokens_saved,
    fill_batch,
    group_outcomes,
    step_metrics,
)
from ..core.selective import load_run_state, run_state

__all__ = ["STATE_KEY", "SelectiveRollout", "record_outcomes"]

STATE_KEY = "selective"  # its entry in trainer.pt
_TOTALS = ("prompts_drawn", "prompts_skipped", "prompts_generated", "tokens_saved_estimate")


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class SelectiveRollout:
    """History, exploration rates and counters of one run (``cppo.selective.enabled``).

    Args:
        cfg: the run's ``CPPOConfig`` (its ``selective`` section; ``seed`` seeds the draws).
        group_size: G, completions per prompt.
        num_prompts: prompts in the training set (bounds the draws of one round).
        warn: where the one warning of a run goes (a round that generated fewer prompts than
            asked); None: nowhere (the other ranks of a run). Default: stderr.
    """

    def __init__(self, cfg: CPPOConfig, *, group_size: int, num_prompts: int,
                 warn: Callable[[str], None] | None = _stderr) -> None:
        if not isinstance(cfg, CPPOConfig):
            raise ValueError(f"cfg must be a CPPOConfig, got {type(cfg).__name__}")
        check_int("group_size", group_size, minimum=1)
        check_int("num_prompts", num_prompts, minimum=1)
        self.cfg = cfg
        self.group_size = group_size
        self.num_prompts = num_prompts
        self.history = SelectiveHistory()
        self.rates = ExplorationRates(p_easy=cfg.selective.p_easy, p_hard=cfg.selective.p_hard)
        self.totals = dict.fromkeys(_TOTALS, 0.0)
        self.rounds: list[FilledBatch] = []  # this step's draws, one per generation round
        self.short_rounds = 0  # this step's rounds that generated fewer prompts than asked
        self._warn = warn
        self._warned_short = False
        self._step = -1
        self._adapt = False

    # ------------------------------------------------------------------ a step
    def begin_step(self, step: int, sampler: PromptSampler) -> None:
        """Start step ``step``; whether this step's groups move the rates is decided now (a
        step that starts before the first pass over the prompts has ended does not adapt,
        unless ``cppo.selective.adapt_after_first_epoch`` is false)."""
        self._step = check_int("step", step, minimum=0)
        self.rounds = []
        self.short_rounds = 0
        self._adapt = (not self.cfg.selective.adapt_after_first_epoch
                       or sampler.total_drawn >= sampler.num_prompts)

    def draw(self, sampler: PromptSampler, n: int) -> list[int]:
        """Up to ``n`` prompt ids to generate: candidates come from ``sampler.draw`` in order
        and skipped ones are replaced. At most ``n + num_prompts`` are taken in one round (a
        whole extra pass over the data set), so a set of prompts that are nearly always
        skipped cannot stall the step; the round then generates fewer."""
        if self._step < 0:
            raise RuntimeError("SelectiveRollout.draw before begin_step(step, sampler)")
        fb = fill_batch(sampler.draw, n, self.history, seed=self.cfg.seed, step=self._step, rates=self.rates,
                        max_draws=n + self.num_prompts)
        self.rounds.append(fb)
        if fb.kept.numel() == 0 and n > 0:
            raise RuntimeError(
                f"selective rollout skipped all {fb.drawn.numel()} prompts drawn in step {self._step}: raise "
                f"cppo.selective.p_min (now {self.cfg.selective.p_min}) or disable cppo.selective.enabled"
            )
        if fb.kept.numel() < n:
            self.short_rounds += 1
            if not self._warned_short and self._warn is not None:  # once; selective/short_rounds counts all
                self._warned_short = True
                self._warn(f"warning: selective rollout generated {fb.kept.numel()} of the {n} prompts asked in step "
                      f"{self._step}: it skipped {fb.decision.num_skipped} of {fb.drawn.numel()} candidates (a pass "
                      f"over all {self.num_prompts} training prompts and {n} more), so this step trains a smaller "
                      f"batch on the few prompts not skipped. The training set is small for this skip rate (rates "
                      f"p_easy={self.rates.p_easy}, p_hard={self.rates.p_hard}): use more training prompts, raise "
                      f"cppo.selective.p_min (now {self.cfg.selective.p_min}) or disable cppo.selective.enabled")
        return fb.kept.tolist()

    def end_step(self, prompt_ids: torch.Tensor, rewards: torch.Tensor, correct: torch.Tensor,
                 completion_lengths: torch.Tensor) -> dict[str, float]:
        """Record the step's generated groups, adapt the rates, count; ``selective/*`` metrics.

        Args:
            prompt_ids: [P] int64 dataset index of each generated group, draw order
                (``RolloutBatch.prompt_ids``; every rank holds all of them).
            rewards, correct: [P * G] float per completion, prompt-major (global).
            completion_lengths: [P * G] int64 tokens generated per completion.
        """
        if self._step < 0:
            raise RuntimeError("SelectiveRollout.end_step before begin_step(step, sampler)")
        counts = count_rounds(self.rounds)
        if prompt_ids.numel() != counts.generated:
            raise ValueError(
                f"step {self._step}: {prompt_ids.numel()} groups were generated but the selective draws kept "
                f"{counts.generated}: every round must draw through SelectiveRollout.draw"
            )
        zv, easy = record_outcomes(self.history, prompt_ids, rewards, correct, group_size=self.group_size,
                                   step=self._step)
        outcomes = OutcomeCounts.from_flags(zv, easy)
        if self._adapt:
            self.rates = adapt_from_config(self.rates, self.cfg, outcomes)
        # an estimate: the skipped prompts' completions would not have had this step's mean length
        saved = estimate_tokens_saved(counts.skipped, self.group_size, completion_lengths)
        for key, v in zip(_TOTALS, (counts.drawn, counts.skipped, counts.generated, saved), strict=True):
            self.totals[key] += float(v)
        out = step_metrics(self.rounds, self.rates, outcomes, tokens_saved=saved)
        out.update({
            "selective/short_rounds": float(self.short_rounds),
            "selective/adapted": float(self._adapt),
            "selective/history_prompts": float(self.history.num_prompts),
        })
        out.update({f"selective/total_{k}": v for k, v in self.totals.items()})
        return out

    def fingerprint(self) -> str:
        """A short digest of the history, the rates and the counters: equal on every rank of a
        run whose ranks decided alike (the trainer compares them after each step)."""
        h = hashlib.sha1()
        state = self.history.state_dict()
        for key in ("prompt_ids", "steps", "outcomes"):
            h.update(state[key].numpy().tobytes())
        h.update(repr((self.rates, sorted(self.totals.items()))).encode())
        return h.hexdigest()[:16]

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> dict[str, Any]:
        """History (its event log), rates and running counters: plain tensors and numbers."""
        return run_state(self.history, self.rates, self.totals)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``; a malformed entry is an error naming it."""
        self.history, self.rates, self.totals = load_run_state(state, _TOTALS)


def record_outcomes(history: SelectiveHistory, prompt_ids: torch.Tensor, rewards: torch.Tensor,
                    correct: torch.Tensor, *, group_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Record one step's generated groups in ``history`` under their dataset prompt index.

    A group has zero variance when its G rewards are all equal, and is easy when, besides,
    every completion is correct (the task's correctness, whatever the reward weights).
    A prompt generated twice in the step (a small data set crossing an epoch) gets two
    records, in draw order.

    Args:
        prompt_ids: [P] int64 dataset index per group, draw order.
        rewards, correct: [P * G] float per completion, prompt-major.
        group_size: G; step: the training step.

    Returns:
        (zero_variance [P] bool, easy [P] bool), aligned with ``prompt_ids``.
    """
    G = check_int("group_size", group_size, minimum=1)
    ids = torch.as_tensor(prompt_ids, dtype=torch.int64)
    if ids.dim() != 1:
        raise ValueError(f"prompt_ids must be 1-D [P] (one dataset index per group), got shape {tuple(ids.shape)}")
    p = ids.numel()
    if rewards.numel() != p * G or correct.numel() != p * G:
        raise ValueError(f"{rewards.numel()} rewards and {correct.numel()} correctness flags for {p} groups x G={G}: "
                         "give one per completion, prompt-major")
    # a per-group key (its position) keeps repeated prompts apart while classifying
    pos = torch.arange(p).repeat_interleave(G)
    by_reward = group_outcomes(rewards, pos)
    by_correct = group_outcomes(correct, pos, easy_threshold=1.0)
    zv = by_reward.zero_variance
    easy = zv & by_correct.easy  # all correct: correctness is 0/1, zero-variance at the top
    history.update(ids, zv, easy, step=step)  # a repeated prompt is recorded twice, in draw order
    return zv, easy
