"""Selective rollout: skip prompts before generation when their recent groups taught nothing.

GRESO (Zheng et al., "Act Only When It Pays: Efficient Reinforcement Learning for LLM
Reasoning via Selective Rollouts", arXiv 2506.02177). A prompt whose group of G completions
had zero reward variance (all rewards equal: every GRPO advantage is 0) in its last
generation(s) is likely to be zero-variance again. Before rollout, each candidate prompt i
is skipped with probability

    p_skip(i) = 1 - max(p_e ** z_i, 0.01)

where ``z_i`` counts its most recent *consecutive* zero-variance groups of the kind of its
last group and ``p_e`` is the exploration probability of that kind: ``p_easy`` when every
completion was right (all rewards at the top), ``p_hard`` otherwise (all wrong); a prompt is
always generated with at least a 1% chance (``MIN_KEEP_PROB``). A prompt never generated,
or whose last group had reward variance, has z = 0 and is never skipped. After each training
step the two exploration probabilities move by a fixed step toward a target share of
zero-variance groups among those generated (``adapt_exploration``). Sources, and what was
and was not checked against the paper's text: ``docs/selective_rollout.md``.

The pieces, each pure and CPU-only (identical on every rank from identical inputs):

- ``group_outcomes``: per-prompt outcome of one generation round (zero variance, easy, hard)
- ``SelectiveHistory``: per-prompt trace keyed by the dataset's stable prompt index
  (never by batch position), with ``state_dict`` / ``load_state_dict``
- ``decide_skips``: the skip decision for a set of candidates (``SkipDecision``)
- ``adapt_exploration``: the next ``ExplorationRates``; ``adapt_from_config`` with a
  ``CPPOConfig``'s ``selective`` targets, step and bounds
- ``fill_batch``: draw candidates in order until ``wanted`` are kept (``FilledBatch``; with a
  draw cap and ``min_keep``, the last drawn are kept when the cap is reached with too few)
- ``step_metrics``: one step's ``selective/*`` plain floats over its rounds (``count_rounds``),
  its recorded outcomes (``OutcomeCounts``) and ``estimate_tokens_saved``

The driver every host runs over these (history, rates and counters of a run, the step in
progress) is ``core.selective_run.SelectiveRun``.

Parameters (defaults): ``p_easy = p_hard = 0.5`` initially, target zero-variance share
``alpha = 0.25`` split as ``alpha / 3`` for easy and ``2 alpha / 3`` for hard groups, step
``0.01``, bounds ``[0.05, 0.95]``. These are the values of the authors' released trainer and
training scripts (github.com/Infini-AI-Lab/GRESO: ``p_easy``, ``p_hard``,
``target_zero_variance``, ``min_p``, ``max_p``); nothing of that code is reused here.

Choices where the description leaves room (each one is a documented behaviour, pinned by
``tests/core/test_selective.py``):

1. ``z_i`` counts the consecutive zero-variance *generations* of the latest one's kind
   (easy after hard starts a new streak at 1), as the authors' trainer counts trailing
   all-correct and trailing all-wrong groups apart; a skipped step records nothing (it
   neither extends nor breaks the streak). ``p_e`` is chosen by that kind. The 1% floor on
   the keep probability is the authors' trainer's too.
2. Easy means every reward of the group is ``>= easy_threshold`` (1.0: a correct answer);
   every other zero-variance group is hard (all wrong, or all equally partly right: not
   solved). A group of one completion is never zero-variance (as ``GroupStats``).
3. The exploration update runs once per training step over every group generated in that
   step (all refill rounds): share ``>=`` target lowers ``p`` by the step (skip more),
   otherwise raises it; the result is clamped to the bounds and rounded to 12 decimals so
   that repeated steps do not accumulate binary drift. No groups generated: no change. The
   released trainer starts adapting only after the first epoch; the function has no notion
   of epochs, so a host that wants that simply does not call it in epoch 0.
4. Randomness: one uniform per candidate, ``u = H(key(seed, step), prompt_id)`` where the
   key comes from a ``torch.Generator`` seeded by (seed, step) alone and H is SplitMix64 in
   wrapping int64 arithmetic. The decision for a prompt therefore depends on (seed, step,
   its id, its history, the rates) only: not on its batch position, the other candidates,
   the rank or a kernel. A prompt drawn twice in one step gets the same answer twice.
   ``skip = u < p_skip``, so p_skip = 0 never skips.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ._checks import as_1d_float, check_float, check_int
from .selection import seeded_generator
from .settings import CPPOConfig

__all__ = [
    "DEFAULT_EXPLORATION",
    "DEFAULT_P_MAX",
    "DEFAULT_P_MIN",
    "DEFAULT_STEP_SIZE",
    "DEFAULT_TARGET_EASY",
    "DEFAULT_TARGET_HARD",
    "DEFAULT_TARGET_ZERO_VARIANCE",
    "MIN_KEEP_PROB",
    "EASY",
    "HARD",
    "INFORMATIVE",
    "UNSEEN",
    "ExplorationRates",
    "FilledBatch",
    "GroupOutcomes",
    "HistoryView",
    "OutcomeCounts",
    "RoundCounts",
    "SelectiveHistory",
    "SkipDecision",
    "adapt_exploration",
    "adapt_from_config",
    "count_rounds",
    "decide_skips",
    "estimate_tokens_saved",
    "fill_batch",
    "group_outcomes",
    "load_run_state",
    "prompt_uniforms",
    "run_state",
    "step_metrics",
    "target_shares",
]

# ---------------------------------------------------------------------- constants
# outcome codes of one generation (int8 in the history)
INFORMATIVE = 0  # the group had reward variance
EASY = 1  # zero variance, every reward at the top (all correct)
HARD = 2  # zero variance otherwise (all wrong)
UNSEEN = -1  # ``last_outcome`` of a prompt never generated
OUTCOME_NAMES = {INFORMATIVE: "informative", EASY: "easy", HARD: "hard"}

DEFAULT_EXPLORATION = 0.5  # initial p_easy and p_hard
DEFAULT_TARGET_ZERO_VARIANCE = 0.25  # alpha: wanted share of zero-variance groups among those generated
DEFAULT_TARGET_EASY = DEFAULT_TARGET_ZERO_VARIANCE / 3  # alpha / 3 (target_shares)
DEFAULT_TARGET_HARD = DEFAULT_TARGET_ZERO_VARIANCE * 2 / 3  # 2 alpha / 3: hard prompts change more often
DEFAULT_STEP_SIZE = 0.01  # delta p per training step
DEFAULT_P_MIN = 0.05
DEFAULT_P_MAX = 0.95
MIN_KEEP_PROB = 0.01  # a prompt is generated with at least this chance, however long its streak

# stream of seeded_generator for the per-prompt draws (0: tie-breaks, 1: importance, 7: prompt sampler)
SELECTIVE_STREAM = 11
STATE_FORMAT = "cppo_megatron.selective.history/1"

_MASK64 = (1 << 64) - 1


def _i64(v: int) -> int:
    """The signed int64 with the bits of the unsigned 64-bit ``v``."""
    v &= _MASK64
    return v - (1 << 64) if v >= 1 << 63 else v


# (ids ascending, streak, last outcome, count, last step), each [P]
_Summary = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]

_GOLDEN = _i64(0x9E3779B97F4A7C15)
_MIX1 = _i64(0xBF58476D1CE4E5B9)
_MIX2 = _i64(0x94D049BB133111EB)


# ---------------------------------------------------------------------- input checks
def _as_prompt_ids(name: str, x: Any) -> torch.Tensor:
    """A 1-D int64 CPU tensor of non-negative prompt ids (may be empty), or a ValueError
    naming the bad entry."""
    if not isinstance(x, torch.Tensor):
        try:
            x = torch.as_tensor(x, dtype=torch.int64) if len(x) == 0 else torch.as_tensor(x)
        except Exception as exc:  # noqa: BLE001 - re-raised with the name
            raise ValueError(
                f"{name} must be a 1-D tensor of int64 prompt ids (the dataset's stable prompt index), "
                f"got {type(x).__name__}"
            ) from exc
    if x.dim() != 1:
        raise ValueError(f"{name} must be 1-D [n] prompt ids, got shape {tuple(x.shape)}")
    if x.is_floating_point() or x.dtype == torch.bool or x.is_complex():
        raise ValueError(
            f"{name} must be an integer tensor of prompt ids (the dataset's stable index, int64), "
            f"got dtype {x.dtype}; pass the index column, not positions or scores"
        )
    x = x.detach().to("cpu", torch.int64)
    if x.numel() and bool((x < 0).any()):
        i = int((x < 0).nonzero()[0])
        raise ValueError(f"{name}[{i}] = {int(x[i])} is negative; prompt ids are dataset indices >= 0")
    return x


def _as_bool(name: str, x: Any, n: int) -> torch.Tensor:
    """A 1-D bool CPU tensor of length n."""
    if not isinstance(x, torch.Tensor):
        try:
            x = torch.as_tensor(x, dtype=torch.bool) if len(x) == 0 else torch.as_tensor(x)
        except Exception as exc:  # noqa: BLE001
            raise ValueError(f"{name} must be a 1-D bool tensor, got {type(x).__name__}") from exc
    if x.dim() != 1:
        raise ValueError(f"{name} must be 1-D [M] bool, got shape {tuple(x.shape)}")
    if x.dtype != torch.bool:
        raise ValueError(f"{name} must have dtype torch.bool, got {x.dtype}; compare explicitly (x != 0)")
    if x.numel() != n:
        raise ValueError(f"{name} has {x.numel()} entries but prompt_ids has {n}: lengths must match")
    return x.detach().cpu()


def _check_probability(name: str, v: Any) -> float:
    """A number in (0, 1]."""
    v = check_float(name, v)
    if not 0.0 < v <= 1.0:
        raise ValueError(
            f"{name} = {v!r} must be in (0, 1]: it is the chance a zero-variance prompt is explored; "
            "0 would never revisit it, 1 never skips"
        )
    return v


def _check_seed(seed: Any) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    return seed


# ---------------------------------------------------------------------- outcomes of a round
@dataclass(frozen=True)
class GroupOutcomes:
    """What one generation round showed about each of its prompts.

    Attributes:
        prompt_ids: [M] int64 distinct prompt ids (dataset index), ascending.
        size: [M] int64 completions per prompt.
        mean: [M] float64 mean reward per prompt.
        zero_variance: [M] bool, two or more completions, all rewards equal.
        easy: [M] bool, zero variance with every reward ``>= easy_threshold`` (all correct).
        hard: [M] bool, zero variance and not easy (all wrong).
    """

    prompt_ids: torch.Tensor
    size: torch.Tensor
    mean: torch.Tensor
    zero_variance: torch.Tensor
    easy: torch.Tensor
    hard: torch.Tensor

    @property
    def num_groups(self) -> int:
        """M."""
        return int(self.prompt_ids.numel())

    @property
    def num_zero_variance(self) -> int:
        return int(self.zero_variance.sum())

    @property
    def num_easy(self) -> int:
        return int(self.easy.sum())

    @property
    def num_hard(self) -> int:
        return int(self.hard.sum())


def group_outcomes(rewards: torch.Tensor, prompt_ids: torch.Tensor, *, easy_threshold: float = 1.0) -> GroupOutcomes:
    """Per-prompt outcome of one generation round.

    Args:
        rewards: [N] float finite scalar rewards, one per completion.
        prompt_ids: [N] int64 the dataset's stable prompt index of each completion's prompt
            (not its position in the batch); completions of one prompt share it.
        easy_threshold: float; a zero-variance group whose reward is ``>= easy_threshold``
            is easy (all correct), any other zero-variance group is hard.

    Returns:
        a ``GroupOutcomes`` over the M distinct prompt ids, ascending. Rewards are compared
        exactly (max == min), as the released trainer does.
    """
    r = as_1d_float("rewards", rewards)
    g = _as_prompt_ids("prompt_ids", prompt_ids)
    if g.numel() != r.numel():
        raise ValueError(
            f"prompt_ids has {g.numel()} entries but rewards has {r.numel()}: give one prompt id per completion"
        )
    thr = check_float("easy_threshold", easy_threshold)
    r64 = r.detach().to("cpu", torch.float64)
    uniq, inverse, size = torch.unique(g, sorted=True, return_inverse=True, return_counts=True)
    m = uniq.numel()
    hi = torch.full((m,), -math.inf, dtype=torch.float64).scatter_reduce(0, inverse, r64, "amax")
    lo = torch.full((m,), math.inf, dtype=torch.float64).scatter_reduce(0, inverse, r64, "amin")
    mean = torch.zeros(m, dtype=torch.float64).index_add_(0, inverse, r64) / size
    zv = (size > 1) & (hi == lo)
    easy = zv & (lo >= thr)
    return GroupOutcomes(prompt_ids=uniq, size=size, mean=mean, zero_variance=zv, easy=easy, hard=zv & ~easy)


# ---------------------------------------------------------------------- history
def _distinct_runs(ids: list[int]) -> list[int]:
    """Cut points splitting the draw order into runs of distinct ids: [0, c1, ..., len(ids)],
    a cut wherever an id repeats one since the last cut."""
    cuts, seen = [0], set[int]()
    for i, pid in enumerate(ids):
        if pid in seen:
            cuts.append(i)
            seen = set()
        seen.add(pid)
    return cuts + [len(ids)]


@dataclass(frozen=True)
class HistoryView:
    """What the history knows about n queried prompts, aligned with the query.

    Attributes:
        prompt_ids: [n] int64 the query.
        seen: [n] bool, generated at least once.
        streak: [n] int64 z, consecutive zero-variance generations of the last one's kind, ending
            with the last (0 if unseen or the last had variance).
        last_outcome: [n] int8 ``INFORMATIVE`` / ``EASY`` / ``HARD`` of the last generation,
            ``UNSEEN`` (-1) if never generated.
        generations: [n] int64 times generated.
        last_step: [n] int64 step of the last generation, -1 if unseen.
    """

    prompt_ids: torch.Tensor
    seen: torch.Tensor
    streak: torch.Tensor
    last_outcome: torch.Tensor
    generations: torch.Tensor
    last_step: torch.Tensor


class SelectiveHistory:
    """Per-prompt record of every generation: (step, outcome), keyed by prompt id.

    The key is the dataset's stable prompt index, so a prompt keeps its history wherever
    it lands in later batches. The record is append-only in time: ``update`` takes a step
    no earlier than the last one recorded (several updates per step are fine: refill
    rounds). Besides the event log it keeps a per-prompt summary (streak, last outcome,
    count, last step) in ascending id order, so lookups are one ``searchsorted``.

    Use per step::

        decision = decide_skips(history, candidates, seed=seed, step=step, rates=rates)
        ...generate the kept prompts, reward them...
        o = group_outcomes(rewards, prompt_ids_per_completion)
        history.update(o.prompt_ids, o.zero_variance, o.easy, step=step)
    """

    def __init__(self) -> None:
        self._log_ids: list[torch.Tensor] = []
        self._log_steps: list[torch.Tensor] = []
        self._log_outcomes: list[torch.Tensor] = []
        self._num_events = 0
        self._latest_step = -1
        self._set_summary(*_empty_summary())

    def _set_summary(self, ids: torch.Tensor, streak: torch.Tensor, last: torch.Tensor, count: torch.Tensor,
                     last_step: torch.Tensor) -> None:
        # ids ascending; the others aligned with them
        self._ids, self._streak, self._last, self._count, self._last_step = ids, streak, last, count, last_step

    # ------------------------------------------------------------------ recording
    def update(self, prompt_ids: torch.Tensor, zero_variance: torch.Tensor, easy: torch.Tensor, *, step: int) -> None:
        """Record one generation round.

        Args:
            prompt_ids: [M] int64 prompt ids (dataset index) generated in the round, in draw
                order; a prompt generated twice (a small data set crossing an epoch) is recorded
                twice, in that order.
            zero_variance: [M] bool, the prompt's group had zero reward variance.
            easy: [M] bool, zero variance with all rewards at the top; must imply
                ``zero_variance``.
            step: int >= 0, the training step; not earlier than the last recorded step.
        """
        ids = _as_prompt_ids("prompt_ids", prompt_ids)
        m = ids.numel()
        zv = _as_bool("zero_variance", zero_variance, m)
        ez = _as_bool("easy", easy, m)
        bad = ez & ~zv
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise ValueError(
                f"easy[{i}] is True for prompt id {int(ids[i])} but zero_variance[{i}] is False: an easy group "
                "is a zero-variance group (all rewards at the top); take both from group_outcomes"
            )
        check_int("step", step, minimum=0)
        if step < self._latest_step:
            raise ValueError(
                f"step={step} is before the last recorded step {self._latest_step}: the history is "
                "append-only in time; record rounds in the order they were generated"
            )
        if m == 0:
            self._latest_step = max(self._latest_step, step)
            return
        # the summary merge below takes distinct ids: cut the draw order where an id repeats
        for a, b in itertools.pairwise(_distinct_runs(ids.tolist())):
            self._merge(ids[a:b], zv[a:b], ez[a:b], step)

    def _merge(self, ids: torch.Tensor, zv: torch.Tensor, ez: torch.Tensor, step: int) -> None:
        """Append one run of distinct ids to the log and fold it into the summary."""
        m = ids.numel()
        outcome = torch.where(
            zv, torch.where(ez, torch.tensor(EASY, dtype=torch.int8), torch.tensor(HARD, dtype=torch.int8)),
            torch.tensor(INFORMATIVE, dtype=torch.int8),
        )
        steps = torch.full((m,), step, dtype=torch.int64)
        self._log_ids.append(ids)
        self._log_steps.append(steps)
        self._log_outcomes.append(outcome)
        self._num_events += m
        self._latest_step = step

        # merge the round into the summary (ids are distinct within the round)
        p = self._ids.numel()
        uniq, inverse = torch.unique(torch.cat([self._ids, ids]), sorted=True, return_inverse=True)
        u = uniq.numel()
        old, new = inverse[:p], inverse[p:]
        streak = torch.zeros(u, dtype=torch.int64)
        last = torch.full((u,), UNSEEN, dtype=torch.int8)
        count = torch.zeros(u, dtype=torch.int64)
        last_step = torch.full((u,), -1, dtype=torch.int64)
        streak[old], last[old], count[old], last_step[old] = self._streak, self._last, self._count, self._last_step
        # a run of the same kind extends the streak; the other kind starts a new one (the
        # authors' trainer counts trailing all-correct and trailing all-wrong groups apart)
        same_kind = zv & (outcome == last[new])
        streak[new] = torch.where(same_kind, streak[new] + 1, zv.to(torch.int64))
        last[new] = outcome
        count[new] += 1
        last_step[new] = step
        self._set_summary(uniq, streak, last, count, last_step)

    # ------------------------------------------------------------------ reading
    @property
    def num_prompts(self) -> int:
        """Distinct prompts generated at least once."""
        return int(self._ids.numel())

    @property
    def num_events(self) -> int:
        """Generations recorded (one per prompt per round)."""
        return self._num_events

    @property
    def latest_step(self) -> int:
        """The last step recorded, -1 before any."""
        return self._latest_step

    def lookup(self, prompt_ids: torch.Tensor) -> HistoryView:
        """The summary of each queried prompt.

        Args:
            prompt_ids: [n] int64 prompt ids (dataset index); repeats allowed.

        Returns:
            a ``HistoryView`` aligned with ``prompt_ids``.
        """
        q = _as_prompt_ids("prompt_ids", prompt_ids)
        n = q.numel()
        if self._ids.numel() == 0 or n == 0:
            return HistoryView(
                prompt_ids=q, seen=torch.zeros(n, dtype=torch.bool), streak=torch.zeros(n, dtype=torch.int64),
                last_outcome=torch.full((n,), UNSEEN, dtype=torch.int8), generations=torch.zeros(n, dtype=torch.int64),
                last_step=torch.full((n,), -1, dtype=torch.int64),
            )
        pos = torch.searchsorted(self._ids, q).clamp_max(self._ids.numel() - 1)
        seen = self._ids[pos] == q
        zero64 = torch.zeros(n, dtype=torch.int64)
        return HistoryView(
            prompt_ids=q,
            seen=seen,
            streak=torch.where(seen, self._streak[pos], zero64),
            last_outcome=torch.where(seen, self._last[pos], torch.full((n,), UNSEEN, dtype=torch.int8)),
            generations=torch.where(seen, self._count[pos], zero64),
            last_step=torch.where(seen, self._last_step[pos], zero64 - 1),
        )

    def trace(self, prompt_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(steps [E_i] int64, outcomes [E_i] int8) of every generation of one prompt, in order."""
        check_int("prompt_id", prompt_id, minimum=0)
        ids, steps, outcomes = self._log()
        hit = ids == prompt_id
        return steps[hit], outcomes[hit]

    def _log(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self._log_ids:
            return (torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
                    torch.zeros(0, dtype=torch.int8))
        if len(self._log_ids) > 1:  # compact the chunks once
            self._log_ids = [torch.cat(self._log_ids)]
            self._log_steps = [torch.cat(self._log_steps)]
            self._log_outcomes = [torch.cat(self._log_outcomes)]
        return self._log_ids[0], self._log_steps[0], self._log_outcomes[0]

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> dict[str, Any]:
        """The event log in recording order: plain tensors and ints, no per-prompt dicts.

        ``{"format": str, "latest_step": int, "prompt_ids": [E] int64, "steps": [E] int64,
        "outcomes": [E] int8}``; the summary is rebuilt from the log on load.
        """
        ids, steps, outcomes = self._log()
        return {
            "format": STATE_FORMAT,
            "latest_step": self._latest_step,
            "prompt_ids": ids.clone(),
            "steps": steps.clone(),
            "outcomes": outcomes.clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``; a malformed log is an error naming the bad entry."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            got = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise ValueError(
                f"selective history state has format {got!r}, expected {STATE_FORMAT!r}: "
                "pass what SelectiveHistory.state_dict() returned"
            )
        ids = _as_prompt_ids("state['prompt_ids']", state["prompt_ids"])
        steps = torch.as_tensor(state["steps"]).to("cpu", torch.int64)
        outcomes = torch.as_tensor(state["outcomes"]).to("cpu", torch.int8)
        if not (steps.dim() == outcomes.dim() == 1 and steps.numel() == outcomes.numel() == ids.numel()):
            raise ValueError(
                f"state['prompt_ids'] ({ids.numel()}), state['steps'] ({steps.numel()}) and state['outcomes'] "
                f"({outcomes.numel()}) must be 1-D of one length"
            )
        bad = (outcomes < INFORMATIVE) | (outcomes > HARD)
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise ValueError(f"state['outcomes'][{i}] = {int(outcomes[i])} is not one of {sorted(OUTCOME_NAMES)}")
        if steps.numel() and bool((steps < 0).any() or (steps[1:] < steps[:-1]).any()):
            i = int(((steps < 0) | torch.cat([torch.tensor([False]), steps[1:] < steps[:-1]])).nonzero()[0])
            raise ValueError(
                f"state['steps'][{i}] = {int(steps[i])} is negative or earlier than the entry before it: "
                "the log is recorded in time order"
            )
        latest = state.get("latest_step", int(steps[-1]) if steps.numel() else -1)
        check_int("state['latest_step']", latest, minimum=-1)
        self._log_ids, self._log_steps, self._log_outcomes = [ids], [steps], [outcomes]
        self._num_events = int(ids.numel())
        self._latest_step = max(latest, int(steps[-1]) if steps.numel() else -1)
        self._set_summary(*_summarise(ids, steps, outcomes))


def _empty_summary() -> _Summary:
    return (torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int8),
            torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))


