"""The pruning hook at veRL's ``_balance_batch`` seam.

In both veRL loops ``_balance_batch`` is the one call between "rewards are on the batch" and
"old-policy log-probs": V1 ``PPOTrainer._step_once`` (a ``KVBatchMeta`` whose data live in
TransferQueue) and the legacy ``RayPPOTrainer.fit`` (an in-place ``DataProto``). The wrapper
installed here runs only when ``algorithm.adv_estimator == "cppo"``:

1. full-group advantages from the rewards already on the batch (``rm_scores`` summed per row);
2. survivors by the core (``cppo_megatron.core.prune``), seeded by (cppo.seed, global step);
3. the full-group statistics are recorded for the ``cppo`` estimator (``stats``);
4. pruned rows are dropped, and in V1 their stored data are cleared from TransferQueue;
5. veRL's own ``_balance_batch`` then pads to the DP/mini-batch multiple and rebalances. V1
   pads with veRL's loss-free synthetic rows (``is_padding``); for the legacy loop this
   module adds loss-free rows (response mask 0) itself, never duplicates of real rows;
6. the core balancer is run on the same workloads (veRL's model, 24576 s + s^2); when it
   lowers the largest rank's workload (``cppo.rebalance``), its order replaces veRL's.

Metrics go into veRL's metrics dict under ``cppo/``, and ``signal/*`` (``signal.py``) over the rows
before pruning — with any estimator: a run without ``cppo`` gets only those. With DAPO's filter on
(``algorithm.filter_groups``, V1 sync only: ``dapo.py``), veRL's replay buffer has already dropped
the groups whose filter metric is equal and refilled the batch when it reaches this seam; the hook
prunes what passed and counts the groups among them whose rewards are all equal
(``cppo/filter_passed_zero_variance``: none under ``metric=reward``, possible under ``acc`` and the
other ``reward_extra_info`` fields).
"""

from __future__ import annotations

import functools
import importlib
import math
import os
import sys
import warnings
from typing import cast

import numpy as np
import torch

from ...core import PruneResult, balance_partitions, early_stop_prune, prune, sequence_workload
from .. import importhook
from ..importhook import after_import
from ..wrap import is_wrapped, unwrap, wrap
from . import dapo, early_stop, observers, selective, signal
from .observers import PruneDecision
from .runconfig import PREPARED_ENV, RunSettings, settings_of, unprepared_message
from .signal import row_rewards as _row_rewards
from .signal import row_tokens as _row_tokens
from .stats import GroupRecord, record_groups

__all__ = [
    "HOOK_TARGETS",
    "decide",
    "install",
    "is_installed",
    "prune_dataproto",
    "prune_kv_batch",
    "uninstall",
    "warn_if_unprepared",
]

# module -> class whose ``_balance_batch`` is wrapped (the V1 base serves sync and async modes)
HOOK_TARGETS = {
    "verl.trainer.ppo.v1.trainer_base": "PPOTrainer",
    "verl.trainer.ppo.ray_trainer": "RayPPOTrainer",
}
WRAP_TAG = __name__  # marks our layer on ``_balance_batch`` (integrations/wrap.py)


