"""Early stopping inside veRL 0.9.1's rollout: the agent loop side (``cppo.early_stop``).

The seam: a registered agent loop, ``cppo_early_stop`` (``EarlyStopAgentLoop``, veRL's own
``SingleTurnAgentLoop`` whose ``server_manager`` is wrapped), selected by
``actor_rollout_ref.rollout.agent.default_agent_loop``, with **segment-wise requests**: the
wrapped ``generate`` asks veRL's server client for ``segment_tokens`` tokens at a time
(``max_tokens``, honoured at ``vllm_async_server.py:602``), continuing the prompt with the tokens
so far; vLLM's prefix cache keeps the prefix's KV (veRL's client routes every request of one
agent-loop request id to the same server, ``llm_server.py:121``). Between segments the group's
``GroupCoordinator`` (one asyncio object per prompt, shared by its n concurrent agent loops of the
same ``AgentLoopWorker``, ``agent_loop_tq.py:116``) waits for every running member, scores them
with the step's predictor and stops the ones the rule names: their request simply is not
continued. The alternative, ``abort_request`` of an in-flight request, needs partial outputs no
agent loop can see (the server returns only final outputs) and the server actors' handles; and
veRL's replica-level abort clears the whole prefix cache by default
(``vllm_async_server.py:1046``, ``reset_prefix_cache=True``). The segments cost one request and
the re-prefill of a partial KV block per segment; nothing inside veRL or vLLM is touched.

Each member's TokenOutput carries ``extra_fields["cppo_early_stop"]``: stopped or not, at which
boundary, its last score, and the features it was scored on at each boundary (the trainer's
seam files them in the predictor's history with the rewards, ``early_stop.py``). The predictor
of step s is the one the trainer fitted after step s - 1, fetched once per step from the
``early_stop_store.STORE`` Ray actor. Validation generation (``trajectory["validate"]``) is never
stopped (``VALIDATING``, set by the wrapper ``early_stop.install`` puts on
``AgentLoopWorker._run_agent_loop``).
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import torch
from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop
from verl.workers.rollout.replica import TokenOutput

from ...core.early_stop import FINISHED, RUNNING, STOPPED, PrefixPredictor, decide_at_boundary, explore_group
from . import observers
from .early_stop_store import VALIDATING, fetch_state
from .runconfig import cppo_config_once

__all__ = ["AGENT_NAME", "VALIDATING", "EarlyStopAgentLoop", "GroupCoordinator", "SegmentedServer", "predictor_for"]

AGENT_NAME = "cppo_early_stop"
INFO_KEY = "cppo_early_stop"  # the TokenOutput / AgentLoopOutput extra field the trainer's seam reads
_GROUPS: dict[tuple[int, str], GroupCoordinator] = {}  # (step, uid) -> the group's coordinator, this process
_PREDICTORS: dict[int, PrefixPredictor | None] = {}  # step -> the predictor it decides with, this process


async def predictor_for(step: int) -> PrefixPredictor | None:
    """The predictor fitted for ``step`` (None before the trainer has one), once per step and process."""
    if step not in _PREDICTORS:
        state = await fetch_state(step)
        p = None
        if state is not None:
            p = PrefixPredictor()
            p.load_state_dict(state)
        _PREDICTORS.clear()  # the previous steps' are done with
        _PREDICTORS[step] = p
    return _PREDICTORS[step]


class GroupCoordinator:
    """The n members of one prompt's group: they report after each segment (``boundary``) or when
    done (``finish``); once every member still running has reached the boundary, one decision is
    made for all of them (``core.decide_at_boundary``) and each learns whether it stops."""

    def __init__(self, *, uid: str, step: int, size: int, cfg: Any, min_running: int, max_new_tokens: int,
                 timeout_s: float) -> None:
        self.uid, self.step, self.size, self.cfg = uid, step, size, cfg
        es = cfg.early_stop
        self.es, self.min_running, self.max_new_tokens, self.timeout_s = es, min_running, max_new_tokens, timeout_s
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
            raise RuntimeError(f"cppo early stop: more than n={self.size} agent loops joined group {self.uid}")
        self.joined += 1
        return self.joined - 1

    async def boundary(self, member: int, tokens: list[int], logp: list[float]) -> bool:
        """Member ``member`` has generated ``tokens`` (a boundary): True when it must stop."""
        self.tokens[member], self.logp[member] = list(tokens), list(logp)
        if self.degraded:
            return False
        t = len(tokens)
        if self.pending is None:
            self.pending = t
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
        for m, fut in waiting.items():
            if not fut.done():
                fut.set_result(bool(stop[m]))

    async def _decide(self, t: int) -> torch.Tensor:
        if self.predictor is None:
            self.predictor = await predictor_for(self.step)
        lengths = torch.tensor([len(x) for x in self.tokens], dtype=torch.int64)
        lp = torch.zeros(self.size, max(int(lengths.max()), 1), dtype=torch.float32)
        for m, vals in enumerate(self.logp):
            lp[m, : len(vals)] = torch.tensor(vals, dtype=torch.float32)
        explore = torch.full((self.size,), self.explore, dtype=torch.bool)
        out = decide_at_boundary(
            self.predictor, logprobs=lp, lengths=lengths, status=self.status, group_ids=torch.zeros(self.size,
            dtype=torch.int64), explore=explore, q_last=self.q_last, shadowed=self.shadowed,
            segment_tokens=self.es.segment_tokens, max_new_tokens=self.max_new_tokens, min_running=self.min_running,
            min_confidence=self.es.min_confidence, seed=self.cfg.seed, step=self.step,
            stream=_stream(self.uid) + self.boundaries)
        members = out.present.nonzero().squeeze(1).tolist()
        for j, m in enumerate(members):
            q = None if out.q is None else float(out.q[j])
            self.records[m].append([t, out.x[j].tolist(), q])
        self.shadowed |= out.shadow
        for m in out.stop.nonzero().squeeze(1).tolist():
            self.status[m] = STOPPED
            self.stopped_at[m] = t
        if observers.recording() and out.q is not None:
            observers.record("early_stop_boundary", role="agent_loop", step=self.step, uid=self.uid, boundary=t,
                         q=self.q_last.tolist(), status=out.status.tolist(),
                         stopped=out.stop.nonzero().squeeze(1).tolist(),
                         explore=self.explore, version=self.predictor.version if self.predictor else 0)
        self.boundaries += 1
        return out.stop

    def _release_all(self, value: bool) -> None:
        waiting, self.waiting, self.pending = self.waiting, {}, None
        for fut in waiting.values():
            if not fut.done():
                fut.set_result(value)

    def info(self, member: int) -> dict:
        """What the trainer's seam needs of a member (JSON-able)."""
        q = float(self.q_last[member])
        return {"stopped": self.stopped_at[member] >= 0, "stopped_at": self.stopped_at[member],
                "q": None if math.isnan(q) else q, "records": self.records[member], "explore": self.explore,
                "shadow": bool(self.shadowed[member]),
                "ready": bool(self.predictor is not None and self.predictor.fitted),
                "version": 0 if self.predictor is None else self.predictor.version, "degraded": self.degraded}


