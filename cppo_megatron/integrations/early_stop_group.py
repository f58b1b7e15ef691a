"""Early stopping inside a rollout engine, host-neutral: a prompt's group meets at segment boundaries.

Both hosts generate a prompt's G completions as concurrent asyncio tasks of one process (veRL: the
n agent loops of one ``AgentLoopWorker``; OpenRLHF: the n ``executor.execute`` calls of one
``RolloutRayActor.generate_responses``). Each task generates in segments of ``segment_tokens``
(``generate_in_segments``: one engine request per segment, the prompt continued with the tokens so
far, so the engine's prefix cache keeps the prefix) and reports to its group's ``GroupCoordinator``
at every boundary. Once every member still running has reached the boundary, one decision is made for
all of them (``core.decide_at_boundary``) and each learns whether it stops. A stopped member's
request is simply not continued: its remaining tokens are never generated.

What a host supplies: how to ask its engine for one segment (``call``), where the predictor of a step
comes from (``load_predictor``), and what to record of a decision (``on_decision``).
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..core.early_stop import FINISHED, RUNNING, STOPPED, PrefixPredictor, decide_at_boundary, explore_group

__all__ = ["GroupCoordinator", "Segment", "SegmentRun", "generate_in_segments", "stream_of"]


def stream_of(uid: str) -> int:
    """The tie-break stream of a group (``decide_stops``): from its key alone, the same on every rank."""
    return int.from_bytes(hashlib.sha256(uid.encode()).digest()[:4], "big") * 1000


async def _no_predictor(step: int) -> PrefixPredictor | None:
    return None


class GroupCoordinator:
    """The ``size`` members of one prompt's group: they report after each segment (``boundary``) or
    when done (``finish``); once every member still running has reached the boundary, one decision is
    made for all of them and each learns whether it stops.

    Args:
        uid: the group's key (explore draw and tie-breaks); step: the training step deciding.
        size: G; cfg: the run's ``CPPOConfig``; min_running: members that run to their end.
        max_new_tokens: the length limit (a feature's ``position``); timeout_s: how long a member
            waits for the others at a boundary before every member runs on (``degraded``).
        load_predictor: ``async (step) -> PrefixPredictor | None``, called once, at the first decision
            (when ``predictor`` was not set before).
        on_decision: called with (coordinator, boundary, ``BoundaryOutcome``) after each scored decision.
    """

    def __init__(self, *, uid: str, step: int, size: int, cfg: Any, min_running: int, max_new_tokens: int,
                 timeout_s: float, load_predictor: Callable[[int], Awaitable[PrefixPredictor | None]] = _no_predictor,
                 on_decision: Callable[[GroupCoordinator, int, Any], None] | None = None) -> None:
        self.uid, self.step, self.size, self.cfg = uid, step, size, cfg
        es = cfg.early_stop
        self.es, self.min_running, self.max_new_tokens, self.timeout_s = es, min_running, max_new_tokens, timeout_s
        self.load_predictor, self.on_decision = load_predictor, on_decision
        self.explore = explore_group(uid, es.explore_share, seed=cfg.seed, step=step)
        self.joined = 0
        self.tokens: list[list[int]] = [[] for _ in range(size)]
        self.logp: list[list[float]] = [[] for _ in range(size)]
        self.status = torch.full((size,), RUNNING, dtype=torch.int64)
        self.q_last = torch.full((size,), float("nan"), dtype=torch.float64)
        self.shadowed = torch.zeros(size, dtype=torch.bool)
        self.stopped_at = [-1] * size
        self.records: list[list[list]] = [[] for _ in range(size)]  # per member: [boundary, features, q]
        self.waiting: dict[int, asyncio.Future] = {}  # member -> its decision at the pending boundary
        self.pending: int | None = None  # the boundary being gathered
        self.degraded = False  # a wait timed out: every member runs to its end
        self.predictor: PrefixPredictor | None = None
        self.boundaries = 0
        self.done = 0

    def join(self) -> int:
        if self.joined >= self.size:
            raise RuntimeError(f"cppo early stop: more than n={self.size} members joined group {self.uid}")
        self.joined += 1
        return self.joined - 1

    @property
    def complete(self) -> bool:
        """Every member has finished, failed or been stopped."""
        return self.done + int((self.status == STOPPED).sum()) >= self.size

    async def boundary(self, member: int, tokens: list[int], logp: list[float]) -> bool:
        """Member ``member`` has generated ``tokens`` (a boundary): True when it must stop."""
        self.tokens[member], self.logp[member] = list(tokens), list(logp)
        if self.degraded:
            return False
        if self.pending is None:
            self.pending = len(tokens)
        fut = asyncio.get_running_loop().create_future()
        self.waiting[member] = fut
        await self._maybe_decide()
        try:
            return bool(await asyncio.wait_for(asyncio.shield(fut), self.timeout_s))
        except asyncio.TimeoutError:
            self.degraded = True
            self._release_all(False)
            return False

    async def finish(self, member: int, tokens: list[int], logp: list[float]) -> None:
        """Member ``member`` ended (EOS or the length limit) with ``tokens``."""
        self.tokens[member], self.logp[member] = list(tokens), list(logp)
        self.status[member] = FINISHED
        self.done += 1
        await self._maybe_decide()

    def leave(self, member: int) -> None:
        """A member that failed: the others must not wait for it."""
        self.status[member] = FINISHED
        self.done += 1
        asyncio.ensure_future(self._maybe_decide())

    async def _maybe_decide(self) -> None:
        running = [m for m in range(self.size) if self.status[m] == RUNNING]
        if self.pending is None or self.joined < self.size or any(m not in self.waiting for m in running):
            return
        t, waiting = self.pending, dict(self.waiting)
        self.pending, self.waiting = None, {}
        stop = await self._decide(t)
        for m, fut in waiting.items():  # pending: set only here and in _release_all, each after taking it out
            fut.set_result(bool(stop[m]))

    async def _decide(self, t: int) -> torch.Tensor:
        if self.predictor is None:
            self.predictor = await self.load_predictor(self.step)
        lengths = torch.tensor([len(x) for x in self.tokens], dtype=torch.int64)
        lp = torch.zeros(self.size, max(int(lengths.max()), 1), dtype=torch.float32)
        for m, vals in enumerate(self.logp):
            lp[m, : len(vals)] = torch.tensor(vals, dtype=torch.float32)
        out = decide_at_boundary(
            self.predictor, logprobs=lp, lengths=lengths, status=self.status,
            group_ids=torch.zeros(self.size, dtype=torch.int64),
            explore=torch.full((self.size,), self.explore, dtype=torch.bool), q_last=self.q_last,
            shadowed=self.shadowed, segment_tokens=self.es.segment_tokens, max_new_tokens=self.max_new_tokens,
            min_running=self.min_running, min_confidence=self.es.min_confidence, seed=self.cfg.seed, step=self.step,
            stream=stream_of(self.uid) + self.boundaries)
        for j, m in enumerate(out.present.nonzero().squeeze(1).tolist()):
            self.records[m].append([t, out.x[j].tolist(), None if out.q is None else float(out.q[j])])
        self.shadowed |= out.shadow
        for m in out.stop.nonzero().squeeze(1).tolist():
            self.status[m] = STOPPED
            self.stopped_at[m] = t
        if self.on_decision is not None and out.q is not None:
            self.on_decision(self, t, out)
        self.boundaries += 1
        return out.stop

    def _release_all(self, value: bool) -> None:
        waiting, self.waiting, self.pending = self.waiting, {}, None
        for fut in waiting.values():
            fut.set_result(value)

    def info(self, member: int) -> dict:
        """What the trainer's seam needs of a member (JSON-able)."""
        q = float(self.q_last[member])
        return {"stopped": self.stopped_at[member] >= 0, "stopped_at": self.stopped_at[member],
                "q": None if math.isnan(q) else q, "records": self.records[member], "explore": self.explore,
                "shadow": bool(self.shadowed[member]),
                "ready": bool(self.predictor is not None and self.predictor.fitted),
                "version": 0 if self.predictor is None else self.predictor.version, "degraded": self.degraded}


@dataclass
class Segment:
    """One engine request's answer: the tokens it generated, their log-probs, whether the completion
    could go on (it stopped only at the asked ``max_tokens``), and the host's own output object."""

    token_ids: list[int]
    log_probs: list[float]
    more: bool
    output: Any = None


@dataclass
class SegmentRun:
    """A member's whole generation: every token and log-prob, the first and last segments, whether the
    coordinator stopped it, and how many requests it took."""

    tokens: list[int]
    logp: list[float]
    first: Segment
    last: Segment
    stopped: bool
    requests: int


async def generate_in_segments(coord: GroupCoordinator, member: int, *, budget: int,
                               call: Callable[[list[int], int], Awaitable[Segment]]) -> SegmentRun:
    """Generate member ``member``'s completion in segments of ``coord.es.segment_tokens`` up to
    ``budget`` tokens: ``call(tokens_so_far, max_tokens)`` asks the engine for one segment; at each
    boundary the coordinator says whether to go on. A failure leaves the group (the others go on)."""
    if budget < 1:
        raise ValueError(f"cppo early stop: a completion's token budget must be >= 1, got {budget}")
    seg = coord.es.segment_tokens
    tokens: list[int] = []
    logp: list[float] = []
    first: Segment | None = None
    requests = 0
    try:
        while True:
            last = await call(list(tokens), min(seg, budget - len(tokens)))
            requests += 1
            first = first or last
            tokens += last.token_ids
            logp += last.log_probs
            if not last.more or len(tokens) >= budget:
                await coord.finish(member, tokens, logp)
                return SegmentRun(tokens, logp, first, last, stopped=False, requests=requests)
            if await coord.boundary(member, tokens, logp):
                return SegmentRun(tokens, logp, first, last, stopped=True, requests=requests)
    except BaseException:
        coord.leave(member)
        raise