# ---------------------------------------------------------------------------------- decision
def decide(uids: list, rewards: torch.Tensor, cfg, step: int, *, stopped: torch.Tensor | None = None,
           moments: tuple[torch.Tensor, torch.Tensor] | None = None):
    """Prune one batch: returns (PruneResult, {uid: GroupRecord} for groups with survivors).

    Args:
        uids: [N] prompt ids (veRL ``uid`` strings); group ids are assigned by first
            appearance, so every rank that sees the same batch decides identically.
        rewards: [N] outcome rewards.
        stopped: [N] bool, rows ``cppo.early_stop`` stopped in the rollout (their rewards are never
            read: ``core.early_stop_prune``, with ``moments`` = their expected reward and squared
            reward); the records then carry the estimator's group statistics.
    """
    if len(uids) != int(rewards.numel()):
        raise ValueError(f"{len(uids)} uids for {int(rewards.numel())} rewards")
    if len(uids) == 0:
        raise ValueError("cppo: the batch reaching _balance_batch is empty")
    first: dict[str, int] = {}
    gids = torch.tensor([first.setdefault(str(u), len(first)) for u in uids], dtype=torch.int64)
    if stopped is not None:
        es = early_stop_prune(rewards.detach().cpu(), stopped, gids, cfg, expected=None if moments is None else
                              moments[0], expected_sq=None if moments is None else moments[1], step=max(int(step), 0))
        result = PruneResult(es.advantages.to(torch.float32), es.stats, es.selection)
    else:
        result = prune(rewards.detach().cpu(), gids, cfg, step=max(int(step), 0))
    stats, sel = result.stats, result.selection
    names = list(first)  # group m has id m: ids were assigned 0..M-1
    records = {
        names[m]: GroupRecord(
            mean=float(stats.mean[m]),
            std=float(stats.std[m]),
            size=int(stats.size[m]),
            kept=int(sel.kept_per_group[m]),
            adv_norm=cfg.adv_norm,
            eps=float(cfg.eps),
            step=int(step),
        )
        for m in range(len(names))
        if int(sel.kept_per_group[m]) > 0
    }
    return result, records


def _metrics(result, cfg, extra: dict[str, float]) -> dict[str, float]:
    out = result.metrics()
    if cfg.keep_per_group is None:
        out["cppo/pruning_rate"] = float(cfg.rate)
    out.update(extra)
    return out


# ---------------------------------------------------------------------------------- observers
def _hand_on(trainer, run: RunSettings, decision: PruneDecision, lengths: torch.Tensor, metrics: dict,
             records: dict, stop: tuple | None = None) -> None:
    """Hand the step's decision to its observers, once, in order: ``signal/*`` (over the finished
    rows), selective rollout's history (``cppo.selective``) or early stopping's learner
    (``cppo.early_stop``: ``stop`` = (its state, the rows' stop infos, the stopped mask, vLLM's
    counters)), the ``cppo`` estimator's statistics, then whatever diagnostics subscribed
    (``observers.HUB.on_prune``; none by default)."""
    uids, rewards = decision.uids, decision.rewards
    if stop is not None:  # a stopped row has no reward: signal/* over the finished rows
        es, infos, stopped, counters = stop
        fin = (~stopped).nonzero().squeeze(1).tolist()
        metrics.update(signal.batch_signal([uids[i] for i in fin], rewards[fin], lengths[fin]))
        metrics.update(es.end_step(decision.step, uids, rewards, lengths, infos, decision.result.selection.kept,
                                   counters=counters))
    else:
        metrics.update(signal.batch_signal(uids, rewards, lengths))
        if run.selective:  # every finished group of the step is here: file their outcomes
            selective.record(trainer, uids, rewards, lengths, metrics)
    record_groups(records)
    observers.HUB.prune_decided(decision)


# ---------------------------------------------------------------------------------- V1 trainer
def _read_v1_rows(batch, stopping: bool) -> tuple[list[int], list[int], dict]:
    """The real rows (indices into ``batch``; veRL's ``is_padding`` rows apart) and their
    ``uid``, ``rm_scores``, ``response_mask`` (and, early stopping, ``extra_fields``) from
    TransferQueue."""
    import transfer_queue as tq

    padding = [bool(tag.get("is_padding", False)) for tag in batch.tags]
    real = [i for i, p in enumerate(padding) if not p]
    pads = [i for i, p in enumerate(padding) if p]
    keys = [batch.keys[i] for i in real]
    _check_single_output_sessions(keys)
    data = tq.kv_batch_get(keys=keys, partition_id=batch.partition_id,
                           select_fields=["uid", "rm_scores", "response_mask"] + (["extra_fields"] if stopping else []))
    return real, pads, data


