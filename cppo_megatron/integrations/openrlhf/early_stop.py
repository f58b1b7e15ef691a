"""Early stopping in OpenRLHF 0.11.2 (``cppo.early_stop``): the trainer side, the checks, the install.

The rollout actor's side (``early_stop_rollout.py``) generates each prompt's group in segments and
stops, at a boundary, the completions the rule names. Here, in the process that holds OpenRLHF's
``SamplesGenerator`` and ``RemoteExperienceMaker`` (the ``PPOTrainer`` actor of the synchronous loop):

- ``SamplesGenerator.generate_samples`` (``samples_generator.py:89``) is wrapped: during a training
  draw (not evaluation, ``generate_eval_samples``) every request's ``SamplingParams`` (built at
  :199-207) carries the step, G, the length limit and the predictor fitted after the previous step
  (``early_stop_rollout.CONTEXT_KEY`` in ``extra_args``);
- ``SamplesGenerator._process_response_into_experience`` (:243) is wrapped: each rollout sample
  keeps its completion's record (``INFO_ATTR``);
- at the CPPO seam (``hook.prune_rollout_samples``, the start of ``make_experience_batch``) the
  stopped samples get a stand-in reward that nothing reads (``stand_in_rewards``), the group
  statistics and CPPO's selection come from ``core.early_stop_prune`` (``prune``: the configured
  estimator, ``impute`` or ``finished``; a stopped sample is never kept), and ``end_step`` counts
  the step (``early_stop/*``, the same keys as the embedded trainer and veRL), files its finished
  completions in the predictor's history and refits it for the next step;
- the predictor, its history and the totals ride in OpenRLHF's checkpoint inside the prompt
  dataloader's state (as selective rollout's history does, ``selective.py``), and come back with it.
"""

from __future__ import annotations

import functools
import logging
import sys
import warnings
import weakref
from typing import Any

import torch

from ...core.early_stop import early_stop_prune
from ...core.pipeline import PruneResult
from ..early_stop_learner import GroupStopLearner
from ..wrap import unwrap, wrap
from . import early_stop_rollout
from .checkpoint import resumed_step
from .early_stop_rollout import CONTEXT_KEY, INFO_KEY

__all__ = ["INFO_ATTR", "STATE_KEY", "OpenRLHFEarlyStop", "check_args", "end_step", "enabled", "infos_of", "install",
           "learner", "prune", "stand_in_rewards", "stopped_mask", "uninstall"]

logger = logging.getLogger(__name__)

GENERATOR_MODULE = "openrlhf.trainer.ppo_utils.samples_generator"
LOADER_MODULE = "torchdata.stateful_dataloader.stateful_dataloader"
INFO_ATTR = "_cppo_early_stop"  # on each rollout Experience: its completion's record
STATE_KEY = "cppo_early_stop"  # in the prompt dataloader's state_dict (OpenRLHF's checkpoint)
WRAP_TAG = __name__
_CONFIG: list[Any] = []
_LEARNER: list[OpenRLHFEarlyStop] = []
_ACTIVE: list[dict] = []  # the context of the training draw in progress
_TRAIN_LOADERS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()  # loader -> its generator


def enabled() -> bool:
    """Whether this process runs early stopping (``install`` got a config that turns it on)."""
    return bool(_CONFIG)


