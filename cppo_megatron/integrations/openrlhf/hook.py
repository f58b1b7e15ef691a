"""CPPO in OpenRLHF 0.11.2: prune rollout samples at the start of ``make_experience_batch``.

OpenRLHF's step (both ``PPOTrainer`` and the async ``TrainingActor`` reach it through
``BasePPOTrainer.train_step``)::

    rollout samples (rewards already on them)  -> make_experience_batch:
        split_rollout_samples -> make_experience (actor / ref / critic forwards via Ray)
        -> compute_advantages_and_returns (length penalties, group baseline, returns)

The hook wraps two methods of ``RemoteExperienceMaker``:

- ``make_experience_batch``: before anything else, apply OpenRLHF's length penalties to
  the full rollout, group the samples by prompt (consecutive runs of the same prompt,
  at most ``n_samples_per_prompt`` long, so uneven groups are fine), compute full-group
  advantages with the core, select survivors (``core.prune``), keep more where OpenRLHF
  needs more samples (``minimum_keep_multiple``), record each survivor's full-group
  mean/std in its ``info``, optionally reorder survivors so each actor gets an equal
  workload (``core.balance_partitions``), and pass only the survivors on.
- ``compute_advantages_and_returns``: when survivors carry recorded statistics, replace
  each reward by its full-group advantage (``core.advantages_from_stats``), then run
  OpenRLHF's own advantage step with its group baseline and length penalties turned off
  (both already applied), so the KL shaping, returns and logging stay OpenRLHF's.

Install with ``install(cfg)`` (this process) or, for Ray workers, through the
``CPPO_OPENRLHF_CONFIG`` environment variable (``install_from_env``,
``setup_ray_worker``); the launcher ``python -m cppo_megatron.integrations.openrlhf.train``
does both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from ...config import CPPOConfig
from ...core import (
    advantages_from_stats,
    balance_partitions,
    keep_order,
    naive_partition,
    prune,
    sequence_workload,
)
from ...core.signal import signal_metrics
from ..importhook import after_import, remove
from ..wrap import is_wrapped, unwrap, wrap
from . import diagnostics, filtering, observers, selective
from . import early_stop as early_stopping
from .checkpoint import resumed_step

logger = logging.getLogger(__name__)

ENV_CONFIG = "CPPO_OPENRLHF_CONFIG"
TARGET_MODULE = "openrlhf.trainer.ppo_utils.experience_maker"

# OpenRLHF estimator -> the core's adv_norm (the estimators with a per-prompt group baseline)
SUPPORTED_ESTIMATORS = {"group_norm": "std", "dr_grpo": "none"}

# private info keys: each survivor's full-group reward mean / std (removed by the advantage step)
MEAN_KEY = "cppo_group_mean"
STD_KEY = "cppo_group_std"
# an estimator name OpenRLHF's advantage step does not know: no group baseline, no whitening
_PRECOMPUTED = "cppo_precomputed_group_baseline"

WRAP_TAG = __name__  # marks our layers on RemoteExperienceMaker's two methods (integrations/wrap.py)
WRAPPED = ("make_experience_batch", "compute_advantages_and_returns")
_CONFIG: CPPOConfig | None = None


# ---------------------------------------------------------------------------- grouping
def group_ids_from_samples(samples: list, n_samples_per_prompt: int) -> torch.Tensor:
    """[N] int64 group ids of single-sample rollout ``Experience`` objects.

    OpenRLHF puts the ``n_samples_per_prompt`` samples of one prompt next to each other
    (one vLLM request per prompt) but stores no prompt id; its own advantage step then
    reshapes by ``n``. Here a group is a run of consecutive samples with the same prompt
    and label, cut after ``n`` samples (so a prompt drawn twice in a row stays two
    groups), and a shorter run is a smaller group rather than a misaligned reshape.
    """
    if isinstance(n_samples_per_prompt, bool) or not isinstance(n_samples_per_prompt, int) or n_samples_per_prompt < 1:
        raise ValueError(f"n_samples_per_prompt must be an integer >= 1, got {n_samples_per_prompt!r}")
    ids: list[int] = []
    prev_key: Any = object()
    run = 0
    for i, sample in enumerate(samples):
        prompts = getattr(sample, "prompts", None)
        if not prompts or len(prompts) != 1:
            raise ValueError(
                f"rollout sample {i} holds {len(prompts) if prompts else 0} prompts; CPPO expects OpenRLHF's "
                "single-sample rollout Experiences (one prompt each)"
            )
        labels = getattr(sample, "labels", None) or [None]
        key = (prompts[0], labels[0])
        if key != prev_key or run == n_samples_per_prompt:
            ids.append(ids[-1] + 1 if ids else 0)
            run = 1
        else:
            ids.append(ids[-1])
            run += 1
        prev_key = key
    return torch.tensor(ids, dtype=torch.int64)


# ---------------------------------------------------------------------------- batch size rules
def effective_actors(args: Any, role: str = "actor") -> int:
    """Data-parallel ranks of a model group (OpenRLHF's ``effective_actor_num``)."""
    group = getattr(args, role)
    return max(
        1, group.num_nodes * group.num_gpus_per_node // args.ds.ring_attn_size // args.ds.tensor_parallel_size
    )


def minimum_keep_multiple(args: Any) -> int:
    """The kept count must be a multiple of this for OpenRLHF to use every survivor.

    - ``RayActorGroup.async_run_method_batch`` refuses fewer micro-batches than a model
      group has ranks (``Insufficient batch size``) and gives the last rank a short chunk
      when the count does not divide: a multiple of ``micro_batch_size x ranks`` (dynamic
      batching: of ``ranks``) for the actor and, when it exists (``--algo.kl.init_coef >
      0``), the reference group gives every rank the same number of samples.
    - the replay buffer trains ``train.batch_size`` samples per optimizer step and drops a
      remainder: a multiple of ``train.batch_size`` trains every survivor.
    """
    ranks = [effective_actors(args, "actor")]
    if args.algo.kl.init_coef > 0:
        ranks.append(effective_actors(args, "ref"))
    per_sample = 1 if args.train.dynamic_batch_enable else args.rollout.micro_batch_size
    return math.lcm(*(per_sample * r for r in ranks), args.train.batch_size)


# ---------------------------------------------------------------------------- the pruning step
def _config() -> CPPOConfig:
    if _CONFIG is None:
        raise RuntimeError("the CPPO hook for OpenRLHF is not installed (call install(cfg))")
    return _CONFIG


def _check_config(cfg: CPPOConfig) -> CPPOConfig:
    """Validate ``cfg`` and refuse what this hook cannot run correctly."""
    cfg.validate()
    if cfg.metric == "importance":
        raise ValueError(
            "cppo metric=importance is not supported under OpenRLHF: its 1/pi weights would have to reach "
            "OpenRLHF's per-micro-batch policy loss with the full batch's denominators, and the survivors "
            "topped up to a multiple of the actors are outside the sampling design. Use the embedded trainer "
            "or the Megatron backend (`cppo-megatron train`), or metric=smallest."
        )
    return cfg


def check_settings(values: Mapping[str, Any], estimator: str) -> list[str]:
    """CPPO settings set explicitly (the recipe's ``cppo:`` section, ``--cppo.FIELD``; nested as
    ``config.nest_keys`` gives them) that an OpenRLHF run cannot honour: ValueError for those that
    would change the run, one-line warnings (returned) for those that do nothing here."""
    if values.get("dynamic_sampling"):
        raise ValueError(
            "cppo.dynamic_sampling=true is not supported under OpenRLHF: the hook prunes a finished rollout "
            "and cannot draw replacement prompts; remove it and use OpenRLHF's own "
            "--algo.dynamic_filtering_enable, which replaces filtered prompts before the hook sees the rollout"
        )
    if values.get("equal_size") is False:
        raise ValueError(
            "cppo.equal_size=false cannot be honoured under OpenRLHF: each actor gets an equal consecutive "
            "chunk of the survivors, so they are always balanced into equal-size parts; remove it"
        )
    two_wave = values.get("two_wave") or {}
    if isinstance(two_wave, Mapping) and two_wave.get("enabled"):
        raise ValueError(
            "cppo.two_wave.enabled=true is not built for OpenRLHF: the integration sends each prompt's G "
            "requests whole, before any reward; remove it, or run two waves in the embedded trainer "
            "(cppo-megatron train, backend=hf)"
        )
    implied = SUPPORTED_ESTIMATORS.get(estimator)
    if "adv_norm" in values and implied is not None and values["adv_norm"] != implied:
        other = next(e for e, n in SUPPORTED_ESTIMATORS.items() if n == values["adv_norm"]) \
            if values["adv_norm"] in SUPPORTED_ESTIMATORS.values() else None
        fix = f" or use --algo.advantage.estimator {other}" if other else ""
        raise ValueError(
            f"cppo.adv_norm={values['adv_norm']} conflicts with --algo.advantage.estimator {estimator}, whose "
            f"advantage normalisation ({implied}) the hook follows; remove cppo.adv_norm{fix}"
        )
    notes = []
    if "max_refill_rounds" in values and not values.get("dynamic_sampling"):
        notes.append(f"cppo.max_refill_rounds={values['max_refill_rounds']} has no effect under OpenRLHF: refill "
                     "rounds belong to cppo.dynamic_sampling, which OpenRLHF runs do not support; remove it")
    selective = values.get("selective") or {}
    if isinstance(selective, Mapping) and not selective.get("enabled"):
        notes += [f"cppo.selective.{name}={value} has no effect: it belongs to cppo.selective.enabled, which is off; "
                  "set cppo.selective.enabled=true or remove it"
                  for name, value in selective.items() if name != "enabled"]
    return notes


def check_supported(args: Any) -> str:
    """The core's ``adv_norm`` for the run's advantage estimator; raises, naming the flag, when
    CPPO cannot run with ``args`` (an estimator without a group baseline, groups of one)."""
    estimator = args.algo.advantage.estimator
    if estimator not in SUPPORTED_ESTIMATORS:
        raise ValueError(
            f"CPPO needs a group-relative advantage: --algo.advantage.estimator must be one of "
            f"{sorted(SUPPORTED_ESTIMATORS)}, got {estimator!r}"
        )
    if args.rollout.n_samples_per_prompt < 2:
        raise ValueError(
            "CPPO prunes within groups: --rollout.n_samples_per_prompt must be >= 2, "
            f"got {args.rollout.n_samples_per_prompt}"
        )
    return SUPPORTED_ESTIMATORS[estimator]


def prune_rollout_samples(maker: Any, rollout_samples: list, cfg: CPPOConfig | None = None) -> list:
    """The survivors of one rollout batch, with their full-group statistics recorded.

    ``maker`` is OpenRLHF's ``RemoteExperienceMaker`` (its ``strategy.args`` are read);
    ``rollout_samples`` are the single-sample ``Experience`` objects of one step. Returns a
    new list of the kept samples (the same objects); the pruned ones are only counted.
    """
    cfg = _check_config(cfg or _config())
    args = maker.strategy.args
    adv_norm = check_supported(args)
    if not rollout_samples:
        return rollout_samples
    # early stopping: the stopped samples' records; they get a stand-in reward nothing reads
    infos = early_stopping.infos_of(rollout_samples) if early_stopping.enabled() else None
    if infos is not None:
        early_stopping.stand_in_rewards(rollout_samples, infos)
    raw_rewards, rewards, group_ids = _step_rewards(rollout_samples, args)
    # OpenRLHF's global step before this one (0-based): a resumed run continues the count
    step = int(maker._cppo_step) if hasattr(maker, "_cppo_step") else resumed_step(args)
    maker._cppo_step = step + 1
    # selective rollout (GRESO): every generated group's outcome, under its prompt index, before pruning
    recorded = selective.record_step(rollout_samples, raw_rewards, rewards, group_ids, step=step)
    run_cfg = cfg if cfg.adv_norm == adv_norm else dataclasses.replace(cfg, adv_norm=adv_norm)
    stopped = None if infos is None else early_stopping.stopped_mask(infos)
    result = prune(rewards, group_ids, run_cfg, step=step) if infos is None else \
        early_stopping.prune(rewards, group_ids, infos, run_cfg, args, step)
    kept, multiple = _kept_to_a_multiple(result, run_cfg, args, step, exclude=stopped)
    metrics = _step_metrics(result, rewards, kept.numel(), multiple)
    # signal/*: every group of the step before pruning (the finished completions), on the rewards the advantages see
    lengths = torch.cat([torch.as_tensor(s.response_length).reshape(-1) for s in rollout_samples])
    fin = slice(None) if stopped is None else ~stopped
    metrics.update(signal_metrics(rewards[fin], group_ids[fin], lengths=lengths[fin]))
    if infos is not None:  # early_stop/*: every completion kept, pruned after generation or stopped, counted
        es_metrics, es_record = early_stopping.end_step(args, step, rollout_samples, rewards, group_ids, infos, kept)
        metrics.update(es_metrics)
        if observers.HUB.recording():
            observers.HUB.record("early_stop", role="trainer", **es_record)
    order_out, balance_metrics = _balanced_order(kept, rollout_samples, args, cfg)
    metrics.update(balance_metrics)
    if recorded is not None:
        metrics.update(recorded[0])
    account = _filter_account(rollout_samples, args, metrics, kept=kept.numel())
    survivors = _survivors(rollout_samples, order_out, result, metrics)
    logger.info(
        "CPPO step %d: kept %d of %d (%d selected, %d topped up to a multiple of %d), %d groups, %d fully pruned",
        step, kept.numel(), rewards.numel(), result.selection.num_kept, kept.numel() - result.selection.num_kept,
        multiple, int(metrics["cppo/num_groups"]), int(metrics["cppo/groups_fully_pruned"]),
    )  # fmt: skip
    maker._cppo_last_metrics = metrics
    # whatever diagnostics subscribed (observers.HUB.on_prune; none by default)
    observers.HUB.prune_decided(observers.PruneDecision(
        step, rollout_samples, rewards, group_ids, result, order_out.tolist(), account=account,
        ledgers=[led.serial for led in filtering.ledgers_of(rollout_samples)],
        selective=None if recorded is None else recorded[1]))
    for sample in rollout_samples:  # accounted: the ledger need not travel on to the model actors
        sample.__dict__.pop(filtering.FILTER_ATTR, None)
    return survivors


def _step_rewards(samples: list, args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(raw_rewards [N] as the reward function returned them, rewards [N] after OpenRLHF's length
    penalties, group_ids [N]) of one rollout; refuses samples without a reward or of several rows,
    and checks the groups DAPO's filter passed (it judged the rewards as returned)."""
    from openrlhf.trainer.ppo_utils import experience_maker as em  # its own length penalties

    for i, sample in enumerate(samples):
        if sample.rewards is None:
            raise ValueError(
                f"rollout sample {i} has no reward: CPPO prunes before the model forwards, so rewards must come "
                "with the rollout (--reward.remote_url or --train.agent_func_path), not from a reward model"
            )
        if sample.rewards.numel() != 1 or sample.sequences.shape[0] != 1:
            raise ValueError(f"rollout sample {i} holds {sample.sequences.shape[0]} rows; expected one")
        # as OpenRLHF's advantage step: at least fp32 for penalties and group statistics
        sample.rewards = sample.rewards.to(torch.promote_types(sample.rewards.dtype, torch.float32))
    raw_rewards = torch.cat([s.rewards.reshape(1) for s in samples])  # as returned, before penalties
    group_ids = group_ids_from_samples(samples, args.rollout.n_samples_per_prompt)
    # penalties change rewards, so they come before the group statistics (as in OpenRLHF)
    em.apply_length_penalties(samples, args)
    return raw_rewards, torch.cat([s.rewards.reshape(1) for s in samples]), group_ids


def _kept_to_a_multiple(result: Any, cfg: CPPOConfig, args: Any, step: int,
                        exclude: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    """(kept [K] ascending indices, the multiple): the core's survivors, topped up with the next ones
    in the core's order where OpenRLHF needs a multiple of ``multiple`` (``minimum_keep_multiple``),
    never from the rows ``exclude`` ([N] bool: stopped completions, which have no reward)."""
    multiple = minimum_keep_multiple(args)
    n_core = result.selection.num_kept
    free = ~result.selection.kept_mask() if exclude is None else ~result.selection.kept_mask() & ~exclude
    n_keep = min(n_core + int(free.sum()), -(-n_core // multiple) * multiple)
    kept_mask = result.selection.kept_mask()
    if n_keep > n_core:
        order = keep_order(result.advantages, cfg, step=step)
        kept_mask[order[free[order]][: n_keep - n_core]] = True
    return kept_mask.nonzero().squeeze(1), multiple


def _step_metrics(result: Any, rewards: torch.Tensor, n_keep: int, multiple: int) -> dict[str, float]:
    """The core's ``cppo/*`` metrics with the counts after the top-up."""
    n_total, n_core = rewards.numel(), result.selection.num_kept
    metrics = result.metrics()
    metrics.update({
        "cppo/num_kept_selected": float(n_core),
        "cppo/num_kept": float(n_keep),
        "cppo/num_pruned": float(n_total - n_keep),
        "cppo/kept_ratio": n_keep / n_total,
        "cppo/topped_up": float(n_keep - n_core),
        "cppo/keep_multiple": float(multiple),
        # OpenRLHF's rollout/reward_mean only sees survivors from here on
        "cppo/reward_mean_generated": float(rewards.mean()),
    })
    return metrics


def _filter_account(samples: list, args: Any, metrics: dict, *, kept: int) -> Any:
    """With DAPO's filter on: the step's account of its filter ledgers (``filtering.account_step``),
    its metrics added to ``metrics``; None when the filter is off or left no ledger (warned)."""
    if not filtering.enabled(args):
        return None
    ledgers = filtering.ledgers_of(samples)
    if not ledgers:
        logger.warning("dynamic filtering is on but the rollout carries no filter ledger (OpenRLHF's samples "
                       "generator is not hooked): the dropped groups are not accounted for this step")
        return None
    account = filtering.account_step(ledgers, num_samples=len(samples), kept=kept, target=int(args.rollout.batch_size))
    metrics.update(account.metrics())
    if account.short:
        logger.warning("dynamic filtering: only %d of %d groups passed before the prompts ran out; CPPO "
                       "prunes them at the same rate (a short step, as in plain OpenRLHF)",
                       account.passed, account.target)
    return account


def _survivors(samples: list, order: torch.Tensor, result: Any, metrics: dict) -> list:
    """The kept samples in ``order``, each carrying its full group's mean and std and a copy of the
    step's metrics in its ``info`` (OpenRLHF averages info entries into its logs)."""
    mean, std = result.stats.row_mean(), result.stats.row_std()
    survivors = []
    for idx in order.tolist():
        sample = samples[idx]
        sample.info[MEAN_KEY] = mean[idx : idx + 1].to(sample.rewards.dtype)
        sample.info[STD_KEY] = std[idx : idx + 1].to(sample.rewards.dtype)
        for key, value in metrics.items():
            sample.info[key] = torch.tensor([value], dtype=torch.float32)
        survivors.append(sample)
    return survivors


def _balanced_order(kept: torch.Tensor, samples: list, args: Any, cfg: CPPOConfig) -> tuple[torch.Tensor, dict]:
    """Order survivors so the consecutive chunks OpenRLHF hands each actor weigh the same.

    Without dynamic batching, ``split_rollout_samples`` cuts consecutive micro-batches and
    ``async_run_method_batch`` gives each actor a consecutive chunk of them. With dynamic
    batching OpenRLHF balances by itself (``get_seqlen_balanced_partitions`` and
    ``balance_experiences``), so the order is left alone.
    """
    actors = effective_actors(args)
    k = kept.numel()
    unit = args.rollout.micro_batch_size * actors
    if not cfg.rebalance or args.train.dynamic_batch_enable or actors == 1 or k % unit != 0:
        return kept, {"cppo/rebalanced": 0.0}
    lengths = torch.tensor([float(samples[i].total_length.reshape(-1)[0]) for i in kept.tolist()])
    work = sequence_workload(lengths, linear=cfg.workload_linear, quadratic=cfg.workload_quadratic)
    part = balance_partitions(work, actors, equal_size=True)
    order = []
    for chunk in part.parts:
        members = torch.as_tensor(chunk, dtype=torch.int64)
        # longest first inside a chunk: micro-batches of similar lengths pad less
        members = members[torch.argsort(lengths[members], descending=True, stable=True)]
        order.append(kept[members])
    return torch.cat(order), {
        "cppo/rebalanced": 1.0,
        "cppo/actor_imbalance": float(part.imbalance),
        "cppo/actor_imbalance_unbalanced": float(naive_partition(work, actors).imbalance),
    }


# ---------------------------------------------------------------------------- the advantage step
@contextlib.contextmanager
def _precomputed_baseline(args: Any) -> Iterator[None]:
    """Run OpenRLHF's advantage step on rewards that already are full-group advantages.

    An estimator name it does not know skips its group baseline and whitening (the
    per-token branch reads ``self.advantage_estimator``, which is unchanged);
    ``n_samples_per_prompt = 1`` makes its reshape by ``n`` a no-op; the length penalties
    were applied before pruning. Restored on exit.
    """
    saved = (
        args.algo.advantage.estimator,
        args.rollout.n_samples_per_prompt,
        getattr(args.reward, "overlong_buffer_len", None),
        getattr(args.reward, "stop_properly_penalty_coef", None),
    )
    args.algo.advantage.estimator = _PRECOMPUTED
    args.rollout.n_samples_per_prompt = 1
    args.reward.overlong_buffer_len = None
    args.reward.stop_properly_penalty_coef = None
    try:
        yield
    finally:
        (
            args.algo.advantage.estimator,
            args.rollout.n_samples_per_prompt,
            args.reward.overlong_buffer_len,
            args.reward.stop_properly_penalty_coef,
        ) = saved


def compute_advantages_with_recorded_stats(
    maker: Any, experiences: list, original: Callable, cfg: CPPOConfig | None = None
) -> list:
    """OpenRLHF's advantage step, with the group baseline from the recorded full groups."""
    if not experiences or MEAN_KEY not in experiences[0].info:
        return original(maker, experiences)
    cfg = cfg or _config()
    args = maker.strategy.args
    adv_norm = check_supported(args)
    rewards = []
    for i, exp in enumerate(experiences):
        if MEAN_KEY not in exp.info or STD_KEY not in exp.info:
            raise ValueError(f"experience {i} lacks the recorded group statistics ({MEAN_KEY}, {STD_KEY})")
        reward = exp.rewards.to(torch.promote_types(exp.rewards.dtype, torch.float32))
        mean, std = exp.info.pop(MEAN_KEY), exp.info.pop(STD_KEY)
        rewards.append(reward)
        exp.info["group_reward_std"] = std.to(reward.dtype)  # the full group's, as OpenRLHF logs it
        exp.rewards = advantages_from_stats(reward, mean, std, adv_norm=adv_norm, eps=cfg.eps)
    with _precomputed_baseline(args):
        experiences = original(maker, experiences)
    for exp, reward in zip(experiences, rewards, strict=False):
        exp.rewards = reward  # the (penalised) reward again, for logging and the replay buffer
        if "reward" in exp.info:
            exp.info["reward"] = reward.clone()
    return experiences


# ---------------------------------------------------------------------------- installation
def _pruning_make_batch(make_batch):
    def make_experience_batch(self, rollout_samples):
        return make_batch(self, prune_rollout_samples(self, rollout_samples))

    make_experience_batch.__doc__ = f"CPPO ({__name__}) around OpenRLHF's make_experience_batch."
    return torch.no_grad()(make_experience_batch)


def _advantages_from_recorded_stats(advantages):
    def compute_advantages_and_returns(self, experiences):
        return compute_advantages_with_recorded_stats(self, experiences, advantages)

    compute_advantages_and_returns.__doc__ = f"CPPO ({__name__}) around OpenRLHF's compute_advantages_and_returns."
    return torch.no_grad()(compute_advantages_and_returns)


def is_installed(maker_class: Any) -> bool:
    """True when ``maker_class`` (or the class it inherits the methods from) carries the hook."""
    return all(is_wrapped(getattr(maker_class, name, None), WRAP_TAG) for name in WRAPPED)


def _experience_maker(maker_class: Any) -> Any:
    """``maker_class``, or OpenRLHF's ``RemoteExperienceMaker`` when None."""
    if maker_class is not None:
        return maker_class
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

    return RemoteExperienceMaker


def install(cfg: CPPOConfig, maker_class: Any = None) -> None:
    """Wrap ``RemoteExperienceMaker`` in this process (idempotent; ``cfg`` replaces the last)."""
    global _CONFIG
    if not isinstance(cfg, CPPOConfig):
        raise ValueError(f"install expects a CPPOConfig, got {type(cfg).__name__}")
    maker_class = _experience_maker(maker_class)
    _CONFIG = _check_config(cfg)
    # GRESO's seams (prompt index, draw, checkpoint) when cfg asks for it, else removed (selective.py)
    selective.install(_CONFIG)
    early_stopping.install(_CONFIG)  # segment-wise generation and the stopped samples' accounting (early_stop.py)
    if is_installed(maker_class):
        return
    wrap(maker_class, "make_experience_batch", _pruning_make_batch, tag=WRAP_TAG)
    wrap(maker_class, "compute_advantages_and_returns", _advantages_from_recorded_stats, tag=WRAP_TAG)
    # DAPO's filter runs in the samples generator, before the rollout reaches the hook (filtering.py)
    after_import(filtering.GENERATOR_MODULE, filtering.install_generator)
    logger.info("CPPO installed in OpenRLHF's RemoteExperienceMaker: %s", cfg.describe())


def uninstall(maker_class: Any = None) -> None:
    """Restore OpenRLHF's methods."""
    global _CONFIG
    maker_class = _experience_maker(maker_class)
    for name in WRAPPED:
        unwrap(maker_class, name, tag=WRAP_TAG)
    remove(filtering.install_generator)
    selective.uninstall()
    early_stopping.uninstall()
    generator = sys.modules.get(filtering.GENERATOR_MODULE)
    if generator is not None:
        filtering.uninstall_generator(generator)
    _CONFIG = None


def config_from_env() -> CPPOConfig | None:
    """The CPPOConfig in ``$CPPO_OPENRLHF_CONFIG`` (JSON of its fields), or None when unset."""
    raw = os.environ.get(ENV_CONFIG, "").strip()
    if not raw:
        return None
    try:
        values = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"${ENV_CONFIG} is not JSON ({exc}): {raw[:200]!r}") from exc
    return CPPOConfig.from_dict(values)


def install_from_env(maker_class: Any = None) -> bool:
    """Install when ``$CPPO_OPENRLHF_CONFIG`` is set (the source patch's call, and each Ray worker's
    on importing the experience maker); True if installed. The diagnostics whose switch is set
    (``CPPO_OPENRLHF_AUDIT``) are installed with it: the patched source has no worker setup hook."""
    cfg = config_from_env()
    if cfg is None:
        return False
    install(cfg, maker_class)
    diagnostics.install()  # what CPPO_OPENRLHF_AUDIT asks for; nothing is imported without it
    return True


def _install_on_import(module) -> None:
    """``importhook`` callback: hook the experience maker of the module just imported."""
    install_from_env(module.RemoteExperienceMaker)


def setup_ray_worker() -> None:
    """Ray ``worker_process_setup_hook``: hook OpenRLHF in every worker that imports it.

    Workers that never import the experience maker (vLLM engines, model actors) import
    nothing extra.
    """
    cfg = config_from_env()
    if cfg is None:
        return
    if cfg.early_stop.enabled:  # a rollout actor never imports the experience maker: its side installs here
        from . import early_stop_rollout

        early_stop_rollout.install(cfg)
    after_import(TARGET_MODULE, _install_on_import)  # now, when the module is already imported
    # the async trainer generates in another actor, which may never import the experience maker
    after_import(filtering.GENERATOR_MODULE, filtering.install_generator)
