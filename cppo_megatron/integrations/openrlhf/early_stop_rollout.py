"""Early stopping inside OpenRLHF 0.11.2's rollout: the rollout actor's side (``cppo.early_stop``).

The seam. ``RolloutRayActor.generate_responses`` (``trainer/ray/vllm_engine.py:183-210``) runs a
prompt's N samples as N concurrent ``self.executor.execute(..., llm_engine=self)`` tasks of one
asyncio loop, all given the same ``sampling_params`` object. The default executor,
``SingleTurnAgentExecutor.execute`` (``utils/agent.py:207-306``), tokenizes the prompt, calls
``llm_engine.generate(prompt_token_ids, params)`` once (:245) and then scores the completion with the
reward function (:286-304). Its class is wrapped here: the wrapper hands ``execute`` a
``SegmentedEngine`` instead of the actor, whose ``generate`` asks the actor's own ``generate``
(vllm_engine.py:153, ``AsyncLLMEngine.generate``) for ``segment_tokens`` tokens at a time
(``max_tokens``, the prompt continued with the tokens so far: vLLM's prefix cache,
``--vllm.enable_prefix_caching``, which the launcher turns on, keeps the prefix; OpenRLHF resets it at
each weight sync, ``ppo_actor.py:410-415``) and meets the group's other members at each boundary
(``integrations.early_stop_group``). A completion the rule stops raises ``Stopped`` out of
``generate``, so ``execute`` never reaches the reward call: the wrapper returns the stopped
completion's prefix with no reward.

Why this seam and not another: ``RolloutRayActor``'s own methods cannot be wrapped in its process
(Ray ships the actor class by value when ``@ray.remote`` runs; the executor's class is imported by
name in the actor); ``execute`` is where one completion's request and its reward meet; and vLLM's
``abort`` of an in-flight request would need the partial outputs, which ``generate`` only hands out
at the end (vllm_engine.py:170-173).

What decides: the run's step, group size and predictor ride to the actor on the request's
``SamplingParams.extra_args`` (``CONTEXT_KEY``, set by the trainer side, ``early_stop.py``); a request
without them (evaluation, a run without early stopping) passes through untouched. Each completion's
record (``GroupCoordinator.info``, plus vLLM's own token counts) comes back in its output dict under
``INFO_KEY``.
"""

from __future__ import annotations

import functools
import hashlib
import sys
from copy import deepcopy
from types import SimpleNamespace
from typing import Any

from ...core.early_stop import PrefixPredictor
from ..early_stop_group import GroupCoordinator, Segment, SegmentRun, generate_in_segments
from ..wrap import unwrap, wrap

__all__ = ["AGENT_MODULE", "CONTEXT_KEY", "INFO_KEY", "SegmentedEngine", "Stopped", "context_of", "install",
           "stopped_output", "uninstall"]

AGENT_MODULE = "openrlhf.utils.agent"
CONTEXT_KEY = "cppo_early_stop"  # in SamplingParams.extra_args: {"step", "group_size", "max_new_tokens", "predictor"}
INFO_KEY = "cppo_early_stop"  # in the executor's output dict: the completion's record
WRAP_TAG = __name__
_GROUPS: dict[int, tuple[Any, GroupCoordinator]] = {}  # id(sampling_params) -> (it, its group), this process
_PREDICTORS: dict[tuple[int, int], PrefixPredictor] = {}  # (step, version) -> the predictor, this process
_CONFIG: list[Any] = []  # the run's CPPOConfig in this process


def context_of(sampling_params: Any) -> dict | None:
    """The early-stop context a request carries (None: generate it whole)."""
    extra = getattr(sampling_params, "extra_args", None)
    return extra.get(CONTEXT_KEY) if isinstance(extra, dict) else None


class Stopped(Exception):  # noqa: N818 - a control signal, not an error
    """Raised out of ``SegmentedEngine.generate`` when the group's rule stops the completion."""

    def __init__(self, prompt_ids: list[int], run: SegmentRun, logprob_dicts: list) -> None:
        super().__init__("cppo early stop: completion stopped")
        self.prompt_ids, self.run, self.logprob_dicts = prompt_ids, run, logprob_dicts


def _segment_params(params: Any, ask: int, done: int) -> Any:
    """One segment's request: ``ask`` new tokens, the minimum shortened by what is done, the sampled
    tokens' log-probs on (the predictor's features), our context taken off (vLLM does not need it)."""
    p = deepcopy(params)
    p.max_tokens = ask
    p.min_tokens = max(0, min(int(getattr(params, "min_tokens", 0) or 0) - done, ask))
    if p.logprobs is None:
        p.logprobs = 1
    rest = {k: v for k, v in (p.extra_args or {}).items() if k != CONTEXT_KEY}
    p.extra_args = rest or None
    return p