# ---------------------------------------------------------------------------------- refusals
def check_args(args: Any, cfg: Any) -> list[str]:
    """Launch-time check of OpenRLHF's parsed ``args`` for a run with ``cppo.early_stop.enabled``
    (``cfg``: the run's CPPOConfig): ValueError naming flag or key, value and fix for what is not
    built; else the notes the dry run prints."""
    gen = getattr(args.rollout, "vllm_generate_batch_size", None)
    agent = getattr(args.train, "agent_func_path", None)
    refusals = [
        (cfg.early_stop.features != "logprob", f"cppo.early_stop.features={cfg.early_stop.features}",
         "OpenRLHF's rollout hands out the sampled tokens' log-probs only; set cppo.early_stop.features=logprob"),
        (bool(getattr(args.train, "async_enable", False)), "--train.async_enable",
         "the asynchronous trainer generates ahead of the step whose predictor must decide; remove the flag"),
        (bool(getattr(args.algo, "dynamic_filtering_enable", False)), "--algo.dynamic_filtering_enable",
         "DAPO's filter reads every score of a group, and a stopped completion has none; remove the flag"),
        (bool(agent), f"--train.agent_func_path {agent}",
         "early stopping wraps OpenRLHF's single-turn executor; custom (multi-turn) agents are not built"),
        (bool(gen) and int(gen or 0) != int(args.rollout.batch_size), f"--rollout.vllm_generate_batch_size {gen}",
         "one generation call's groups would be trained over several steps with one predictor; leave it unset"),
    ]
    for bad, what, fix in refusals:
        if bad:
            raise ValueError(f"cppo.early_stop.enabled=true with {what}: {fix}")
    return ["early stopping: each prompt's completions are generated in segments of "
            f"{cfg.early_stop.segment_tokens} tokens (one vLLM request each, --vllm.enable_prefix_caching on); a "
            "stopped completion is never scored or trained on (docs/early_stopping.md)"]


# ---------------------------------------------------------------------------------- the learner
class OpenRLHFEarlyStop(GroupStopLearner):
    """Predictor, history and totals of one OpenRLHF run (``integrations.early_stop_learner``), and
    the step the next training draw decides in (``next_step``: OpenRLHF's global step before it)."""

    missing = f"cppo early stop: {{key}} missing from the checkpoint's {STATE_KEY}"

    def __init__(self, cfg: Any, *, group_size: int, max_new_tokens: int, step: int = 0) -> None:
        super().__init__(cfg, group_size=group_size, max_new_tokens=max_new_tokens)
        self.next_step = step

    def context(self, group_size: int) -> dict:
        """What a training draw's requests carry to the rollout actors."""
        return {"step": self.next_step, "group_size": int(group_size), "max_new_tokens": self.max_new_tokens,
                "predictor": self.predictor.state_dict() if self.ready else None}


def learner(args: Any) -> OpenRLHFEarlyStop:
    """The run's learner in this process, created on first use from OpenRLHF's ``args``."""
    if not _CONFIG:
        raise RuntimeError("cppo early stop is not installed in this process (hook.install with early_stop.enabled)")
    if not _LEARNER:
        if not args.rollout.max_new_tokens:
            raise ValueError("cppo.early_stop.enabled=true needs --rollout.max_new_tokens (the token budget of "
                             "a completion, the tokens_budget metric); set it")
        _LEARNER.append(OpenRLHFEarlyStop(_CONFIG[0], group_size=int(args.rollout.n_samples_per_prompt),
                                          max_new_tokens=int(args.rollout.max_new_tokens), step=resumed_step(args)))
    return _LEARNER[0]


# ---------------------------------------------------------------------------------- the CPPO seam
def infos_of(samples: list) -> list[dict]:
    """Each rollout sample's completion record; a sample without one is an error naming the fix."""
    out = []
    for i, sample in enumerate(samples):
        info = getattr(sample, INFO_ATTR, None)
        if info is None:
            raise ValueError(f"cppo early stop: rollout sample {i} carries no early-stop record: its rollout actor "
                             "did not generate it in segments (start the run with `cppo-megatron openrlhf`, whose "
                             "Ray workers install the rollout side; the source patch alone does not)")
        out.append(info)
    return out


def stopped_mask(infos: list[dict]) -> torch.Tensor:
    """[N] bool, the stopped completions."""
    return torch.tensor([bool(i["stopped"]) for i in infos], dtype=torch.bool)