def prune_kv_batch(trainer, batch, metrics: dict):
    """V1: prune a ``KVBatchMeta`` before ``_balance_batch``; returns the survivors' meta.

    Reads ``uid`` and ``rm_scores`` of the batch from TransferQueue, decides (the core), hands the
    decision to its observers (``_hand_on``), then clears the pruned keys from TransferQueue
    (storage does not grow) and returns a ``KVBatchMeta`` of the kept keys and tags, in their
    original order.
    """
    import transfer_queue as tq
    from transfer_queue import KVBatchMeta

    run = settings_of(trainer)
    real, pads, data = _read_v1_rows(batch, run.early_stop)
    keys = [batch.keys[i] for i in real]
    uids = [str(u) for u in list(data["uid"])]
    rewards = _row_rewards(data["rm_scores"]).to(torch.float32)
    lengths = _row_tokens(data["response_mask"])
    step = int(getattr(trainer, "global_steps", 0))
    stop = None
    if run.early_stop:
        es = early_stop.state_of(trainer)
        infos = early_stop.parse_infos(data["extra_fields"], len(uids))
        stopped = torch.tensor([bool(i["stopped"]) for i in infos])
        counters = early_stop.step_counters(data["extra_fields"]) if observers.HUB.recording() else None
        stop = (es, infos, stopped, counters)
        result, records = decide(uids, rewards, run.cfg, step, stopped=stopped, moments=es.moments(infos))
    else:
        result, records = decide(uids, rewards, run.cfg, step)
    # veRL's filter ran before this seam (dapo.py): groups that passed it with all rewards equal
    equal = dapo.equal_reward_groups(uids, rewards.tolist()) if run.filter_metric is not None else []
    _hand_on(trainer, run, PruneDecision(step, "v1", uids, rewards, result, batch, keys=keys,
                                         filter_metric=run.filter_metric, equal_groups=equal),
             lengths, metrics, records, stop)
    kept = [real[j] for j in result.selection.kept.tolist()] + pads
    pruned_keys = [batch.keys[real[j]] for j in result.selection.pruned.tolist()]
    extra = {"cppo/rows_cleared": float(len(pruned_keys))}
    if run.filter_metric is not None:
        extra["cppo/filter_passed_zero_variance"] = float(len(equal))
    if pruned_keys:
        tq.kv_clear(keys=pruned_keys, partition_id=batch.partition_id)
    metrics.update(_metrics(result, run.cfg, extra))
    return KVBatchMeta(
        keys=[batch.keys[i] for i in kept],
        tags=[batch.tags[i] for i in kept],
        partition_id=batch.partition_id,
        fields=batch.fields,
        extra_info=batch.extra_info,
    )


def _check_single_output_sessions(keys: list[str]) -> None:
    """V1 keys are ``{uid}_{session}_{output}``; GRPO-style groups need one output per session."""
    seen: dict[str, str] = {}
    for key in keys:
        parts = str(key).rsplit("_", 2)
        if len(parts) != 3:
            continue
        session = f"{parts[0]}_{parts[1]}"
        if session in seen:
            raise ValueError(
                f"cppo: keys {seen[session]!r} and {key!r} are two outputs of one agent session; "
                "multi-output sessions are not supported by the cppo estimator"
            )
        seen[session] = key


# ---------------------------------------------------------------------------------- legacy loop
def _required_multiple(trainer, dp_size: int) -> int:
    run = settings_of(trainer)
    multiple = dp_size
    if run.critic_warmup <= getattr(trainer, "global_steps", 0):
        multiple = math.lcm(multiple, run.actor_mini_batch * run.group_size)
    if getattr(trainer, "use_critic", False):
        multiple = math.lcm(multiple, run.critic_mini_batch * run.group_size)
    return multiple