def _summarise(ids: torch.Tensor, steps: torch.Tensor, outcomes: torch.Tensor) -> _Summary:
    """The per-prompt summary (ids ascending, streak, last outcome, count, last step) of an
    event log [E] in recording order."""
    e = ids.numel()
    if e == 0:
        return _empty_summary()
    order = torch.sort(ids, stable=True).indices  # by prompt, recording order within each
    s_ids, s_steps, s_out = ids[order], steps[order], outcomes[order]
    uniq, inverse, count = torch.unique_consecutive(s_ids, return_inverse=True, return_counts=True)
    start = torch.cumsum(count, 0) - count
    rank = torch.arange(e) - start[inverse]
    last_idx = start + count - 1
    last_out = s_out[last_idx]
    # the streak: the trailing run of the last outcome's kind (0 when the last had variance)
    other_rank = torch.where(s_out != last_out[inverse], rank, torch.full_like(rank, -1))
    last_other = torch.full((uniq.numel(),), -1, dtype=torch.int64).scatter_reduce(0, inverse, other_rank, "amax")
    streak = torch.where(last_out == INFORMATIVE, torch.zeros_like(count), count - (last_other + 1))
    return uniq, streak, last_out, count, s_steps[last_idx]


# ---------------------------------------------------------------------- exploration rates
@dataclass(frozen=True)
class ExplorationRates:
    """The base exploration probabilities p_e, each in (0, 1].

    Attributes:
        p_easy: float, for prompts whose last group was all correct.
        p_hard: float, for prompts whose last group was zero-variance and not all correct.
    """

    p_easy: float = DEFAULT_EXPLORATION
    p_hard: float = DEFAULT_EXPLORATION

    def __post_init__(self) -> None:
        object.__setattr__(self, "p_easy", _check_probability("p_easy", self.p_easy))
        object.__setattr__(self, "p_hard", _check_probability("p_hard", self.p_hard))


