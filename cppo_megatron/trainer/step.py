"""The step pipeline both policy backends share, up to the expensive passes.

    collect_groups     draw -> generate -> score -> refill rounds (dynamic sampling); one
                       ``RolloutBatch`` that every rank sees the same way (rewards of all
                       rows, in draw order) plus the rows this rank holds
    select_survivors   full-group advantages -> survivors -> allocation accounting, once

``Trainer._rl_step`` (loop.py) runs these, then hands the survivors to a policy backend
(backends/) for the log-prob passes, the update and the weight export. Where the rows
are generated (one process, or the first rank of each model-parallel group) is the
rollout distribution's business (distribution.py), not this module's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core import AllocationPlanner, PromptSampler, PruneResult, prune
from ..core.early_stop import early_stop_prune
from ..tasks import combine_reward
from .metrics import PHASES

__all__ = ["PhaseTimer", "RolloutBatch", "RoundRows", "Survivors", "collect_groups", "score_completions",
           "select_survivors"]


@dataclass(frozen=True)
class RoundRows:
    """One generation round as this rank sees it. Per-row lists cover every row of the
    round (all ranks, draw order: prompt-major, G completions per prompt); ``prompts`` /
    ``completions`` / ``logprobs`` are this rank's rows, starting at row ``local_start``."""

    rewards: list
    correct: list
    formatted: list
    prompt_lengths: list
    completion_lengths: list
    truncated: list
    owner: list  # data-parallel rank that holds each row
    local_start: int
    prompts: list
    completions: list
    logprobs: list | None = None  # [len(completion)] float32 sampler log-probs per local row
    seconds: float = 0.0  # this rank's generation time
    stopped: list | None = None  # stopped early by cppo.early_stop (every row of the round); None: off
    absent: list | None = None  # never generated: cppo.two_wave's unfinished groups' last G - k rows; None: off


@dataclass(frozen=True)
class RolloutBatch:
    """Everything a step generated, after its refill rounds.

    Global (identical on every rank; N rows in draw order, group g = rows g*G .. g*G+G-1):
    ``rewards`` / ``correct`` / ``formatted`` [N] float32, ``prompt_lengths`` /
    ``completion_lengths`` [N] int64, ``truncated`` [N] bool, ``owner`` [N] int64 (the
    data-parallel rank holding the row), ``valid_groups`` [V] int64 ascending (groups that
    go to selection), ``dropped_prompts`` (zero-variance groups dynamic sampling removed, and
    the groups ``cppo.two_wave`` left unfinished),
    ``prompt_ids`` [P] int64 the dataset index of every generated group (P = N / G, draw
    order, dropped groups included).
    Local: ``local_rows`` [n] int64 ascending global row of each row this rank holds, with
    its ``prompts`` / ``completions`` token ids and ``sampler_logprobs`` (vLLM only).
    ``stopped`` [N] bool: completions stopped early (``cppo.early_stop``; their reward is
    never computed: 0 in ``rewards`` / ``correct`` / ``formatted``, never read).
    ``absent`` [N] bool: rows never generated (``cppo.two_wave``: the last G - k rows of a group
    whose first wave agreed; length 0, reward 0, never read; the group is not valid).
    """

    group_size: int
    rewards: torch.Tensor
    correct: torch.Tensor
    formatted: torch.Tensor
    prompt_lengths: torch.Tensor
    completion_lengths: torch.Tensor
    truncated: torch.Tensor
    owner: torch.Tensor
    valid_groups: torch.Tensor
    dropped_prompts: int
    prompt_ids: torch.Tensor
    local_rows: torch.Tensor
    prompts: list
    completions: list
    sampler_logprobs: list | None
    rounds: int
    seconds: float
    stopped: torch.Tensor
    absent: torch.Tensor

    @property
    def finished(self) -> torch.Tensor:
        """[N] bool: completions generated that ran to their end (not stopped early, not absent):
        the only ones rewarded."""
        return ~self.stopped & ~self.absent

    @property
    def generated(self) -> torch.Tensor:
        """[N] bool: rows the engine generated (every row but the absent ones)."""
        return ~self.absent

    @property
    def dropped_completions(self) -> int:
        """Completions generated in groups that go to no selection (dynamic sampling's drops,
        ``cppo.two_wave``'s unfinished groups)."""
        return int(self.generated.sum()) - int(self.valid_rows.numel())

    @property
    def num_rows(self) -> int:
        return int(self.rewards.numel())

    @property
    def group_ids(self) -> torch.Tensor:
        """[N] int64 group (prompt) of every row."""
        return torch.arange(self.num_rows) // self.group_size

    @property
    def lengths(self) -> torch.Tensor:
        """[N] int64 tokens each row costs in the passes (prompt + completion)."""
        return self.prompt_lengths + self.completion_lengths

    @property
    def valid_rows(self) -> torch.Tensor:
        """[R] int64 ascending rows of the groups that go to selection."""
        G = self.group_size
        return (self.valid_groups.unsqueeze(1) * G + torch.arange(G)).reshape(-1)


