"""Audit mode: record what each OpenRLHF pass saw, so a run can be checked against the core.

``CPPO_OPENRLHF_AUDIT=DIR`` (exported to every Ray worker and vLLM process by the launcher)
makes each process append JSON lines to ``DIR/<role>-<pid>.jsonl``:

- ``filter`` (OpenRLHF's samples generator, with ``--algo.dynamic_filtering_enable``): one per
  generation call, every prompt it drew with its G scores and rewards and whether the filter
  passed it (``filtering.FilterLedger``);
- ``selective`` (OpenRLHF's samples generator, with ``cppo.selective.enabled``): one per generation
  call, every prompt index it drew for its step, which were skipped and which kept, with their skip
  probabilities and the rates (``selective.SelectiveDraw``);
- ``prune`` (the hook, in the trainer): every rollout sample of the step — its row id (its
  index in the rollout), prompt, reward — the core's selection and the survivors in the order
  passed on; each survivor carries its row id in ``info["cppo_row"]`` from here on; with the
  filter, the step's account (prompts drawn / filtered / passed, completions kept / pruned:
  ``filtering.StepAccount``) and the serials of its ``filter`` records; with selective rollout, the
  step's account (drawn = skipped + generated, each generated group's prompt index and outcome);
- ``train`` (``ActorPPOTrainer.training_step``, every actor rank, every micro-batch): the row
  ids that reached the loss, each row's advantage (mean over its action tokens), the largest
  difference between the rollout engine's log-probs and the actor's old-policy log-probs, and
  the loss;
- ``weights`` (``ActorPPOTrainer.ppo_train``, every actor rank): a fingerprint of the actor's
  parameters before and after the step's update (None under ZeRO-3, whose ranks hold shards);
- ``sync_actor`` (``ActorPPOTrainer.broadcast_to_vllm``, rank 0; not under ZeRO-3) and ``sync_engine`` (the vLLM
  worker, after reloading): a hash of every tensor sent / received, and for the engine the
  largest difference between its parameters that vLLM keeps readable (embedding, norms,
  biases) and the tensors received;
- ``actor_worker`` (``ActorPPOTrainer.__init__``, every actor rank): the rank's pid and Ray actor
  id (the dead-worker tests kill a rank by it);
- ``checkpoint`` (``DeepspeedStrategy.save_ckpt`` / ``load_ckpt``, every actor rank): the tag and a
  fingerprint of the rank's optimizer state after saving / loading (sum of |moments|, steps, lr).

Steps count as OpenRLHF's global step, also in a run resumed from a checkpoint
(``checkpoint.resumed_step``). Records are single appends; a reader skips a line cut short by a
kill (``integrations/records.py``). Off (the default) nothing is installed. It reads; it never changes what trains.
"""

from __future__ import annotations

import functools
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from ...importhook import after_import
from ...records import append as _append
from ...records import optimizer_fingerprint, read, tensor_hash
from ...wrap import wrap
from .. import observers
from ..checkpoint import resumed_step
from . import AUDIT_ENV as ENV

__all__ = ["ENV", "ROW_KEY", "enabled", "install", "observe", "prune_record", "read", "record", "tensor_hash"]

ROW_KEY = "cppo_row"
ACTOR_MODULE = "openrlhf.trainer.ray.ppo_actor"
STRATEGY_MODULE = "openrlhf.utils.deepspeed.deepspeed"
WRAP_TAG = __name__  # marks our layers on OpenRLHF's methods (integrations/wrap.py)


def enabled() -> bool:
    return bool(os.environ.get(ENV))


def record(kind: str, role: str, **fields: Any) -> None:
    """Append one record to this process's audit file (no-op when audit mode is off)."""
    root = os.environ.get(ENV)
    if not root:
        return
    Path(root).mkdir(parents=True, exist_ok=True)
    line = json.dumps({"kind": kind, "time": time.time(), "pid": os.getpid(), **fields}, default=_jsonable)
    _append(Path(root) / f"{role}-{os.getpid()}.jsonl", line)