def run_state(history: SelectiveHistory, rates: ExplorationRates, totals: dict[str, float]) -> dict[str, Any]:
    """What a host saves of a selective-rollout run: the history (its event log), the rates and
    the running counters, as plain tensors and numbers (``load_run_state`` reads it back)."""
    return {"history": history.state_dict(), "rates": {"p_easy": rates.p_easy, "p_hard": rates.p_hard},
            "totals": dict(totals)}


def load_run_state(state: Any, counters: Sequence[str]) -> tuple[SelectiveHistory, ExplorationRates, dict[str, float]]:
    """(history, rates, totals) from ``run_state``'s dict; ``counters``: the names the host keeps
    (a missing one is 0). A malformed entry or an unknown counter is a ValueError naming it."""
    if not isinstance(state, dict) or not {"history", "rates", "totals"} <= set(state):
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"selective rollout state must have history, rates and totals, got {got}")
    history = SelectiveHistory()
    history.load_state_dict(state["history"])
    rates = ExplorationRates(**state["rates"])
    unknown = sorted(set(state["totals"]) - set(counters))
    if unknown:
        raise ValueError(f"selective rollout state: unknown counter(s) {unknown}; known: {list(counters)}")
    return history, rates, {k: float(state["totals"].get(k, 0.0)) for k in counters}