class SegmentedEngine:
    """What ``execute`` gets as ``llm_engine``: the rollout actor's ``generate`` in segments.

    ``generated`` counts the tokens vLLM returned over every request (its own output counts),
    ``cached`` the prompt tokens vLLM served from its prefix cache (``num_cached_tokens``)."""

    def __init__(self, inner: Any, coordinator: GroupCoordinator, member: int) -> None:
        self.inner, self.coordinator, self.member = inner, coordinator, member
        self.generated = 0
        self.cached = 0
        self.requests = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def generate(self, prompt_token_ids: list[int], sampling_params: Any, multi_modal_data: Any = None) -> Any:
        prompt = list(prompt_token_ids)
        dicts: list = []

        async def call(tokens: list[int], ask: int) -> Segment:
            out = await self.inner.generate(prompt + tokens, _segment_params(sampling_params, ask, len(tokens)),
                                            multi_modal_data=multi_modal_data)
            o = out.outputs[0]
            ids = list(o.token_ids)
            lps = list(o.logprobs or [])
            dicts.extend(lps)
            self.generated += len(ids)
            self.cached += int(getattr(out, "num_cached_tokens", 0) or 0)
            self.requests += 1
            logp = [float(d[t].logprob) if d is not None and t in d else 0.0 for t, d in zip(ids, lps, strict=False)]
            return Segment(ids, logp, o.finish_reason == "length" and len(ids) == ask, out)

        run = await generate_in_segments(self.coordinator, self.member, budget=int(sampling_params.max_tokens),
                                         call=call)
        if run.stopped:
            raise Stopped(prompt, run, dicts)
        last = run.last.output.outputs[0]
        return SimpleNamespace(prompt_token_ids=prompt, outputs=[SimpleNamespace(
            token_ids=run.tokens, logprobs=dicts if getattr(sampling_params, "logprobs", None) is not None else None,
            finish_reason=last.finish_reason, text="")])


def stopped_output(prompt: Any, label: Any, images: Any, stop: Stopped, want_logprobs: bool) -> dict:
    """A stopped completion's output dict, in ``SingleTurnAgentExecutor.execute``'s layout (agent.py:267-283),
    with no reward: it is never scored."""
    ids = stop.prompt_ids + stop.run.tokens
    logp = [0.0] * len(stop.prompt_ids) + list(stop.run.logp) if want_logprobs else None
    return {"prompt": prompt, "label": label, "images": images, "mm_train_inputs": None, "observation_tokens": ids,
            "action_ranges": [(len(stop.prompt_ids), len(ids))], "rollout_log_probs": logp, "truncated": False,
            "reward": None, "scores": None, "extra_logs": {}}


def group_key(prompt: Any, label: Any) -> str:
    """A group's key (explore draw, tie-breaks): its prompt and label."""
    return hashlib.sha256(repr((prompt, label)).encode()).hexdigest()[:16]


async def _load(ctx: dict) -> PrefixPredictor | None:
    state = ctx.get("predictor")
    if state is None:
        return None
    key = (int(ctx["step"]), int(state["version"]))
    if key not in _PREDICTORS:
        p = PrefixPredictor()
        p.load_state_dict(state)
        _PREDICTORS.clear()  # an earlier step's is done with
        _PREDICTORS[key] = p
    return _PREDICTORS[key]


def _group_of(sampling_params: Any, prompt: Any, label: Any, ctx: dict) -> GroupCoordinator:
    """The coordinator of the call whose N tasks share ``sampling_params`` (created by the first)."""
    entry = _GROUPS.get(id(sampling_params))
    if entry is None or entry[0] is not sampling_params:
        cfg = _CONFIG[0]
        n = int(ctx["group_size"])

        async def load(step: int) -> PrefixPredictor | None:
            return await _load(ctx)

        coord = GroupCoordinator(uid=group_key(prompt, label), step=int(ctx["step"]), size=n, cfg=cfg,
                                 min_running=cfg.early_stop.min_running_for(n, cfg.keep_for_group(n)),
                                 max_new_tokens=int(ctx["max_new_tokens"]), timeout_s=float(cfg.early_stop.timeout_s),
                                 load_predictor=load)
        entry = _GROUPS[id(sampling_params)] = (sampling_params, coord)
    return entry[1]


def _wrap_execute(original):
    @functools.wraps(original)
    async def execute(self, prompt, label, sampling_params, max_length: int, hf_tokenizer, llm_engine, images=None):
        ctx = context_of(sampling_params)
        if ctx is None or not _CONFIG:
            return await original(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine, images)
        coord = _group_of(sampling_params, prompt, label, ctx)
        engine = SegmentedEngine(llm_engine, coord, coord.join())
        try:
            out = await original(self, prompt, label, sampling_params, max_length, hf_tokenizer, engine, images)
        except Stopped as stop:
            out = stopped_output(prompt, label, images, stop, sampling_params.logprobs is not None)
        finally:
            if coord.complete:
                _GROUPS.pop(id(sampling_params), None)
        out[INFO_KEY] = {**coord.info(engine.member), "uid": coord.uid, "step": coord.step,
                         "vllm_generated": engine.generated, "vllm_cached": engine.cached, "requests": engine.requests}
        return out

    return execute


def _patch_agent(module: Any) -> None:
    cls = getattr(module, "SingleTurnAgentExecutor", None)
    if cls is not None:
        wrap(cls, "execute", _wrap_execute, tag=WRAP_TAG)


def install(cfg: Any) -> None:
    """The rollout side in this process (a rollout actor, or an in-process test): wrap the executor
    as its module is imported."""
    from ..importhook import after_import

    _CONFIG[:] = [cfg]
    after_import(AGENT_MODULE, _patch_agent)


def uninstall() -> None:
    from ..importhook import remove

    _CONFIG.clear()
    _GROUPS.clear()
    remove(_patch_agent)
    cls = getattr(sys.modules.get(AGENT_MODULE), "SingleTurnAgentExecutor", None)
    if cls is not None:
        unwrap(cls, "execute", tag=WRAP_TAG)
