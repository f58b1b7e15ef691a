"""Selective rollout's driver: one run's history, rates and counters, and the step in progress.

The rules live in ``core.selective`` (pure functions); ``SelectiveRun`` applies them the same
way in every host that runs selective rollout: the embedded trainer (``trainer/selective.py``),
veRL's V1 sync loop and OpenRLHF's synchronous loop (``integrations/<host>/selective.py``). A
host's own file keeps only what is the host's: where candidate prompts come from, how a
generated group finds its prompt index, and where the state is saved. Its interface is
three calls and the state::

    run.start_step(step)                        whether this step's groups move the rates is decided
    fb = run.fill(draw, n)                      up to n prompt ids to generate (``fb.kept``), skipped
                                                ones replaced by the next candidates
    metrics = run.file_groups(ids, rewards, group, completion_lengths=...)
                                                the step's generated groups filed under their prompt
                                                index, the rates adapted, ``selective/*`` metrics
    run.state_dict() / run.load_state_dict(s)   history, rates and counters (plain tensors, numbers)

Rules every host shares:

- A fill takes at most ``n + num_prompts`` candidates (a whole extra pass over the data set).
  When every one of them was skipped (a well-learned data set whose prompts all sit at the 1%
  keep floor) it keeps the last one drawn all the same (``fill_batch(min_keep=1)``: the prompt
  the host's order hands there, as without selective rollout): it is generated and recorded like any other,
  counted in ``selective/forced_keeps`` (``total_forced_keeps``), and the run warns once with
  the fix. A run never stops for it. A fill that keeps some but fewer than ``n`` is a short
  round (``selective/short_rounds``; warned once a run). A stream that ends (OpenRLHF's epoch)
  forces nothing: the host ends its pass as it would without selective rollout.
- The rates move after every step that starts once the first pass over the data set is
  complete (``cppo.selective.adapt_after_first_epoch``; else after every step), toward the
  target share of zero-variance groups (``adapt_from_config``).
- A group has zero variance when its rewards are all equal; it is easy when, besides, every
  completion's ``easy_values`` (the task's correctness, or the rewards as returned) is >= 1.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ._checks import check_int
from .selective import (
    CandidateSource,
    ExplorationRates,
    FilledBatch,
    OutcomeCounts,
    SelectiveHistory,
    adapt_from_config,
    count_rounds,
    estimate_tokens_saved,
    fill_batch,
    group_outcomes,
    load_run_state,
    run_state,
    step_metrics,
)
from .settings import CPPOConfig

__all__ = ["TOTALS", "SelectiveRun", "classify_groups"]

# the running counters every host keeps (selective/total_*); a host may add its own
TOTALS = ("prompts_drawn", "prompts_skipped", "prompts_generated", "forced_keeps", "tokens_saved_estimate")


def classify_groups(rewards: torch.Tensor, group: torch.Tensor, num_groups: int,
                    easy_values: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(zero_variance [M] bool, easy [M] bool) of M generated groups.

    Args:
        rewards: [N] float, each completion's reward (what the advantage uses).
        group: [N] int64 in [0, M), the position of each completion's group in the step's list
            of generated groups (a prompt generated twice has two positions).
        num_groups: M; every position must have at least one completion.
        easy_values: [N] float or None; a zero-variance group is easy when all of these are
            >= 1 (the task's correctness, or the rewards as the reward function returned them);
            None: the rewards.
    """
    g = torch.as_tensor(group, dtype=torch.int64)
    if num_groups == 0 and g.numel() == 0:
        return torch.zeros(0, dtype=torch.bool), torch.zeros(0, dtype=torch.bool)
    by_reward = group_outcomes(rewards, g)
    if by_reward.prompt_ids.tolist() != list(range(num_groups)):
        raise ValueError(f"group must hold every position 0..{num_groups - 1} (one per generated group), got "
                         f"{by_reward.prompt_ids.tolist()[:10]}...")
    by_easy = by_reward if easy_values is None else group_outcomes(easy_values, g)
    zv = by_reward.zero_variance
    return zv, zv & by_easy.easy