def _stream(uid: str) -> int:
    import hashlib

    return int.from_bytes(hashlib.sha256(uid.encode()).digest()[:4], "big") * 1000


class SegmentedServer:
    """veRL's server client for one member: ``generate`` in segments of ``segment_tokens``, asking the
    group's coordinator at each boundary whether to go on."""

    def __init__(self, inner: Any, coordinator: GroupCoordinator, member: int, *, budget_of: Any,
                 eos_ids: set[int]) -> None:
        self.inner, self.coordinator, self.member = inner, coordinator, member
        self.budget_of, self.eos_ids = budget_of, eos_ids

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       **kwargs: Any) -> TokenOutput:
        c, seg = self.coordinator, self.coordinator.es.segment_tokens
        budget = int(sampling_params.get("max_tokens", self.budget_of(len(prompt_ids))))
        tokens: list[int] = []
        logp: list[float] = []
        first: TokenOutput | None = None
        last: TokenOutput | None = None
        try:
            while True:
                ask = min(seg, budget - len(tokens))
                params = {**sampling_params, "max_tokens": ask}
                last = await self.inner.generate(request_id, prompt_ids=list(prompt_ids) + tokens,
                                                 sampling_params=params, **kwargs)
                first = first or last
                tokens += list(last.token_ids)
                logp += list(last.log_probs or [])
                ended = (len(last.token_ids) < ask or last.stop_reason != "completed"
                         or (last.token_ids and last.token_ids[-1] in self.eos_ids) or len(tokens) >= budget)
                if ended:
                    await c.finish(self.member, tokens, logp)
                    break
                if await c.boundary(self.member, tokens, logp):
                    break
        except BaseException:
            c.leave(self.member)
            raise
        assert first is not None and last is not None  # the loop ran at least once
        extra = dict(last.extra_fields)  # the last request's: its global_steps, and vLLM's counters in audit mode
        extra["min_global_steps"] = first.extra_fields.get("min_global_steps", first.extra_fields.get("global_steps"))
        extra[INFO_KEY] = c.info(self.member)
        return TokenOutput(token_ids=tokens, log_probs=logp if last.log_probs is not None else None,
                           routed_experts=None, stop_reason=last.stop_reason, num_preempted=last.num_preempted,
                           extra_fields=extra)


