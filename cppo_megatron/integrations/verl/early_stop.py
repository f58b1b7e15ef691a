"""Early stopping in veRL 0.9.1 (``cppo.early_stop``): the trainer side, the config, the install.

The agent-loop side (``early_stop_loop.py``) stops completions inside the rollout, group by group.
Here, in veRL's driver:

- ``check`` / ``apply`` (``runconfig.prepare``): refuse what is not built (the legacy loop, the
  asynchronous modes, DAPO's filter, selective rollout, multi-turn agent loops, features other
  than the sampled tokens' log-probs: veRL's server hands out nothing else), then select the
  ``cppo_early_stop`` agent loop and turn on the rollout log-probs it reads;
- ``VerlEarlyStop`` (one per trainer), called at the plugin's CPPO seam (``hook.prune_kv_batch``)
  with every row's ``extra_fields["cppo_early_stop"]``: which rows were stopped (their rewards are
  never read: ``core.early_stop_prune``; they are cleared from TransferQueue with the pruned ones),
  the step's ``early_stop/*`` metrics (accounting, predictor quality from the scores the agent
  loops decided with), then the step's finished rows go into the predictor's history, it is
  refitted and published for the next step to the ``STORE`` Ray actor, which the agent loops read;
- checkpoints: the predictor, history and totals go to ``global_step_N/cppo_early_stop.pt`` beside
  veRL's files (V1 ``_save_checkpoint``) and come back on resume (``_load_checkpoint``), which
  publishes them again.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
import weakref
from typing import Any

import torch

from ...core.early_stop import (
    PrefixPredictor,
    StopAccounting,
    StopHistory,
    estimate_full_lengths,
    imputed_moments,
    quality_metrics,
)
from ..importhook import after_import
from ..wrap import unwrap, wrap
from . import audit
from .runconfig import cppo_config_from, is_cppo

__all__ = ["STATE_FILE", "STORE", "VerlEarlyStop", "apply", "check", "enabled", "fetch_state", "install",
           "parse_infos", "publish", "state_of", "uninstall"]

STORE = "cppo_early_stop_store"  # the named Ray actor holding the predictor of each step
STATE_FILE = "cppo_early_stop.pt"  # beside veRL's files in global_step_N/
INFO_KEY = "cppo_early_stop"
AGENT_NAME = "cppo_early_stop"
AGENT_TARGET = "cppo_megatron.integrations.verl.early_stop_loop.EarlyStopAgentLoop"
TARGET = ("verl.trainer.ppo.v1.trainer_base", "PPOTrainer")
AGENT_MODULE = ("verl.experimental.agent_loop.agent_loop", "AgentLoopWorker")
SERVER = ("verl.workers.rollout.vllm_rollout.vllm_async_server", "vLLMHttpServer")
# vLLM's own counters (its Prometheus stat logger, on with rollout.disable_log_stats=false), read in
# the server process after each request in audit mode: what vLLM itself says it generated
VLLM_COUNTERS = {"generation_tokens": "vllm:generation_tokens", "prompt_tokens": "vllm:prompt_tokens",
                 "prompt_tokens_cached": "vllm:prompt_tokens_cached", "prefix_cache_hits": "vllm:prefix_cache_hits"}
COUNTERS_KEY = "cppo_vllm_counters"
WRAP_TAG = __name__
_STATES: weakref.WeakKeyDictionary[Any, VerlEarlyStop] = weakref.WeakKeyDictionary()
_LOCAL: dict[int, dict] = {}  # the store when Ray is not running (in-process tests)
# the publishing process keeps its handle: a named, non-detached Ray actor dies with its last handle
_STORE_HANDLE: list[Any] = []
_TOTALS = ("started", "stopped", "kept", "tokens_generated", "tokens_saved_estimate")


def enabled(config: Any) -> bool:
    """The run selects the cppo estimator and ``cppo.early_stop.enabled``."""
    return is_cppo(config) and bool(cppo_config_from(config).early_stop.enabled)


def _get(node: Any, dotted: str, default: Any = None) -> Any:
    for part in dotted.split("."):
        if node is None or not hasattr(node, "get"):
            return default
        node = node.get(part, None)
    return default if node is None else node


def check(config: Any) -> None:
    """ValueError naming key, value and fix for what early stopping does not run with in veRL."""
    if not enabled(config):
        return
    es = cppo_config_from(config).early_stop
    refusals = [
        (not bool(_get(config, "trainer.use_v1", True)), "trainer.use_v1=false",
         "the predictor's checkpoint and the seam's TransferQueue reads are built for the V1 loop; set "
         "trainer.use_v1=true"),
        (str(_get(config, "trainer.v1.trainer_mode", "sync")) != "sync",
         f"trainer.v1.trainer_mode={_get(config, 'trainer.v1.trainer_mode')}",
         "the asynchronous modes generate a step's groups with an older predictor and carry partial rollouts; "
         "set trainer.v1.trainer_mode=sync"),
        (bool(_get(config, "algorithm.filter_groups.enable", False)), "algorithm.filter_groups.enable=true",
         "DAPO's filter reads every reward of a group, and a stopped completion has none; turn one of them off"),
        (es.features != "logprob", f"cppo.early_stop.features={es.features}",
         "veRL's server hands out the sampled tokens' log-probs only; set cppo.early_stop.features=logprob"),
        (str(_get(config, "actor_rollout_ref.rollout.agent.default_agent_loop", "single_turn_agent"))
         not in ("single_turn_agent", AGENT_NAME),
         "actor_rollout_ref.rollout.agent.default_agent_loop="
         f"{_get(config, 'actor_rollout_ref.rollout.agent.default_agent_loop')}",
         "early stopping wraps the single-turn agent loop; multi-turn (tool) loops are not built"),
        (bool(_get(config, "actor_rollout_ref.rollout.multi_turn.enable", False)),
         "actor_rollout_ref.rollout.multi_turn.enable=true", "multi-turn rollouts are not built"),
    ]
    for bad, what, fix in refusals:
        if bad:
            raise ValueError(f"cppo.early_stop.enabled=true with {what}: {fix}")


def apply(config: Any) -> list[str]:
    """Select the ``cppo_early_stop`` agent loop and the rollout log-probs; returns what changed."""
    if not enabled(config):
        return []
    from omegaconf import OmegaConf, open_dict

    changed = []
    with open_dict(config):
        for key, value in (("actor_rollout_ref.rollout.agent.default_agent_loop", AGENT_NAME),
                           ("actor_rollout_ref.rollout.calculate_log_probs", True)):
            if OmegaConf.select(config, key) != value:
                OmegaConf.update(config, key, value, merge=False, force_add=True)
                changed.append(f"{key}={value} (cppo.early_stop)")
    return changed


# ---------------------------------------------------------------------------------- the store
class _Store:
    """The predictors of a run by the step they serve from (a Ray actor; ``_LOCAL`` without Ray)."""

    def __init__(self) -> None:
        self.states: dict[int, dict] = {}

    def put(self, step: int, state: dict) -> None:
        self.states[int(step)] = state
        for old in sorted(self.states)[:-3]:
            del self.states[old]

    def get(self, step: int) -> dict | None:
        keys = [k for k in self.states if k <= int(step)]
        return self.states[max(keys)] if keys else None


def _ray_running() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def publish(step: int, state: dict) -> None:
    """Make ``state`` (a ``PrefixPredictor.state_dict``) the predictor of step ``step`` on."""
    if not _ray_running():
        _LOCAL[int(step)] = state
        return
    import ray

    if not _STORE_HANDLE:
        _STORE_HANDLE.append(ray.remote(_Store).options(name=STORE, get_if_exists=True, num_cpus=0).remote())
    ray.get(_STORE_HANDLE[0].put.remote(int(step), state))


async def fetch_state(step: int) -> dict | None:
    """The predictor state serving ``step`` (None: none fitted yet), from an agent-loop worker."""
    if not _ray_running():
        keys = [k for k in _LOCAL if k <= step]
        return _LOCAL[max(keys)] if keys else None
    import ray

    try:
        store = ray.get_actor(STORE)
    except ValueError:  # nothing published yet: the first steps decide nothing
        return None
    return await store.get.remote(int(step))


# ---------------------------------------------------------------------------------- the trainer side
def step_counters(extra_fields: Any) -> dict | None:
    """vLLM's counters after the step's last request (audit mode): the largest of the rows' readings."""
    rows = extra_fields.tolist() if hasattr(extra_fields, "tolist") else list(extra_fields)
    seen = [ef[COUNTERS_KEY] for ef in rows if isinstance(ef, dict) and COUNTERS_KEY in ef]
    if not seen:
        return None
    return {key: max(float(c[key]) for c in seen) for key in VLLM_COUNTERS}