class SelectiveRun:
    """History, exploration rates and counters of one run, and the step in progress.

    Args:
        cfg: the run's ``CPPOConfig`` (its ``selective`` section; ``seed`` seeds the draws).
        num_prompts: prompts in the training set (one pass = one epoch; bounds a fill's draws).
        group_size: G, completions per prompt (the tokens-saved estimate).
        counters: the host's own running counters, kept and saved beside ``TOTALS``.
        warn: where the run's warnings go (each kind once a run); None: nowhere.

    Attributes read by hosts and tests: ``history``, ``rates``, ``totals``, ``step`` (-1 before
    the first), ``rounds`` (this step's fills), ``adapt``, ``short_rounds``.
    """

    def __init__(self, cfg: CPPOConfig, *, num_prompts: int, group_size: int, counters: Sequence[str] = (),
                 warn: Callable[[str], None] | None = None) -> None:
        if not isinstance(cfg, CPPOConfig):
            raise ValueError(f"cfg must be a CPPOConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.num_prompts = check_int("num_prompts (the training set's prompts)", num_prompts, minimum=1)
        self.group_size = check_int("group_size", group_size, minimum=1)
        self.counters = (*TOTALS, *counters)
        self.history = SelectiveHistory()
        self.rates = ExplorationRates(p_easy=cfg.selective.p_easy, p_hard=cfg.selective.p_hard)
        self.totals = dict.fromkeys(self.counters, 0.0)
        self._warn = warn
        self._warned: set[str] = set()
        self.step = -1
        self.rounds: list[FilledBatch] = []
        self._filed = 0  # rounds[:_filed] are filed already
        self.short_rounds = 0
        self.adapt = False
        # the last file_groups' (prompt_ids [M], zero_variance [M], easy [M]): what a host's audit records
        self.last_filed = (torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.bool),
                           torch.zeros(0, dtype=torch.bool))

    # ------------------------------------------------------------------ a step
    def start_step(self, step: int, *, drawn_before: int | None = None) -> None:
        """Start step ``step``: its fills begin empty, and whether its groups move the rates is
        decided now, from the prompts drawn before it (``drawn_before``; default: the run's
        ``prompts_drawn`` counter) against one pass over the data set."""
        self.step = check_int("step", step, minimum=0)
        self.rounds, self._filed, self.short_rounds = [], 0, 0
        drawn = self.totals["prompts_drawn"] if drawn_before is None else drawn_before
        self.adapt = not self.cfg.selective.adapt_after_first_epoch or drawn >= self.num_prompts

    def fill(self, candidates: CandidateSource, wanted: int) -> FilledBatch:
        """Up to ``wanted`` prompts to generate (``fb.kept``): candidates in order from
        ``candidates`` (``fill_batch``'s sources), skipped ones replaced, at most ``wanted +
        num_prompts`` taken; when all of those were skipped, the last one drawn is kept anyway."""
        if self.step < 0:
            raise RuntimeError("SelectiveRun.fill before start_step(step)")
        fb = fill_batch(candidates, wanted, self.history, seed=self.cfg.seed, step=self.step, rates=self.rates,
                        max_draws=wanted + self.num_prompts, min_keep=min(wanted, 1))
        self.rounds.append(fb)
        if fb.num_forced:
            self._warn_once("forced", self._forced_message(fb))
        if fb.capped and fb.kept.numel() < wanted:
            self.short_rounds += 1
            self._warn_once("short", self._short_message(fb))
        return fb

    def file_groups(self, prompt_ids: torch.Tensor, rewards: torch.Tensor, group: torch.Tensor, *,
                    completion_lengths: torch.Tensor, easy_values: torch.Tensor | None = None,
                    expect_all: bool = True, counts: Mapping[str, float] | None = None) -> dict[str, float]:
        """File the step's generated groups under their prompt index, adapt the rates, count; returns
        the step's ``selective/*`` metrics (``step_metrics`` over the fills not filed yet, plus
        ``short_rounds``, ``adapted``, ``history_prompts`` and every ``total_*`` counter).

        Args:
            prompt_ids: [M] int64 dataset index of each generated group, in the order of ``group``.
            rewards, group, easy_values: [N] per completion (``classify_groups``).
            completion_lengths: [N] tokens generated per completion (the estimate's mean length).
            expect_all: every prompt the fills kept must be among the M (a host whose failed
                groups never come back says False).
            counts: this step's values of the host's own counters, added to their totals.
        """
        if self.step < 0:
            raise RuntimeError("SelectiveRun.file_groups before start_step(step)")
        ids = torch.as_tensor(prompt_ids, dtype=torch.int64).reshape(-1)
        rounds = self.rounds[self._filed:]
        c = count_rounds(rounds)
        if expect_all and ids.numel() != c.generated:
            raise ValueError(
                f"selective rollout, step {self.step}: {ids.numel()} groups were generated but the draws kept "
                f"{c.generated} prompts ({c.drawn} drawn = {c.skipped} skipped + {c.generated} kept): every kept "
                "prompt must come back as one group")
        zv, easy = classify_groups(rewards, group, ids.numel(), easy_values)
        self.history.update(ids, zv, easy, step=self.step)  # a prompt generated twice: two records, in order
        self.last_filed = (ids, zv, easy)
        outcomes = OutcomeCounts.from_flags(zv, easy)
        if self.adapt:
            self.rates = adapt_from_config(self.rates, self.cfg, outcomes)
        # an estimate: the skipped prompts' completions were never generated, their length is unknown
        saved = estimate_tokens_saved(c.skipped, self.group_size, completion_lengths)
        step_counts = {"prompts_drawn": c.drawn, "prompts_skipped": c.skipped, "prompts_generated": c.generated,
                       "forced_keeps": c.forced, "tokens_saved_estimate": saved, **(counts or {})}
        for key, v in step_counts.items():
            self.totals[key] += float(v)  # an unknown host counter is a KeyError: declare it in counters
        self._filed = len(self.rounds)
        out = step_metrics(rounds, self.rates, outcomes, tokens_saved=saved)
        out.update({"selective/short_rounds": float(self.short_rounds), "selective/adapted": float(self.adapt),
                    "selective/history_prompts": float(self.history.num_prompts)})
        out.update({f"selective/total_{k}": v for k, v in self.totals.items()})
        return out

    # ------------------------------------------------------------------ warnings
    def _warn_once(self, kind: str, message: str) -> None:
        if self._warn is not None and kind not in self._warned:
            self._warned.add(kind)
            self._warn(message)

    def _fix(self) -> str:
        return (f"use more training prompts, raise cppo.selective.p_min (now {self.cfg.selective.p_min}) or turn "
                "selective rollout off (cppo.selective.enabled=false)")

    def _forced_message(self, fb: FilledBatch) -> str:
        kept = fb.kept.tolist()
        return (f"warning: selective rollout skipped all {fb.drawn.numel()} candidates drawn for {fb.wanted} "
                f"prompt(s) in step {self.step} (a pass over all {self.num_prompts} training prompts and {fb.wanted} "
                f"more): "
                f"it generates the last one(s) drawn, {kept}, anyway and counts them in "
                "selective/forced_keeps (this warning comes once a run). Nearly every prompt's recent groups "
                f"had equal rewards (rates p_easy={self.rates.p_easy}, p_hard={self.rates.p_hard}): {self._fix()}")

    def _short_message(self, fb: FilledBatch) -> str:
        n = fb.wanted
        return (f"warning: selective rollout generated {fb.kept.numel()} of the {n} prompts asked in step "
                f"{self.step}: it skipped {fb.skipped.numel()} of {fb.drawn.numel()} candidates (a pass over all "
                f"{self.num_prompts} training prompts and {n} more), so this step trains a smaller batch on the few "
                f"prompts not skipped. The training set is small for this skip rate (rates p_easy={self.rates.p_easy}, "
                f"p_hard={self.rates.p_hard}): {self._fix()}")

    # ------------------------------------------------------------------ state
    def fingerprint(self) -> str:
        """A short digest of the history, the rates and the counters: equal on every rank of a
        run whose ranks decided alike."""
        h = hashlib.sha1()
        state = self.history.state_dict()
        for key in ("prompt_ids", "steps", "outcomes"):
            h.update(state[key].numpy().tobytes())
        h.update(repr((self.rates, sorted(self.totals.items()))).encode())
        return h.hexdigest()[:16]

    def state_dict(self) -> dict[str, Any]:
        """History (its event log), rates and running counters: plain tensors and numbers."""
        return run_state(self.history, self.rates, self.totals)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()`` (a counter the saved state lacks starts at 0); a malformed
        entry is an error naming it."""
        self.history, self.rates, self.totals = load_run_state(state, self.counters)