def target_shares(alpha: float) -> tuple[float, float]:
    """(target_easy, target_hard) for ``adapt_exploration`` from alpha, the wanted share of
    zero-variance groups among those generated: alpha / 3 easy and 2 alpha / 3 hard (a hard
    prompt is more likely to turn informative as the policy improves, so more are kept)."""
    a = check_float("alpha", alpha, minimum=0.0)
    if a > 1.0:
        raise ValueError(f"alpha = {alpha!r} must be a share in [0, 1] (the wanted share of zero-variance groups)")
    return a / 3, 2 * a / 3


def adapt_exploration(
    rates: ExplorationRates,
    *,
    num_generated: int,
    num_easy: int,
    num_hard: int,
    target_easy: float = DEFAULT_TARGET_EASY,
    target_hard: float = DEFAULT_TARGET_HARD,
    step_size: float = DEFAULT_STEP_SIZE,
    p_min: float = DEFAULT_P_MIN,
    p_max: float = DEFAULT_P_MAX,
) -> ExplorationRates:
    """The next exploration probabilities, easy and hard separately.

    For each kind k with share s_k = num_k / num_generated of the groups generated this
    step: ``p_k - step_size`` if ``s_k >= target_k`` (too many zero-variance groups: skip
    more), else ``p_k + step_size``; then clamped to ``[p_min, p_max]`` and rounded to 12
    decimals.

    Args:
        rates: the current ``ExplorationRates``.
        num_generated: int >= 0, groups (prompts) generated this step, every round.
        num_easy: int >= 0, of them zero-variance and all correct.
        num_hard: int >= 0, of them zero-variance and not all correct.
        target_easy, target_hard: the wanted shares in [0, 1] (alpha / 3 and 2 alpha / 3,
            alpha = 0.25).
        step_size: delta p >= 0 (0.01).
        p_min, p_max: bounds with 0 < p_min <= p_max <= 1 (0.05, 0.95).

    Returns:
        new ``ExplorationRates``; ``rates`` unchanged when ``num_generated`` is 0.
    """
    if not isinstance(rates, ExplorationRates):
        raise ValueError(f"rates must be an ExplorationRates, got {type(rates).__name__}")
    check_int("num_generated", num_generated, minimum=0)
    check_int("num_easy", num_easy, minimum=0)
    check_int("num_hard", num_hard, minimum=0)
    if num_easy + num_hard > num_generated:
        raise ValueError(
            f"num_easy ({num_easy}) + num_hard ({num_hard}) exceeds num_generated ({num_generated}): "
            "count the zero-variance groups among the generated ones (GroupOutcomes.num_easy / num_hard)"
        )
    for name, v in (("target_easy", target_easy), ("target_hard", target_hard)):
        if not 0.0 <= check_float(name, v) <= 1.0:
            raise ValueError(f"{name} = {v!r} must be a share in [0, 1]")
    step_size = check_float("step_size", step_size, minimum=0.0)
    p_min = _check_probability("p_min", p_min)
    p_max = _check_probability("p_max", p_max)
    if p_min > p_max:
        raise ValueError(f"p_min = {p_min} is larger than p_max = {p_max}: swap them")
    if num_generated == 0:
        return rates

    def move(p: float, count: int, target: float) -> float:
        p = p - step_size if count / num_generated >= target else p + step_size
        return round(min(max(p, p_min), p_max), 12)

    return ExplorationRates(
        p_easy=move(rates.p_easy, num_easy, float(target_easy)),
        p_hard=move(rates.p_hard, num_hard, float(target_hard)),
    )