def pad_dataproto_loss_free(batch, multiple: int, step: int) -> int:
    """Append rows so ``len(batch)`` is a multiple of ``multiple``; returns how many.

    A padding row copies the shortest real row's tensors (valid shapes and positions) with
    ``response_mask`` and every reward/score tensor zeroed, a fresh uid (its own group) and
    ``cppo_is_padding`` True: it adds no token to any loss (veRL's ``agg_loss`` excludes
    fully masked rows) and no statistic to any group.
    """
    from verl.protocol import DataProto

    n = len(batch)
    pad = (-n) % multiple
    if "cppo_is_padding" not in batch.non_tensor_batch:
        batch.non_tensor_batch["cppo_is_padding"] = np.zeros(n, dtype=bool)
    if pad == 0:
        return 0
    lengths = batch.batch["attention_mask"].sum(-1)
    src = int(torch.argmin(lengths))
    rows = batch.select_idxs(torch.full((pad,), src, dtype=torch.int64))
    for key in list(rows.batch.keys()):
        if key == "response_mask" or "score" in key or "reward" in key:
            rows.batch[key] = torch.zeros_like(rows.batch[key])
    rows.non_tensor_batch["uid"] = np.array([f"cppo-pad-{step}-{i}" for i in range(pad)], dtype=object)
    rows.non_tensor_batch["cppo_is_padding"] = np.ones(pad, dtype=bool)
    if "cppo_row" in rows.non_tensor_batch:
        rows.non_tensor_batch["cppo_row"] = np.full(pad, -1, dtype=np.int64)
    merged = DataProto.concat([batch, rows])
    batch.batch, batch.non_tensor_batch = merged.batch, merged.non_tensor_batch
    return pad


def prune_dataproto(trainer, batch, metrics: dict):
    """Legacy loop: prune a ``DataProto`` in place (the loop ignores the return value),
    then pad it loss-free to the DP x mini-batch multiple."""
    if batch.batch is None or "rm_scores" not in batch.batch.keys():
        raise ValueError(
            "cppo: no rm_scores on the batch at _balance_batch; rewards must be computed in the "
            "reward loop (the default since veRL 0.7.1), not by a colocated reward model"
        )
    run = settings_of(trainer)
    step = int(getattr(trainer, "global_steps", 0))
    uids = [str(u) for u in batch.non_tensor_batch["uid"]]
    rewards = _row_rewards(batch.batch["rm_scores"])
    metrics.update(signal.dataproto_signal(batch))
    result, records = decide(uids, rewards, run.cfg, step)
    record_groups(records)
    observers.HUB.prune_decided(PruneDecision(step, "legacy", uids, rewards, result, batch))
    kept = batch.select_idxs(result.selection.kept.to(torch.int64))
    batch.batch, batch.non_tensor_batch = kept.batch, kept.non_tensor_batch
    dp_size = trainer._get_dp_size(trainer.actor_rollout_wg, "actor")
    pad = pad_dataproto_loss_free(batch, _required_multiple(trainer, dp_size), step)
    metrics.update(_metrics(result, run.cfg, {"cppo/padding_rows": float(pad)}))
    return batch


# ---------------------------------------------------------------------------------- balance
def better_order(seq_lens: list[int], dp_size: int, cfg) -> tuple[list[int] | None, dict[str, float]]:
    """Compare veRL's DP split (equal contiguous chunks of the order it chose) with the core
    balancer on the same workload model; return the core's order when it lowers the largest
    rank workload (and ``cfg.rebalance``), else None, plus ``cppo/balance_*`` metrics."""
    n = len(seq_lens)
    if dp_size < 1 or n == 0 or n % dp_size:
        return None, {}
    w = sequence_workload(torch.tensor(seq_lens, dtype=torch.float64), linear=cfg.workload_linear,
                          quadratic=cfg.workload_quadratic)
    chunk = n // dp_size
    verl_max = float(w.view(dp_size, chunk).sum(dim=1).max())
    mean = float(w.sum()) / dp_size
    part = balance_partitions(w, dp_size, equal_size=True)
    use = cfg.rebalance and part.max_load < verl_max * (1 - 1e-9) and all(len(p) == chunk for p in part.parts)
    metrics = {
        "cppo/balance_imbalance_verl": verl_max / mean if mean else 1.0,
        "cppo/balance_imbalance_core": part.max_load / mean if mean else 1.0,
        "cppo/balance_used_core": float(use),
    }
    return ([i for p in part.parts for i in p] if use else None), metrics