def score_completions(task, tok, problems: Sequence, tokens: Sequence[Sequence[int]], group_size: int,
                      reward_cfg, skip: Sequence[bool] | None = None) -> tuple[list, list, list]:
    """Rewards of ``tokens`` (prompt-major, ``group_size`` per problem): (reward, correct,
    formatted) lists of floats, one per completion. ``skip``: completions stopped early, never
    scored (0.0 in all three: a partial completion has no reward)."""
    if len(tokens) != len(problems) * group_size:
        raise ValueError(f"{len(tokens)} completions for {len(problems)} prompts x G={group_size}")
    rewards, correct, formatted = [], [], []
    for j, toks in enumerate(tokens):
        if skip is not None and skip[j]:
            rewards.append(0.0)
            correct.append(0.0)
            formatted.append(0.0)
            continue
        s = task.score(tok.decode(toks), problems[j // group_size])
        rewards.append(combine_reward(s, reward_cfg.correct, reward_cfg.format, reward_cfg.step))
        correct.append(float(s.correct))
        formatted.append(float(s.formatted))
    return rewards, correct, formatted


class PhaseTimer:
    """Seconds per step phase (``PHASES``); ``on_enter(phase)`` runs as each phase starts
    (the trainer records the current phase for interrupts and failure messages)."""

    def __init__(self, device: torch.device, on_enter: Callable[[str], None] | None = None) -> None:
        self.seconds = {p: 0.0 for p in PHASES}
        self.device = device
        self.on_enter = on_enter

    def add(self, phase: str, seconds: float) -> None:
        if phase not in self.seconds:
            raise ValueError(f"unknown phase {phase!r}; phases are {list(PHASES)}")
        self.seconds[phase] += seconds

    @contextmanager
    def phase(self, name: str):
        if name not in self.seconds:
            raise ValueError(f"unknown phase {name!r}; phases are {list(PHASES)}")
        if self.on_enter is not None:
            self.on_enter(name)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            self.seconds[name] += time.perf_counter() - t0


def collect_groups(rollout: Any, planner: AllocationPlanner, sampler: PromptSampler, *, group_size: int,
                   dynamic_sampling: bool, step: int, timer: PhaseTimer, cppo_cfg: Any = None,
                   draw: Callable[[int], Sequence[int]] | None = None) -> RolloutBatch:
    """Draw the step's prompts, generate and score G completions each (``rollout.round``),
    and with dynamic sampling drop zero-variance groups and draw replacements until the
    planner is satisfied. Opens the planner's step (``select_survivors`` closes it).

    ``draw(n)`` gives each round's prompt ids (default ``sampler.draw``); selective rollout
    passes one that skips prompts before generation and may return fewer than n.

    With ``cppo.keep_mass`` and allocation (``planner.adaptive``; ``cppo_cfg`` given) the
    survivors per prompt vary: fill rounds draw more prompts until the selection over the
    valid groups so far fills the planner's capacity."""
    G = group_size
    parts: list[RoundRows] = []
    valid: list[int] = []
    dropped = 0
    drawn = 0
    rounds = 0
    to_draw = planner.begin_step()
    draw_ids = sampler.draw if draw is None else draw
    prompt_ids: list[int] = []
    while to_draw > 0:
        ids = list(draw_ids(to_draw))
        if not ids:
            raise RuntimeError(f"round {rounds} of step {step}: no prompt to generate (asked for {to_draw})")
        prompt_ids.extend(ids)
        part = rollout.round(ids, step=step, round_=rounds, timer=timer)
        if len(part.rewards) != len(ids) * G:
            raise RuntimeError(f"rollout round {rounds}: {len(part.rewards)} rewards for {len(ids)} prompts x G={G}")
        absent = part.absent or [False] * len(part.rewards)
        planner.record_round(len(ids), len(ids) * G - sum(absent))
        for g in range(len(ids)):
            group = part.rewards[g * G : (g + 1) * G]
            if any(absent[g * G : (g + 1) * G]):  # cppo.two_wave left it at its first wave: no signal
                dropped += 1
            elif dynamic_sampling and max(group) == min(group):
                dropped += 1
            else:
                valid.append(drawn + g)
        parts.append(part)
        drawn += len(ids)
        rounds += 1
        to_draw = planner.next_refill(len(valid))
        if to_draw == 0 and planner.adaptive and cppo_cfg is not None and valid:
            rewards = torch.tensor([x for p in parts for x in p.rewards], dtype=torch.float32)
            rows = (torch.tensor(valid, dtype=torch.int64)[:, None] * G + torch.arange(G)).reshape(-1)
            kept = prune(rewards[rows], rows // G, cppo_cfg, step=step).selection.num_kept
            to_draw = planner.next_fill(kept)
    return _assemble(parts, G, valid, dropped, rounds, prompt_ids)


def _assemble(parts: list[RoundRows], G: int, valid: list[int], dropped: int, rounds: int,
              prompt_ids: list[int]) -> RolloutBatch:
    def cat(name, dtype):
        return torch.tensor([x for p in parts for x in getattr(p, name)], dtype=dtype)

    local: list[int] = []
    stopped: list[bool] = []
    absent: list[bool] = []
    prompts: list = []
    completions: list = []
    logprobs: list | None = [] if parts and parts[0].logprobs is not None else None
    offset = 0
    for p in parts:
        local.extend(range(offset + p.local_start, offset + p.local_start + len(p.completions)))
        prompts.extend(p.prompts)
        completions.extend(p.completions)
        if logprobs is not None:
            assert p.logprobs is not None  # one engine: every round carries sampler log-probs, or none does
            logprobs.extend(p.logprobs)
        stopped.extend(p.stopped if p.stopped is not None else [False] * len(p.rewards))
        absent.extend(p.absent if p.absent is not None else [False] * len(p.rewards))
        offset += len(p.rewards)
    return RolloutBatch(
        group_size=G,
        rewards=cat("rewards", torch.float32),
        correct=cat("correct", torch.float32),
        formatted=cat("formatted", torch.float32),
        prompt_lengths=cat("prompt_lengths", torch.int64),
        completion_lengths=cat("completion_lengths", torch.int64),
        truncated=cat("truncated", torch.bool),
        owner=cat("owner", torch.int64),
        valid_groups=torch.tensor(valid, dtype=torch.int64),
        dropped_prompts=dropped,
        prompt_ids=torch.tensor(prompt_ids, dtype=torch.int64),
        local_rows=torch.tensor(local, dtype=torch.int64),
        prompts=prompts,
        completions=completions,
        sampler_logprobs=logprobs,
        rounds=rounds,
        seconds=sum(p.seconds for p in parts),
        stopped=torch.tensor(stopped, dtype=torch.bool),
        absent=torch.tensor(absent, dtype=torch.bool),
    )


@dataclass(frozen=True)
class Survivors:
    """The step's CPPO decision, identical on every rank.

    kept: [K] int64 ascending rows (``RolloutBatch`` order) that go to the passes.
    advantages: [N] float32 full-group advantage of every row (0 for dropped groups).
    prune: the ``PruneResult`` over the valid rows. alloc: ``alloc/*`` step metrics.
    weights: [N] float32 loss weight of every row (``Selection.weights`` on the kept rows:
        1/pi for ``metric=importance``; 1.0 elsewhere).
    full_denominators: (response tokens, rows) of every valid row when the weights must
        reach the loss (importance: the unbiased HT loss divides by the full batch's
        counts, ``core.aggregate_loss``); None otherwise.
    """

    kept: torch.Tensor
    advantages: torch.Tensor
    prune: PruneResult
    alloc: dict = field(default_factory=dict)
    weights: torch.Tensor | None = None
    full_denominators: tuple | None = None


def select_survivors(batch: RolloutBatch, cfg: Any, planner: AllocationPlanner, *, step: int,
                     moments: tuple[torch.Tensor, torch.Tensor] | None = None) -> Survivors:
    """Full-group advantages over the valid groups, the survivors by ``cfg`` (a
    ``CPPOConfig``), then the planner's accounting (closes its step).

    With ``cppo.early_stop``: ``core.early_stop_prune`` (the stopped rows' expected reward and
    squared reward ``moments``, [N] each, stand in for them in the group statistics with the impute
    estimator); the survivors are chosen among the finished rows, the stopped ones count as pruned."""
    rows = batch.valid_rows
    if rows.numel() == 0:
        if bool(batch.absent.any()):
            raise RuntimeError("every group's first wave had equal rewards (cppo.two_wave left them unfinished): "
                               "raise cppo.two_wave.first_wave, lower cppo.two_wave.min_spread, or enable "
                               "cppo.dynamic_sampling to draw replacements")
        raise RuntimeError("every group was dropped for zero reward variance; raise cppo.max_refill_rounds or "
                           "disable cppo.dynamic_sampling")
    if cfg.early_stop.enabled:
        expected, expected_sq = (None, None) if moments is None else (moments[0][rows], moments[1][rows])
        es = early_stop_prune(batch.rewards[rows], batch.stopped[rows], batch.group_ids[rows], cfg,
                              expected=expected, expected_sq=expected_sq, step=step)
        res = PruneResult(es.advantages.to(batch.rewards.dtype), es.stats, es.selection)
    else:
        res = prune(batch.rewards[rows], batch.group_ids[rows], cfg, step=step)
    alloc = planner.end_step(res.selection, dropped_prompts=batch.dropped_prompts,
                             dropped_completions=batch.dropped_completions)
    advantages = torch.zeros(batch.num_rows, dtype=torch.float32)
    advantages[rows] = res.advantages.to(torch.float32)
    kept = rows[res.selection.kept]
    if kept.numel() == 0:  # keep_mass: every valid group had equal rewards
        raise RuntimeError("no completion survived (every group had equal rewards under cppo.keep_mass); enable "
                           "cppo.allocation so fill rounds draw more prompts, or cppo.dynamic_sampling")
    weights = torch.ones(batch.num_rows, dtype=torch.float32)
    assert res.selection.weights is not None  # Selection fills in ones when no weights are given
    weights[kept] = res.selection.weights
    full = None
    if res.selection.weighted:
        full = (float(batch.completion_lengths[rows].sum()), float(rows.numel()))
    return Survivors(kept, advantages, res, alloc, weights, full)