class EarlyStopAgentLoop(SingleTurnAgentLoop):
    """veRL's single-turn agent loop, generating through a ``SegmentedServer`` of its prompt's group."""

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any):
        # veRL instantiates a loop per request over its worker's one config: parsed once per config
        cfg = cppo_config_once(self.config) if hasattr(self, "config") else None
        if cfg is None or not cfg.early_stop.enabled or VALIDATING.get():
            return await super().run(sampling_params, **kwargs)
        step = int(kwargs.get("global_steps", -1))
        uid = str(kwargs["uid"])
        key = (step, uid)
        n = int(self.rollout_config.n)
        coord = _GROUPS.get(key)
        if coord is None:
            coord = _GROUPS[key] = GroupCoordinator(
                uid=uid, step=max(step, 0), size=n, cfg=cfg,
                min_running=cfg.early_stop.min_running_for(n, cfg.keep_for_group(n)),
                max_new_tokens=int(self.response_length), timeout_s=float(cfg.early_stop.timeout_s))
        member = coord.join()
        real = self.server_manager
        # veRL's client, wrapped: the agent loop's own run() generates through the segments
        self.server_manager = SegmentedServer(real, coord, member, budget_of=self._budget,  # type: ignore[assignment]
                                              eos_ids=self._eos_ids())
        try:
            return await super().run(sampling_params, **kwargs)
        finally:
            self.server_manager = real
            if coord.done + int((coord.status == STOPPED).sum()) >= n:
                _GROUPS.pop(key, None)

    def _budget(self, prompt_len: int) -> int:
        # the server's own default (vllm_async_server.py:611)
        return max(1, min(int(self.response_length), int(self.prompt_length) + int(self.response_length) - prompt_len))

    def _eos_ids(self) -> set[int]:
        eos = getattr(self.tokenizer, "eos_token_id", None)
        ids = {int(eos)} if eos is not None else set()
        gen = getattr(getattr(self, "model_config", None), "generation_config", None)
        extra = getattr(gen, "eos_token_id", None)
        if isinstance(extra, int):
            ids.add(extra)
        elif isinstance(extra, (list, tuple)):
            ids.update(int(e) for e in extra)
        return ids