def stand_in_rewards(samples: list, infos: list[dict]) -> None:
    """Give each stopped sample a reward of 0 so OpenRLHF's reward handling runs; nothing reads it
    (``core.early_stop_prune`` ignores a stopped row's reward; the sample never goes on)."""
    for sample, info in zip(samples, infos, strict=True):
        if info["stopped"]:
            if sample.rewards is not None:
                raise RuntimeError("cppo early stop: a stopped completion came back with a reward: it was scored")
            sample.rewards = torch.zeros(1)


def prune(rewards: torch.Tensor, group_ids: torch.Tensor, infos: list[dict], cfg: Any, args: Any,
          step: int) -> PruneResult:
    """CPPO's decision with stopped completions: the configured estimator's group statistics, the
    survivors chosen among the finished completions (``core.early_stop_prune``)."""
    mu, sq = learner(args).moments(infos)
    out = early_stop_prune(rewards, stopped_mask(infos), group_ids, cfg, expected=mu, expected_sq=sq, step=step)
    return PruneResult(advantages=out.advantages.to(rewards.dtype), stats=out.stats, selection=out.selection)


def end_step(args: Any, step: int, samples: list, rewards: torch.Tensor, group_ids: torch.Tensor,
             infos: list[dict], kept: torch.Tensor) -> tuple[dict[str, float], dict[str, Any]]:
    """The step's ``early_stop/*`` metrics and audit record (``GroupStopLearner.account_step``);
    the predictor is refitted for step ``step + 1``."""
    state = learner(args)
    decided = {int(i["step"]) for i in infos}
    if decided != {step}:
        raise RuntimeError(f"cppo early stop: the rollout was decided in step(s) {sorted(decided)} but is trained "
                           f"in step {step}: the generation and the hook disagree on the step")
    lengths = torch.cat([torch.as_tensor(s.response_length).reshape(-1) for s in samples]).to(torch.int64)
    metrics, record = state.account_step(step, [str(int(g)) for g in group_ids], rewards, lengths, infos, kept)
    record["vllm_generated"] = [int(i.get("vllm_generated", 0)) for i in infos]
    record["vllm_cached"] = [int(i.get("vllm_cached", 0)) for i in infos]
    metrics["early_stop/vllm_tokens_generated"] = float(sum(record["vllm_generated"]))
    state.next_step = step + 1
    logger.info("early stop, step %d: %d of %d completions stopped, %d tokens generated (%.0f%% of the budget)",
                step, int(metrics["early_stop/stopped"]), len(samples), int(metrics["early_stop/tokens_generated"]),
                100 * metrics["early_stop/tokens_vs_budget"])
    return metrics, record


# ---------------------------------------------------------------------------------- OpenRLHF's seams
def _wrap_generate_samples(original):
    @functools.wraps(original)
    def generate_samples(self, **generate_kwargs):
        if not enabled():
            return original(self, **generate_kwargs)
        group_size = int(generate_kwargs.get("n_samples_per_prompt", self.args.rollout.n_samples_per_prompt))
        _ACTIVE[:] = [learner(self.args).context(group_size)]
        try:
            return original(self, **generate_kwargs)
        finally:
            _ACTIVE.clear()

    return generate_samples


def _params_with_context(current):
    @functools.wraps(current)
    def make(*args: Any, **kwargs: Any) -> Any:
        params = current(*args, **kwargs)
        if _ACTIVE:
            params.extra_args = {**(params.extra_args or {}), CONTEXT_KEY: _ACTIVE[0]}
        return params

    return make


def _wrap_to_experience(original):
    @functools.wraps(original)
    def _process_response_into_experience(self, response, **generate_kwargs):
        exp = original(self, response, **generate_kwargs)
        if isinstance(response, dict) and INFO_KEY in response:
            setattr(exp, INFO_ATTR, response[INFO_KEY])
        return exp

    return _process_response_into_experience


def _wrap_generator_init(original):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        loader = getattr(self, "prompts_dataloader", None)
        if loader is not None and enabled():
            _TRAIN_LOADERS[loader] = self

    return __init__