# ---------------------------------------------------------------------- the decision
def _lshr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser over int64 bit patterns (multiplications wrap mod 2^64)."""
    x = (x ^ _lshr(x, 30)) * _MIX1
    x = (x ^ _lshr(x, 27)) * _MIX2
    return x ^ _lshr(x, 31)


def prompt_uniforms(prompt_ids: torch.Tensor, *, seed: int, step: int) -> torch.Tensor:
    """One uniform in [0, 1) per prompt, a function of (seed, step, prompt id) only.

    A ``torch.Generator`` seeded by (seed, step) draws a 64-bit key; prompt i's value is
    ``splitmix64(key + (i + 1) * 0x9E3779B97F4A7C15) >> 11`` times 2^-53 (all mod 2^64).

    Args:
        prompt_ids: [n] int64 prompt ids (dataset index).
        seed: int; step: int >= 0.

    Returns:
        [n] float64, aligned with ``prompt_ids``; equal ids get equal values.
    """
    ids = _as_prompt_ids("prompt_ids", prompt_ids)
    seed = _check_seed(seed)
    check_int("step", step, minimum=0)
    halves = torch.randint(0, 1 << 32, (2,), generator=seeded_generator(seed, step, stream=SELECTIVE_STREAM))
    key = _i64((int(halves[0]) << 32) | int(halves[1]))
    h = _splitmix64(key + (ids + 1) * _GOLDEN)
    return _lshr(h, 11).to(torch.float64) * 2.0**-53


@dataclass(frozen=True)
class SkipDecision:
    """Which candidates to skip before rollout, and why.

    Attributes:
        prompt_ids: [n] int64 the candidates, in the order given.
        skip: [n] bool, True = do not generate this prompt now.
        skip_prob: [n] float64, 1 - max(p_e ** streak, MIN_KEEP_PROB) (0 for unseen and
            last-informative prompts).
        draws: [n] float64 uniforms in [0, 1); ``skip = draws < skip_prob``.
        streak: [n] int64 z, consecutive zero-variance generations of the last one's kind.
        last_outcome: [n] int8 ``INFORMATIVE`` / ``EASY`` / ``HARD``, ``UNSEEN`` (-1).
        rates: the ``ExplorationRates`` used.
        seed, step: what the draws were derived from.
    """

    prompt_ids: torch.Tensor
    skip: torch.Tensor
    skip_prob: torch.Tensor
    draws: torch.Tensor
    streak: torch.Tensor
    last_outcome: torch.Tensor
    rates: ExplorationRates
    seed: int
    step: int

    @property
    def num_candidates(self) -> int:
        return int(self.prompt_ids.numel())

    @property
    def num_skipped(self) -> int:
        return int(self.skip.sum())

    @property
    def num_kept(self) -> int:
        return self.num_candidates - self.num_skipped

    @property
    def num_skipped_easy(self) -> int:
        return int((self.skip & (self.last_outcome == EASY)).sum())

    @property
    def num_skipped_hard(self) -> int:
        return int((self.skip & (self.last_outcome == HARD)).sum())

    @property
    def num_unseen(self) -> int:
        return int((self.last_outcome == UNSEEN).sum())

    def kept_ids(self) -> torch.Tensor:
        """[n - s] int64 ids to generate, in candidate order."""
        return self.prompt_ids[~self.skip]

    def skipped_ids(self) -> torch.Tensor:
        """[s] int64 ids skipped, in candidate order."""
        return self.prompt_ids[self.skip]


def decide_skips(
    history: SelectiveHistory,
    candidate_ids: torch.Tensor,
    *,
    seed: int,
    step: int,
    rates: ExplorationRates,
) -> SkipDecision:
    """Skip each candidate with probability 1 - max(p_e ** z, MIN_KEEP_PROB) (module docstring).

    Args:
        history: the ``SelectiveHistory`` up to the previous round.
        candidate_ids: [n] int64 prompt ids (dataset index); any order, repeats allowed.
        seed: int, the run's seed.
        step: int >= 0, the training step (mixed into the draws).
        rates: the current ``ExplorationRates``.

    Returns:
        a ``SkipDecision`` aligned with ``candidate_ids``. A candidate's entry depends on
        its id, its history, (seed, step) and ``rates`` only.
    """
    if not isinstance(history, SelectiveHistory):
        raise ValueError(f"history must be a SelectiveHistory, got {type(history).__name__}")
    if not isinstance(rates, ExplorationRates):
        raise ValueError(
            f"rates must be an ExplorationRates (p_easy, p_hard), got {type(rates).__name__}; "
            "build one with ExplorationRates(p_easy=0.5, p_hard=0.5)"
        )
    view = history.lookup(candidate_ids)
    draws = prompt_uniforms(view.prompt_ids, seed=seed, step=step)
    p_e = torch.where(view.last_outcome == EASY, torch.tensor(rates.p_easy, dtype=torch.float64),
                      torch.tensor(rates.p_hard, dtype=torch.float64))
    # keep with p_e ** z, never below MIN_KEEP_PROB (the authors' floor); streak 0: exactly 0
    keep_prob = torch.pow(p_e, view.streak.to(torch.float64)).clamp_min(MIN_KEEP_PROB)
    skip_prob = 1.0 - keep_prob
    return SkipDecision(
        prompt_ids=view.prompt_ids,
        skip=draws < skip_prob,
        skip_prob=skip_prob,
        draws=draws,
        streak=view.streak,
        last_outcome=view.last_outcome,
        rates=rates,
        seed=seed,
        step=step,
    )


# ---------------------------------------------------------------------- filling a batch
@dataclass(frozen=True)
class FilledBatch:
    """The outcome of ``fill_batch``: every drawn candidate is kept or skipped, none lost.

    Attributes:
        decision: the ``SkipDecision`` over every drawn candidate, in draw order (what the rule
            said for each).
        wanted: int, the prompts asked for.
        exhausted: bool, the stream ended (or ``max_draws`` was reached) before ``wanted``
            were kept by the rule.
        forced: [d] bool, candidates the rule skipped but the fill kept all the same (``min_keep``:
            the draw cap was reached with too few kept); None means none.
        capped: bool, the fill stopped at ``max_draws`` (not at the end of the stream).
    """

    decision: SkipDecision
    wanted: int
    exhausted: bool
    forced: torch.Tensor | None = None
    capped: bool = False

    def __post_init__(self) -> None:
        if self.forced is None:
            object.__setattr__(self, "forced", torch.zeros(self.decision.num_candidates, dtype=torch.bool))
        elif self.forced.dtype != torch.bool or self.forced.shape != self.decision.skip.shape:
            raise ValueError(f"FilledBatch.forced must be a [d] = [{self.decision.num_candidates}] bool mask aligned "
                             f"with decision, got {self.forced.dtype} of shape {tuple(self.forced.shape)}")
        elif (forced_kept := (self.forced & ~self.decision.skip).nonzero()).numel():
            i = int(forced_kept[0, 0])
            raise ValueError(f"FilledBatch.forced[{i}] is True but the rule kept candidate {i} (prompt id "
                             f"{int(self.decision.prompt_ids[i])}): only skipped candidates can be forced")

    @property
    def forced_mask(self) -> torch.Tensor:
        """[d] bool, ``forced`` (never None once built)."""
        assert self.forced is not None  # __post_init__ fills None with zeros
        return self.forced

    @property
    def kept_mask(self) -> torch.Tensor:
        """[d] bool, the candidates generated: kept by the rule, or forced."""
        return ~self.decision.skip | self.forced_mask

    @property
    def drawn(self) -> torch.Tensor:
        """[d] int64 every candidate taken from the stream, in order."""
        return self.decision.prompt_ids

    @property
    def kept(self) -> torch.Tensor:
        """[k] int64 ids to generate, in draw order; k = wanted unless exhausted (forced ones included)."""
        return self.decision.prompt_ids[self.kept_mask]

    @property
    def skipped(self) -> torch.Tensor:
        """[d - k] int64 ids skipped, in draw order."""
        return self.decision.prompt_ids[~self.kept_mask]

    @property
    def num_forced(self) -> int:
        return int(self.forced_mask.sum())


CandidateSource = Iterable[int] | Callable[[int], Sequence[int]]


def _as_id(v: Any, index: int) -> int:
    if isinstance(v, torch.Tensor) and v.numel() == 1 and not v.is_floating_point() and v.dtype != torch.bool:
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(
            f"candidate #{index} from the stream is {v!r}: candidates must be prompt ids, ints >= 0 "
            "(the dataset's stable index)"
        )
    return v


def _taker(candidates: CandidateSource) -> Callable[[int], list[Any]]:
    """``take(n)``: up to n more candidates from an iterable, a tensor or a ``draw(n)`` callable."""
    if callable(candidates) and not isinstance(candidates, Iterable):
        draw_fn = candidates

        def take(n: int) -> list[Any]:
            got = list(draw_fn(n))
            if len(got) > n:
                raise ValueError(f"the candidate source returned {len(got)} ids when asked for {n}")
            return got

        return take
    if isinstance(candidates, torch.Tensor):
        candidates = _as_prompt_ids("candidates", candidates).tolist()
    it = iter(candidates)
    return lambda n: list(itertools.islice(it, n))


def fill_batch(
    candidates: CandidateSource,
    wanted: int,
    history: SelectiveHistory,
    *,
    seed: int,
    step: int,
    rates: ExplorationRates,
    max_draws: int | None = None,
    min_keep: int = 0,
) -> FilledBatch:
    """Take candidates in order, skip per ``decide_skips``, until ``wanted`` are kept.

    Each pass takes exactly as many candidates as are still missing, so a pass can never
    overshoot: every candidate taken from the stream is decided and ends up kept or
    skipped, and no candidate is taken that is not. The result equals deciding the drawn
    candidates one by one (decisions are per prompt id).

    Args:
        candidates: an iterable of prompt ids (pass an iterator to continue where the last
            call stopped; a list restarts from its head), or a callable ``draw(n)``
            returning up to n ids (``PromptSampler.draw``; fewer than n means the end).
        wanted: int >= 0, prompts to keep.
        history, seed, step, rates: as for ``decide_skips``.
        max_draws: int >= 0 or None; at most this many candidates are taken (set it for
            an endless stream: prompts whose skip probability is near 1 could otherwise
            be drawn for a long time).
        min_keep: int in [0, wanted]; when ``max_draws`` is reached with fewer kept, the last
            skipped candidates drawn are kept all the same (``forced``), up to ``min_keep``: a
            host that must generate something never gets nothing. The last drawn, not the one
            with the highest keep probability: the prompt the host's own order hands at that
            point, as without selective rollout; when every prompt sits at the keep floor, the
            "best" would be the one with the largest uniform, the same prompt for every fill of
            a step (a prompt's uniform depends on (seed, step, id) only). The end of the stream
            forces nothing (the data ended: the host ends its pass as it would without selective
            rollout).

    Returns:
        a ``FilledBatch``: ``kept`` [k], ``skipped`` [d - k], ``drawn`` [d], in draw order.
    """
    check_int("wanted", wanted, minimum=0)
    if max_draws is not None:
        check_int("max_draws", max_draws, minimum=0)
    if check_int("min_keep", min_keep, minimum=0) > wanted:
        raise ValueError(f"min_keep={min_keep} is more than wanted={wanted}: a fill keeps at most what it is asked for")
    if not isinstance(history, SelectiveHistory):
        raise ValueError(f"history must be a SelectiveHistory, got {type(history).__name__}")
    if not isinstance(rates, ExplorationRates):
        raise ValueError(f"rates must be an ExplorationRates, got {type(rates).__name__}")
    _check_seed(seed)
    check_int("step", step, minimum=0)

    take = _taker(candidates)
    drawn: list[int] = []
    kept = 0
    exhausted = capped = False
    while kept < wanted:
        need = wanted - kept
        if max_draws is not None:
            need = min(need, max_draws - len(drawn))
            if need == 0:
                exhausted = capped = True
                break
        chunk = [_as_id(v, len(drawn) + j) for j, v in enumerate(take(need))]
        if chunk:
            d = decide_skips(history, torch.tensor(chunk, dtype=torch.int64), seed=seed, step=step, rates=rates)
            kept += d.num_kept
            drawn.extend(chunk)
        if len(chunk) < need:  # the stream ended: kept < wanted (a short chunk cannot fill it)
            exhausted = True
            break
    decision = decide_skips(history, torch.tensor(drawn, dtype=torch.int64), seed=seed, step=step, rates=rates)
    forced = torch.zeros(len(drawn), dtype=torch.bool)
    if capped and kept < min_keep:
        forced[decision.skip.nonzero().squeeze(1)[kept - min_keep:]] = True  # the last skipped ones
    return FilledBatch(decision=decision, wanted=wanted, exhausted=exhausted, forced=forced, capped=capped)


# ---------------------------------------------------------------------- a step's counts and metrics
@dataclass(frozen=True)
class RoundCounts:
    """Prompts taken over the generation rounds of one step (``count_rounds``).

    Attributes:
        drawn: int, candidates taken from the stream, every round.
        skipped: int, of them skipped; ``drawn = skipped + generated``.
        generated: int, of them kept (generated).
        skipped_easy, skipped_hard: int, the skipped ones by the kind of their last group.
        forced: int, of the generated ones those the rule skipped but a fill kept (``min_keep``).
    """

    drawn: int
    skipped: int
    generated: int
    skipped_easy: int
    skipped_hard: int
    forced: int = 0


def _check_rounds(rounds: Any) -> list[FilledBatch]:
    if isinstance(rounds, FilledBatch):
        raise ValueError("rounds is one FilledBatch; pass the step's rounds as a list ([fb] for a single round)")
    if isinstance(rounds, (str, bytes)) or not isinstance(rounds, Sequence):
        raise ValueError(
            f"rounds must be a sequence of FilledBatch (one per generation round of the step), got "
            f"{type(rounds).__name__}"
        )
    for i, fb in enumerate(rounds):
        if not isinstance(fb, FilledBatch):
            raise ValueError(f"rounds[{i}] is a {type(fb).__name__}, not a FilledBatch; pass what fill_batch returned")
    return list(rounds)


def count_rounds(rounds: Sequence[FilledBatch]) -> RoundCounts:
    """Sum the draws of one step over its rounds.

    Args:
        rounds: the step's ``FilledBatch`` es, one per generation round (may be empty).

    Returns:
        a ``RoundCounts`` over every round.
    """
    fbs = _check_rounds(rounds)

    def skipped_of(kind: int) -> int:
        return sum(int((~fb.kept_mask & (fb.decision.last_outcome == kind)).sum()) for fb in fbs)

    return RoundCounts(
        drawn=sum(fb.decision.num_candidates for fb in fbs),
        skipped=sum(int((~fb.kept_mask).sum()) for fb in fbs),
        generated=sum(int(fb.kept_mask.sum()) for fb in fbs),
        skipped_easy=skipped_of(EASY),
        skipped_hard=skipped_of(HARD),
        forced=sum(fb.num_forced for fb in fbs),
    )


@dataclass(frozen=True)
class OutcomeCounts:
    """How many groups a step generated and recorded, and how many of them had zero variance.

    Attributes:
        num_groups: int >= 0, groups recorded.
        num_easy: int >= 0, of them zero-variance and all correct.
        num_hard: int >= 0, of them zero-variance and not all correct; ``num_easy + num_hard <=
            num_groups``.
    """

    num_groups: int
    num_easy: int
    num_hard: int

    def __post_init__(self) -> None:
        for name in ("num_groups", "num_easy", "num_hard"):
            check_int(name, getattr(self, name), minimum=0)
        if self.num_easy + self.num_hard > self.num_groups:
            raise ValueError(
                f"num_easy ({self.num_easy}) + num_hard ({self.num_hard}) exceeds num_groups ({self.num_groups}): "
                "count the zero-variance groups among the recorded ones"
            )

    @property
    def num_zero_variance(self) -> int:
        return self.num_easy + self.num_hard

    @classmethod
    def from_flags(cls, zero_variance: torch.Tensor, easy: torch.Tensor) -> OutcomeCounts:
        """From per-group flags aligned with each other: zero_variance [M] bool, easy [M] bool
        (easy implies zero variance; what ``group_outcomes`` gives)."""
        zv, ez = torch.as_tensor(zero_variance), torch.as_tensor(easy)
        for name, x in (("zero_variance", zv), ("easy", ez)):
            if x.dim() != 1 or x.dtype != torch.bool:
                raise ValueError(f"{name} must be a 1-D bool tensor [M], got shape {tuple(x.shape)} dtype {x.dtype}")
        if ez.numel() != zv.numel():
            raise ValueError(f"easy has {ez.numel()} entries but zero_variance has {zv.numel()}: one per group")
        bad = ez & ~zv
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise ValueError(f"easy[{i}] is True but zero_variance[{i}] is False: an easy group is a zero-variance "
                             "group; take both from group_outcomes")
        return cls(num_groups=int(zv.numel()), num_easy=int(ez.sum()), num_hard=int((zv & ~ez).sum()))


def _as_counts(outcomes: Any) -> OutcomeCounts:
    if isinstance(outcomes, OutcomeCounts):
        return outcomes
    if isinstance(outcomes, GroupOutcomes):
        return OutcomeCounts(num_groups=outcomes.num_groups, num_easy=outcomes.num_easy, num_hard=outcomes.num_hard)
    raise ValueError(
        f"outcomes must be a GroupOutcomes (group_outcomes) or an OutcomeCounts, got {type(outcomes).__name__}"
    )


def adapt_from_config(rates: ExplorationRates, cfg: CPPOConfig, outcomes: GroupOutcomes | OutcomeCounts
                      ) -> ExplorationRates:
    """``adapt_exploration`` with the targets, step and bounds of a ``CPPOConfig``'s ``selective`` section.

    Args:
        rates: the current ``ExplorationRates``.
        cfg: the run's ``CPPOConfig`` (``selective.target_zero_variance`` gives the targets through
            ``target_shares``; ``selective.step_size``, ``selective.p_min``, ``selective.p_max``).
        outcomes: the groups generated and recorded this step (``GroupOutcomes`` or ``OutcomeCounts``).

    Returns:
        the next ``ExplorationRates`` (``rates`` when no group was recorded).
    """
    if not isinstance(cfg, CPPOConfig):
        raise ValueError(f"cfg must be a CPPOConfig (its selective section), got {type(cfg).__name__}")
    o = _as_counts(outcomes)
    target_easy, target_hard = target_shares(cfg.selective.target_zero_variance)
    return adapt_exploration(
        rates, num_generated=o.num_groups, num_easy=o.num_easy, num_hard=o.num_hard,
        target_easy=target_easy, target_hard=target_hard, step_size=cfg.selective.step_size,
        p_min=cfg.selective.p_min, p_max=cfg.selective.p_max,
    )


def estimate_tokens_saved(num_skipped: int, group_size: int, completion_lengths: torch.Tensor) -> float:
    """Tokens the skipped prompts would have generated, estimated as ``num_skipped x group_size x``
    the mean length of this step's generated completions (their own length is unknown: they were
    never generated).

    Args:
        num_skipped: int >= 0, prompts skipped this step.
        group_size: int >= 1, G, completions per prompt.
        completion_lengths: [N] int or float, tokens generated per completion this step (may be
            empty: the estimate is then 0).

    Returns:
        float >= 0.
    """
    check_int("num_skipped", num_skipped, minimum=0)
    check_int("group_size", group_size, minimum=1)
    lengths = as_1d_float("completion_lengths", completion_lengths, allow_empty=True)
    if lengths.numel() and bool((lengths < 0).any()):
        i = int((lengths < 0).nonzero()[0])
        raise ValueError(f"completion_lengths[{i}] = {lengths[i].item()} is negative; give tokens per completion")
    n = int(lengths.numel())
    # summed in float64 from the given values (an int64 count stays exact)
    mean_length = float(torch.as_tensor(completion_lengths).detach().cpu().double().sum()) / n if n else 0.0
    return num_skipped * group_size * mean_length


def step_metrics(
    rounds: Sequence[FilledBatch],
    rates: ExplorationRates,
    outcomes: GroupOutcomes | OutcomeCounts,
    *,
    tokens_saved: float | None = None,
    prefix: str = "selective/",
) -> dict[str, float]:
    """The ``selective/*`` metrics of one training step, plain floats; hosts add their own keys.

    Args:
        rounds: the step's ``FilledBatch`` es, one per generation round (every candidate drawn).
        rates: the exploration rates to report (after this step's ``adapt_exploration``, if it ran).
        outcomes: the groups generated and recorded this step (``GroupOutcomes`` or ``OutcomeCounts``);
            the shares are of ``outcomes.num_groups`` (0 when it is 0).
        tokens_saved: float >= 0, this step's ``estimate_tokens_saved``; None leaves the key out.
        prefix: key prefix.

    Returns:
        ``prompts_drawn``, ``prompts_skipped``, ``prompts_generated`` (drawn = skipped + generated,
        summed over the rounds), ``skipped_easy``, ``skipped_hard``, ``skip_ratio`` (skipped / drawn,
        0 when nothing was drawn), ``forced_keeps`` (generated although skipped: ``fill_batch``'s
        ``min_keep``), ``zero_variance_share``, ``easy_share``, ``hard_share``,
        ``tokens_saved_estimate`` (with ``tokens_saved``), ``p_easy``, ``p_hard``.
    """
    c = count_rounds(rounds)
    if not isinstance(rates, ExplorationRates):
        raise ValueError(f"rates must be an ExplorationRates, got {type(rates).__name__}")
    o = _as_counts(outcomes)
    if not isinstance(prefix, str):
        raise ValueError(f"prefix must be a str such as 'selective/', got {type(prefix).__name__}")
    m = o.num_groups
    out = {
        f"{prefix}prompts_drawn": float(c.drawn),
        f"{prefix}prompts_skipped": float(c.skipped),
        f"{prefix}prompts_generated": float(c.generated),
        f"{prefix}skipped_easy": float(c.skipped_easy),
        f"{prefix}skipped_hard": float(c.skipped_hard),
        f"{prefix}skip_ratio": c.skipped / c.drawn if c.drawn else 0.0,
        f"{prefix}forced_keeps": float(c.forced),
        f"{prefix}zero_variance_share": o.num_zero_variance / m if m else 0.0,
        f"{prefix}easy_share": o.num_easy / m if m else 0.0,
        f"{prefix}hard_share": o.num_hard / m if m else 0.0,
    }
    if tokens_saved is not None:
        out[f"{prefix}tokens_saved_estimate"] = check_float("tokens_saved", tokens_saved, minimum=0.0)
    out[f"{prefix}p_easy"] = float(rates.p_easy)
    out[f"{prefix}p_hard"] = float(rates.p_hard)
    return out