def dp_token_loads(seq_lens: list[int], dp_size: int) -> list[int]:
    """Tokens each DP rank receives when ``seq_lens`` (rows in dispatch order) are split the way
    veRL dispatches a batch to its DP ranks: ``dp_size`` equal contiguous chunks, chunk r to every
    worker of DP rank r (its TP/PP peers get the same rows)."""
    n = len(seq_lens)
    if dp_size < 1 or n % dp_size:
        raise ValueError(f"dp_token_loads: {n} rows do not split into dp_size={dp_size} equal chunks")
    chunk = n // dp_size
    return [int(sum(seq_lens[r * chunk:(r + 1) * chunk])) for r in range(dp_size)]


def dp_load_metrics(final_lens: list[int], unbalanced_lens: list[int], dp_size: int) -> dict[str, float]:
    """``cppo/dp_rank{r}_tokens`` of the order dispatched, and max/mean token imbalance of that
    order (``cppo/dp_tokens_imbalance``) and of the pruned rows in arrival order, i.e. without any
    rebalancing (``cppo/dp_tokens_imbalance_unbalanced``)."""
    if len(final_lens) % max(dp_size, 1) or len(unbalanced_lens) != len(final_lens):
        return {}
    out: dict[str, float] = {"cppo/dp_size": float(dp_size)}
    for name, lens in (("", final_lens), ("_unbalanced", unbalanced_lens)):
        loads = dp_token_loads(lens, dp_size)
        mean = sum(loads) / dp_size
        out[f"cppo/dp_tokens_imbalance{name}"] = max(loads) / mean if mean else 1.0
        if not name:
            out.update({f"cppo/dp_rank{r}_tokens": float(x) for r, x in enumerate(loads)})
    return out


def _v1_dp_size(trainer) -> int:
    # DP rank of each worker, registered from the engine (Megatron: mpu's DP rank, so
    # world / (TP x PP x CP) ranks; FSDP: every rank): the same number veRL dispatches by
    return max(trainer.actor_rollout_wg._dispatch_info["actor"]) + 1


# ---------------------------------------------------------------------------------- install
def _arrival_lens(batch) -> list[int]:
    """Legacy loop: each row's tokens (``attention_mask`` summed), in the batch's current order."""
    return [int(x) for x in batch.batch["attention_mask"].view(len(batch), -1).sum(-1).tolist()]


def _order_v1(trainer, batch, out, cfg, metrics: dict):
    """V1, after veRL's ``_balance_batch``: the core's order when it balances better; returns the
    ``KVBatchMeta`` dispatched and the DP load metrics of it and of the survivors in arrival order."""
    from transfer_queue import KVBatchMeta

    dp = _v1_dp_size(trainer)
    order, extra = better_order([int(t["seq_len"]) for t in out.tags], dp, cfg)
    if order is not None:
        out = KVBatchMeta(keys=[out.keys[i] for i in order], tags=[out.tags[i] for i in order],
                          partition_id=out.partition_id, fields=out.fields, extra_info=out.extra_info)
    seq_len = {k: int(t["seq_len"]) for k, t in zip(out.keys, out.tags, strict=False)}
    arrival = [k for k in batch.keys if k in seq_len]  # survivors as pruned, then veRL's padding
    seen = set(arrival)
    arrival += [k for k in out.keys if k not in seen]
    metrics.update(extra)
    metrics.update(dp_load_metrics([seq_len[k] for k in out.keys], [seq_len[k] for k in arrival], dp))
    return out