def _jsonable(x):
    if isinstance(x, torch.Tensor):
        return x.tolist()
    return str(x)


def _fingerprint(model) -> float:
    return float(sum(p.detach().float().abs().sum().item() for p in model.parameters()))


# ------------------------------------------------------------------------------ trainer side (the seam)
def prune_record(d: observers.PruneDecision) -> None:
    """The ``prune`` record of one step (an observer of the seam's decision, ``observers.HUB.on_prune``).
    Each sample gets its row id (its index in the rollout) in ``info["cppo_row"]``, which the
    survivors carry on to the actors' ``train`` records. With DAPO's filter, ``account`` is the
    step's ``filtering.StepAccount`` record and ``ledgers`` the serials of the ``filter`` records
    whose passed groups this rollout is. With selective rollout, ``selective`` is the step's
    account (prompts drawn / skipped / generated, each group's prompt index and outcome, the
    serials of its ``selective`` records)."""
    for i, sample in enumerate(d.samples):
        sample.info[ROW_KEY] = torch.tensor([float(i)])
    record("prune", "trainer", step=d.step, rows=list(range(len(d.samples))), prompts=[s.prompts[0] for s in d.samples],
           rewards=d.rewards.tolist(), group_ids=d.group_ids.tolist(), selected=d.result.selection.kept.tolist(),
           survivors=d.survivors, account=None if d.account is None else d.account.to_record(), ledgers=d.ledgers,
           selective=d.selective)


# ------------------------------------------------------------------------------ actor side
def _masked_row_means(values: torch.Tensor, mask: torch.Tensor) -> list[float]:
    m = mask.float()
    return ((values.float() * m).sum(-1) / m.sum(-1).clamp(min=1)).tolist()


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _wrap_training_step(original):
    @functools.wraps(original)
    def training_step(self, experience, kl_ctl, step, loss_batch_info=None):
        rows = experience.info.get(ROW_KEY)
        mask = experience.action_mask
        rollout_diff = None
        if experience.rollout_log_probs is not None and experience.action_log_probs is not None:
            diff = (experience.rollout_log_probs.float() - experience.action_log_probs.float()).abs() * mask.float()
            rollout_diff = float(diff.max())
        status = original(self, experience, kl_ctl, step, loss_batch_info)
        metrics = status.get("metrics", {}) if isinstance(status, dict) else {}
        loss = metrics.get("policy_loss")
        record("train", f"actor{_rank()}", step=int(getattr(self, "_cppo_audit_step", 0)), rank=_rank(),
               rows=[int(r) for r in torch.as_tensor(rows).reshape(-1).tolist()] if rows is not None else None,
               advantages=_masked_row_means(experience.advantages, mask),
               rollout_vs_old_max_abs=rollout_diff,
               policy_loss=float(loss.float().mean()) if isinstance(loss, torch.Tensor) else loss)
        return status

    return training_step


def _wrap_ppo_train(original):
    @functools.wraps(original)
    def ppo_train(self, kl_ctl):
        if not hasattr(self, "_cppo_audit_step"):  # a resumed run continues OpenRLHF's count
            self._cppo_audit_step = resumed_step(self.args)
        self._cppo_audit_step += 1
        model = self.actor.model
        # ZeRO-3 partitions the parameters: a rank's module holds placeholders, not weights
        sharded = self.args.ds.zero_stage == 3
        before = None if sharded else _fingerprint(model)
        out = original(self, kl_ctl)
        record("weights", f"actor{_rank()}", step=self._cppo_audit_step, rank=_rank(), before=before,
               after=None if sharded else _fingerprint(model))
        return out

    return ppo_train


