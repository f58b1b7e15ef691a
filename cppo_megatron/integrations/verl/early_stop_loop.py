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

from typing import Any

from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop
from verl.workers.rollout.replica import TokenOutput

from ...core.early_stop import PrefixPredictor
from ..early_stop_group import GroupCoordinator as SharedCoordinator
from ..early_stop_group import Segment, generate_in_segments, stream_of
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


class GroupCoordinator(SharedCoordinator):
    """The shared ``integrations.early_stop_group.GroupCoordinator`` with veRL's predictor store and
    audit record (``early_stop_boundary``, agent-loop side)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(load_predictor=predictor_for, on_decision=_record_decision, **kwargs)


def _record_decision(coord: SharedCoordinator, boundary: int, out: Any) -> None:
    if observers.HUB.recording():
        observers.HUB.record("early_stop_boundary", role="agent_loop", step=coord.step, uid=coord.uid,
                             boundary=boundary, q=coord.q_last.tolist(), status=out.status.tolist(),
                             stopped=out.stop.nonzero().squeeze(1).tolist(), explore=coord.explore,
                             version=coord.predictor.version if coord.predictor else 0)


_stream = stream_of  # the tie-break stream of a group (tests recompute a decision with it)


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
        c = self.coordinator
        budget = int(sampling_params.get("max_tokens", self.budget_of(len(prompt_ids))))

        async def call(tokens: list[int], ask: int) -> Segment:
            out = await self.inner.generate(request_id, prompt_ids=list(prompt_ids) + tokens,
                                            sampling_params={**sampling_params, "max_tokens": ask}, **kwargs)
            ended = (len(out.token_ids) < ask or out.stop_reason != "completed"
                     or bool(out.token_ids and out.token_ids[-1] in self.eos_ids))
            return Segment(list(out.token_ids), list(out.log_probs or []), not ended, out)

        run = await generate_in_segments(c, self.member, budget=budget, call=call)
        first, last = run.first.output, run.last.output
        extra = dict(last.extra_fields)  # the last request's: its global_steps, and vLLM's counters in audit mode
        extra["min_global_steps"] = first.extra_fields.get("min_global_steps", first.extra_fields.get("global_steps"))
        extra[INFO_KEY] = c.info(self.member)
        return TokenOutput(token_ids=run.tokens, log_probs=run.logp if last.log_probs is not None else None,
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
            if coord.complete:
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