def _order_legacy(trainer, batch, arrival_lens: list[int], keep_minibatch: bool, cfg, metrics: dict) -> None:
    """Legacy loop, after veRL's ``_balance_batch`` reordered ``batch`` in place: the core's order
    when it balances better (not under ``keep_minibatch``), and the DP load metrics."""
    dp = trainer._get_dp_size(trainer.actor_rollout_wg, "actor")
    order, extra = (None, {}) if keep_minibatch else better_order(_arrival_lens(batch), dp, cfg)
    if order is not None:
        batch.reorder(torch.tensor(order))
    metrics.update(extra)
    metrics.update(dp_load_metrics(_arrival_lens(batch), arrival_lens, dp))


def _pruning_balance_batch(original, prune_fn, v1: bool):
    @functools.wraps(original)
    def _balance_batch(self, batch, metrics, *args, **kwargs):
        run = settings_of(self)
        if not run.cppo:
            metrics.update(signal.kv_batch_signal(batch) if v1 else signal.dataproto_signal(batch))
            return original(self, batch, metrics, *args, **kwargs)
        warn_if_unprepared(self.config)
        before = len(batch)
        batch = prune_fn(self, batch, metrics)
        kept = len(batch)
        # veRL reorders a DataProto in place: the lengths in arrival order, before it
        arrival_lens = None if v1 else _arrival_lens(batch)
        out = original(self, batch, metrics, *args, **kwargs)
        if v1:
            metrics["cppo/padding_rows"] = float(len(out) - kept)
            out = final = _order_v1(self, batch, out, run.cfg, metrics)
        else:
            keep_minibatch = bool(kwargs.get("keep_minibatch", args[1] if len(args) > 1 else False))
            _order_legacy(self, batch, cast("list[int]", arrival_lens), keep_minibatch, run.cfg, metrics)
            final = batch
        metrics["cppo/rows_in"] = float(before)
        metrics["cppo/rows_out"] = float(len(final))
        return out if v1 else None

    return _balance_batch


_UNPREPARED_WARNED = False


def warn_if_unprepared(config) -> bool:
    """Warn once per process when the run skipped ``runconfig.prepare`` (veRL's own
    ``main_ppo`` with the plugin loaded): allocation was not applied. True when it warned."""
    global _UNPREPARED_WARNED
    if _UNPREPARED_WARNED or os.environ.get(PREPARED_ENV):
        return False
    _UNPREPARED_WARNED = True
    # a Ray worker's stderr (where warnings go) reaches the driver's console
    warnings.warn(unprepared_message(config), stacklevel=3)
    return True


def _patch_module(module) -> bool:
    cls = getattr(module, HOOK_TARGETS[module.__name__], None)
    if cls is None:
        raise RuntimeError(f"cppo: {module.__name__} has no {HOOK_TARGETS[module.__name__]}; veRL changed")
    if "_balance_batch" not in cls.__dict__:
        raise RuntimeError(f"cppo: {cls.__qualname__}._balance_batch is gone; veRL changed")
    v1 = module.__name__.endswith("trainer_base")
    make = functools.partial(_pruning_balance_batch, prune_fn=prune_kv_batch if v1 else prune_dataproto, v1=v1)
    return wrap(cls, "_balance_batch", make, tag=WRAP_TAG)


def install() -> list[str]:
    """Hook both loops: patch the modules already imported, patch the others as they are
    imported (``importhook``: Ray workers that never import a trainer pay nothing).
    Idempotent. Returns the modules patched now."""
    already = [name for name in HOOK_TARGETS if name in sys.modules and not is_installed(name)]
    for name in HOOK_TARGETS:
        after_import(name, _patch_module)
    return already


def is_installed(module_name: str) -> bool:
    """True when the class of ``module_name`` (a key of HOOK_TARGETS) carries the hook."""
    module = importlib.import_module(module_name)
    cls = getattr(module, HOOK_TARGETS[module_name])
    return is_wrapped(cls.__dict__.get("_balance_batch"), WRAP_TAG)


def uninstall() -> None:
    """Remove the hook (tests)."""
    importhook.remove(_patch_module)
    for name, clsname in HOOK_TARGETS.items():
        module = sys.modules.get(name)
        if module is None:
            continue
        unwrap(getattr(module, clsname), "_balance_batch", tag=WRAP_TAG)