def _wrap_broadcast(original):
    @functools.wraps(original)
    def broadcast_to_vllm(self):
        out = original(self)
        if _rank() == 0 and self.args.ds.zero_stage != 3:
            model = self.actor.model.module
            hashes = {n: tensor_hash(p.data) for n, p in model.named_parameters()}
            # at a resume OpenRLHF broadcasts the loaded weights before its first step (ppo_trainer.py:515)
            step = getattr(self, "_cppo_audit_step", None)
            record("sync_actor", "actor0", step=resumed_step(self.args) if step is None else int(step), hashes=hashes)
        return out

    return broadcast_to_vllm


def _wrap_init(original):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        actor_id = name = None
        try:
            import ray

            ctx = ray.get_runtime_context()
            actor_id, name = ctx.get_actor_id(), ctx.get_actor_name()
        except Exception:  # noqa: BLE001 - outside Ray (tests) there is no actor
            pass
        record("actor_worker", f"actor{_rank()}", rank=_rank(), actor_id=actor_id, actor_name=name)

    return __init__


def _patch_actor(module) -> None:
    cls = module.ActorPPOTrainer
    for name, make in (("__init__", _wrap_init), ("training_step", _wrap_training_step),
                       ("ppo_train", _wrap_ppo_train), ("broadcast_to_vllm", _wrap_broadcast)):
        wrap(cls, name, make, tag=WRAP_TAG)


# ------------------------------------------------------------------------------ engine side
def record_engine_sync(worker, weights: dict[str, torch.Tensor]) -> None:
    """Called by the CPU vLLM worker after reloading a full sync (audit mode only)."""
    if not enabled():
        return
    model = worker.model_runner.get_model() if hasattr(worker.model_runner, "get_model") else worker.model_runner.model
    compared, max_diff = [], 0.0
    for name, p in model.named_parameters():
        w = weights.get(name)
        if w is None or p.numel() == 0 or p.dim() != w.dim() or p.shape[1:] != w.shape[1:] or p.shape[0] < w.shape[0]:
            continue  # repacked (CPU linear layers), fused (qkv, gate_up) or absent
        held = p.detach()[: w.shape[0]].float()
        max_diff = max(max_diff, float((held - w.float()).abs().max()))
        compared.append(name)
    record("sync_engine", "engine", hashes={n: tensor_hash(t) for n, t in weights.items()}, compared=compared,
           max_abs_diff=max_diff)


# ------------------------------------------------------------------------------ checkpoints (every actor rank)
def _tag_of(path) -> str | None:
    """The checkpoint tag (``global_step1``): save_ckpt is given it; load_ckpt returns DeepSpeed's
    ``load_path``, the loaded model-states file (``.../global_step1/mp_rank_00_model_states.pt``)."""
    if path is None:
        return None
    p = Path(str(path))
    return p.parent.name if p.suffix == ".pt" else p.name


def _wrap_ckpt(op: str, original):
    @functools.wraps(original)
    def method(self, model, directory, *args, **kwargs):
        out = original(self, model, directory, *args, **kwargs)
        tag = out[0] if op == "load" and isinstance(out, tuple) else kwargs.get("tag", args[0] if args else None)
        record("checkpoint", f"actor{_rank()}", op=op, rank=_rank(), dir=str(directory), tag=_tag_of(tag),
               optimizer=optimizer_fingerprint(getattr(model, "optimizer", None)))
        return out

    return method


def _patch_strategy(module) -> None:
    cls = module.DeepspeedStrategy
    for name, op in (("save_ckpt", "save"), ("load_ckpt", "load")):
        wrap(cls, name, functools.partial(_wrap_ckpt, op), tag=WRAP_TAG)


def observe() -> None:
    """Subscribe the audit to the GPU path's observers: the seam's decision and the features'
    named records (idempotent)."""
    observers.HUB.on_prune(prune_record)
    observers.HUB.on_record(record)


def install() -> bool:
    """Subscribe to the seam and install the actor-side recorders when ``CPPO_OPENRLHF_AUDIT`` is
    set; returns whether."""
    if not enabled():
        return False
    observe()
    after_import(ACTOR_MODULE, _patch_actor)
    after_import(STRATEGY_MODULE, _patch_strategy)
    return True