def _wrap_loader_state(original):
    @functools.wraps(original)
    def state_dict(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if self in _TRAIN_LOADERS and _LEARNER and isinstance(out, dict):
            out = {**out, STATE_KEY: _LEARNER[0].state_dict()}
        return out

    return state_dict


def _wrap_loader_load(original):
    @functools.wraps(original)
    def load_state_dict(self, state_dict, *args, **kwargs):
        saved = state_dict.get(STATE_KEY) if isinstance(state_dict, dict) else None
        if saved is not None:
            state_dict = {k: v for k, v in state_dict.items() if k != STATE_KEY}
        out = original(self, state_dict, *args, **kwargs)
        generator = _TRAIN_LOADERS.get(self)
        if generator is not None:  # OpenRLHF restores the dataloader exactly when it resumes (ppo_trainer.py:514-518)
            state = learner(generator.args)
            state.next_step = resumed_step(generator.args)
            if saved is None:
                warnings.warn(f"cppo: the checkpoint of global step {state.next_step} has no early-stopping state "
                              f"({STATE_KEY}): the predictor starts untrained and stops nothing until it has seen "
                              f"{state.es.min_examples} completions of each outcome", stacklevel=2)
            else:
                state.load_state_dict(saved)
                logger.info("early stop: resumed at step %d, predictor version %d (ready: %s)", state.next_step,
                            state.predictor.version, state.ready)
        return out

    return load_state_dict


def _patch_generator(module: Any) -> None:
    cls = getattr(module, "SamplesGenerator", None)
    if cls is None:
        return  # the module is still executing: its own import callback comes back
    for name, make in (("__init__", _wrap_generator_init), ("generate_samples", _wrap_generate_samples),
                       ("_process_response_into_experience", _wrap_to_experience)):
        wrap(cls, name, make, tag=WRAP_TAG)
    wrap(module, "SamplingParams", _params_with_context, tag=WRAP_TAG)


def _patch_loader(module: Any) -> None:
    cls = getattr(module, "StatefulDataLoader", None)
    if cls is not None:
        wrap(cls, "state_dict", _wrap_loader_state, tag=WRAP_TAG)
        wrap(cls, "load_state_dict", _wrap_loader_load, tag=WRAP_TAG)


_PATCHES = ((GENERATOR_MODULE, _patch_generator), (LOADER_MODULE, _patch_loader))


def install(cfg: Any) -> bool:
    """Early stopping in this process when ``cfg.early_stop.enabled`` (the trainer's seams wrapped as
    their modules are imported, and the rollout side for a rollout actor in this process; idempotent);
    otherwise removes it. Returns whether it is on."""
    from ..importhook import after_import

    if not cfg.early_stop.enabled:
        uninstall()
        return False
    if _CONFIG != [cfg]:  # a new run's config: a new learner (installing the same one again keeps the run's)
        _LEARNER.clear()
    _CONFIG[:] = [cfg]
    for module, patch in _PATCHES:
        after_import(module, patch)
    early_stop_rollout.install(cfg)
    return True


def uninstall() -> None:
    """Remove the wrappers and forget the config and the learner (tests; a run without early stopping)."""
    from ..importhook import remove

    _CONFIG.clear()
    _LEARNER.clear()
    _ACTIVE.clear()
    for _module, patch in _PATCHES:
        remove(patch)
    generator = sys.modules.get(GENERATOR_MODULE)
    cls = getattr(generator, "SamplesGenerator", None)
    if cls is not None:
        for name in ("__init__", "generate_samples", "_process_response_into_experience"):
            unwrap(cls, name, tag=WRAP_TAG)
        unwrap(generator, "SamplingParams", tag=WRAP_TAG)
    loader = getattr(sys.modules.get(LOADER_MODULE), "StatefulDataLoader", None)
    if loader is not None:
        for name in ("state_dict", "load_state_dict"):
            unwrap(loader, name, tag=WRAP_TAG)
    early_stop_rollout.uninstall()