def parse_infos(extra_fields: Any, n: int) -> list[dict]:
    """Each row's ``cppo_early_stop`` info from the rows' ``extra_fields`` (a TransferQueue field);
    a row without one (an agent loop other than ``cppo_early_stop``) is an error naming it."""
    rows = extra_fields.tolist() if hasattr(extra_fields, "tolist") else list(extra_fields)
    if len(rows) != n:
        raise ValueError(f"cppo early stop: {len(rows)} extra_fields for {n} rows")
    out = []
    for i, ef in enumerate(rows):
        info = ef.get(INFO_KEY) if isinstance(ef, dict) else None
        if info is None:
            raise ValueError(f"cppo early stop: row {i} carries no extra_fields[{INFO_KEY!r}]: it was not generated by "
                             f"the {AGENT_NAME} agent loop (actor_rollout_ref.rollout.agent.default_agent_loop)")
        out.append(info)
    return out


class VerlEarlyStop:
    """Predictor, history and totals of one veRL run (the trainer's driver process)."""

    def __init__(self, cfg: Any, *, group_size: int, max_new_tokens: int) -> None:
        self.cfg, self.es = cfg, cfg.early_stop
        self.group_size, self.max_new_tokens = int(group_size), int(max_new_tokens)
        self.min_running = self.es.min_running_for(self.group_size, cfg.keep_for_group(self.group_size))
        self.predictor = PrefixPredictor(self.es.l2)
        self.history = StopHistory(self.es.history_steps)
        self.ready = False
        self.totals = dict.fromkeys(_TOTALS, 0.0)

    def moments(self, infos: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
        q = torch.tensor([float("nan") if i["q"] is None else float(i["q"]) for i in infos], dtype=torch.float64)
        # the class means of the predictor that decided: it is refitted only in end_step
        return imputed_moments(torch.nan_to_num(q, nan=0.5), self.predictor.class_means)

    def end_step(self, step: int, uids: list[str], rewards: torch.Tensor, lengths: torch.Tensor, infos: list[dict],
                 kept: torch.Tensor, counters: dict | None = None) -> dict[str, float]:
        """The step's ``early_stop/*`` metrics; then the finished rows join the history, the
        predictor is refitted and published for step ``step + 1``."""
        N = len(infos)
        stopped = torch.tensor([bool(i["stopped"]) for i in infos])
        y = (rewards.to(torch.float64) >= self.es.success_threshold).to(torch.float64)
        first: dict[str, int] = {}
        gids = torch.tensor([first.setdefault(u, len(first)) for u in uids], dtype=torch.int64)
        kept_mask = torch.zeros(N, dtype=torch.bool)
        kept_mask[kept] = True
        if bool((kept_mask & stopped).any()):
            raise RuntimeError("cppo early stop: a stopped completion was kept for training")
        est = estimate_full_lengths(lengths, stopped, gids)
        acc = StopAccounting(started=N, kept=int(kept_mask.sum()), pruned_after=int((~kept_mask & ~stopped).sum()),
                             stopped=int(stopped.sum()), tokens_generated=int(lengths.sum()),
                             tokens_stopped=int(lengths[stopped].sum()), tokens_budget=N * self.max_new_tokens,
                             tokens_saved_estimate=float((est - lengths.to(torch.float64))[stopped].sum()))
        acc.extra.update(self._quality(infos, y, stopped))
        mu, _ = self.moments(infos)
        shadow = torch.tensor([bool(i.get("shadow")) for i in infos])
        acc.extra.update({
            "predictor_ready": float(self.ready), "predictor_version": float(self.predictor.version),
            "min_running": float(self.min_running), "shadow_stopped": float(shadow.sum()),
            "shadow_wrong_stop_share": float((shadow & kept_mask).sum()) / float(shadow.sum()) if shadow.any()
            else float("nan"),
            "degraded_groups": float(len({u for u, i in zip(uids, infos, strict=True) if i.get("degraded")})),
            "reward_mean_estimate": float(torch.where(stopped, mu, rewards.to(torch.float64)).mean()),
        })
        metrics = acc.check().metrics()
        for key in _TOTALS:
            self.totals[key] += float(getattr(acc, key))
            metrics[f"early_stop/total_{key}"] = self.totals[key]
        self._file(step, infos, y, rewards, stopped)
        self.ready = self.history.refit(self.predictor, self.es.min_examples)
        if self.ready:
            publish(step + 1, self.predictor.state_dict())
        if audit.enabled():
            audit.record("early_stop", step=step, uids=uids, stopped=stopped.nonzero().squeeze(1).tolist(),
                         stopped_at=[int(i["stopped_at"]) for i in infos], q=[i["q"] for i in infos],
                         kept=kept.tolist(), explore=[bool(i["explore"]) for i in infos],
                         ready=acc.extra["predictor_ready"], version=acc.extra["predictor_version"],
                         lengths=lengths.tolist(), vllm_counters=counters)
        return metrics

    def _quality(self, infos: list[dict], y: torch.Tensor, stopped: torch.Tensor) -> dict[str, float]:
        pairs: dict[str, tuple[list, list]] = {"predictor_": ([], []), "predictor_first_": ([], []),
                                               "predictor_all_": ([], [])}
        for i, info in enumerate(infos):
            if stopped[i]:
                continue
            scored = [(b, q) for b, _x, q in info["records"] if q is not None]
            for j, (_b, q) in enumerate(scored):
                pairs["predictor_all_"][0].append(q)
                pairs["predictor_all_"][1].append(float(y[i]))
                if info["explore"]:
                    pairs["predictor_"][0].append(q)
                    pairs["predictor_"][1].append(float(y[i]))
                    if j == 0:
                        pairs["predictor_first_"][0].append(q)
                        pairs["predictor_first_"][1].append(float(y[i]))
        out: dict[str, float] = {"predictor_auc": float("nan")}
        for name, (qs, ys) in pairs.items():
            if qs:
                out.update(quality_metrics(torch.tensor(qs, dtype=torch.float64), torch.tensor(ys), name))
        return out

    def _file(self, step: int, infos: list[dict], y: torch.Tensor, rewards: torch.Tensor,
              stopped: torch.Tensor) -> None:
        xs, ys, rs = [], [], []
        for i, info in enumerate(infos):
            if stopped[i]:
                continue
            for _b, x, _q in info["records"]:
                xs.append(x)
                ys.append(float(y[i]))
                rs.append(float(rewards[i]))
        fin = ~stopped
        counts = (int((y[fin] == 0).sum()), int((y[fin] == 1).sum()))
        x = torch.tensor(xs, dtype=torch.float64) if xs else torch.zeros(0, 0, dtype=torch.float64)
        self.history.add(step, x, torch.tensor(ys, dtype=torch.float64), torch.tensor(rs, dtype=torch.float64), counts)

    def state_dict(self) -> dict[str, Any]:
        return {"predictor": self.predictor.state_dict(), "history": self.history.state_dict(), "ready": self.ready,
                "totals": dict(self.totals)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("predictor", "history", "ready", "totals"):
            if key not in state:
                raise ValueError(f"cppo early stop: {key!r} missing from {STATE_FILE}")
        self.predictor.load_state_dict(state["predictor"])
        self.history.load_state_dict(state["history"])
        self.ready = bool(state["ready"])
        self.totals = {k: float(state["totals"].get(k, 0.0)) for k in _TOTALS}


def state_of(trainer: Any) -> VerlEarlyStop:
    """The trainer's ``VerlEarlyStop``, created on first use from its config."""
    if trainer not in _STATES:
        c = trainer.config
        _STATES[trainer] = VerlEarlyStop(cppo_config_from(c), group_size=int(c.actor_rollout_ref.rollout.n),
                                         max_new_tokens=int(c.actor_rollout_ref.rollout.response_length))
    return _STATES[trainer]


# ---------------------------------------------------------------------------------- checkpoints
def _folder(trainer: Any, *, resuming: bool) -> str:
    from .selective import _step_folder

    return _step_folder(trainer, resuming=resuming)


def _saving(original):
    @functools.wraps(original)
    def _save_checkpoint(self, *args, **kwargs):
        if enabled(self.config):
            folder = _folder(self, resuming=False)
            os.makedirs(folder, exist_ok=True)
            torch.save(state_of(self).state_dict(), os.path.join(folder, STATE_FILE))
        return original(self, *args, **kwargs)

    return _save_checkpoint


def _loading(original):
    @functools.wraps(original)
    def _load_checkpoint(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        step = int(getattr(self, "global_steps", 0))
        if enabled(self.config) and step > 0:
            path = os.path.join(_folder(self, resuming=True), STATE_FILE)
            if os.path.isfile(path):
                state = state_of(self)
                state.load_state_dict(torch.load(path, weights_only=False))
                if state.ready:
                    publish(step + 1, state.predictor.state_dict())
            else:
                warnings.warn(f"cppo: checkpoint {os.path.dirname(path)} has no early-stopping state ({STATE_FILE}); "
                              "the predictor starts untrained and stops nothing until it has seen "
                              f"{cppo_config_from(self.config).early_stop.min_examples} completions of each outcome",
                              stacklevel=2)
        return out

    return _load_checkpoint


def _validating(original):
    @functools.wraps(original)
    async def _run_agent_loop(self, sampling_params, trajectory, *args, **kwargs):
        from .early_stop_loop import VALIDATING

        token = VALIDATING.set(bool(trajectory.get("validate", False)))
        try:
            return await original(self, sampling_params, trajectory, *args, **kwargs)
        finally:
            VALIDATING.reset(token)

    return _run_agent_loop


def vllm_counters() -> dict[str, float]:
    """vLLM's cumulative token counters in this process (the vLLM server's), summed over engines."""
    from prometheus_client import REGISTRY

    out = dict.fromkeys(VLLM_COUNTERS, 0.0)
    wanted = {f"{name}_total": key for key, name in VLLM_COUNTERS.items()}
    for family in REGISTRY.collect():
        for sample in family.samples:
            if sample.name in wanted:
                out[wanted[sample.name]] += float(sample.value)
    return out


def _counting(original):
    @functools.wraps(original)
    async def generate(self, *args, **kwargs):
        out = await original(self, *args, **kwargs)
        out.extra_fields[COUNTERS_KEY] = vllm_counters()
        return out

    return generate


def _patch_server(module) -> None:
    cls = getattr(module, SERVER[1], None)
    if cls is None or "generate" not in cls.__dict__:
        raise RuntimeError(f"cppo: {SERVER[0]}.{SERVER[1]}.generate is gone; veRL changed (pinned 0.9.1)")
    wrap(cls, "generate", _counting, tag=WRAP_TAG)


def _patch_trainer(module) -> None:
    cls = getattr(module, TARGET[1], None)
    for name, make in (("_save_checkpoint", _saving), ("_load_checkpoint", _loading)):
        if cls is None or name not in cls.__dict__:
            raise RuntimeError(f"cppo: {TARGET[0]}.{TARGET[1]}.{name} is gone; veRL changed (pinned 0.9.1)")
        wrap(cls, name, make, tag=WRAP_TAG)


def _patch_agent_loop(module) -> None:
    registry = getattr(module, "_agent_loop_registry", None)
    cls = getattr(module, AGENT_MODULE[1], None)
    if registry is None or cls is None or "_run_agent_loop" not in cls.__dict__:
        raise RuntimeError(f"cppo: {AGENT_MODULE[0]} has no _agent_loop_registry / {AGENT_MODULE[1]}._run_agent_loop; "
                           "veRL changed (pinned 0.9.1)")
    registry.setdefault(AGENT_NAME, {"_target_": AGENT_TARGET})  # what veRL's @register stores
    wrap(cls, "_run_agent_loop", _validating, tag=WRAP_TAG)


def install() -> None:
    """Register the agent loop and wrap the seams as veRL's modules are imported (idempotent)."""
    after_import(TARGET[0], _patch_trainer)
    after_import(AGENT_MODULE[0], _patch_agent_loop)
    if audit.enabled():  # the counters' read costs a registry walk per request: audit runs only
        after_import(SERVER[0], _patch_server)


def uninstall() -> None:
    """Remove the wrappers (tests)."""
    from .. import importhook

    importhook.remove(_patch_trainer)
    importhook.remove(_patch_agent_loop)
    importhook.remove(_patch_server)
    for (mod, cls), names in ((TARGET, ("_save_checkpoint", "_load_checkpoint")), (AGENT_MODULE, ("_run_agent_loop",)),
                              (SERVER, ("generate",))):
        module = sys.modules.get(mod)
        if module is not None:
            for name in names:
                unwrap(getattr(module, cls), name, tag=WRAP_TAG)
