"""Audit mode: record what each veRL pass saw, so a run can be checked against the core.

``CPPO_VERL_AUDIT=DIR`` (exported to every Ray process by ``cppo-megatron verl``) makes the
plugin append JSON lines to ``DIR/<role>-<pid>.jsonl``:

- ``prune`` (the pruning hook): every row of the step — its id (V1: TransferQueue key;
  legacy loop: ``cppo_row``, the row's index in the batch that reached the seam), ``uid`` and
  reward — and which rows the core kept;
- ``old_log_prob`` (``_compute_old_log_prob``): the row ids, padding flags and sequence lengths
  that entered the old-policy pass, in the order veRL dispatches them to its DP ranks;
- ``update`` (``_update_actor``): the row ids with their uid, reward and advantage (mean over
  the response tokens; GRPO-type advantages are constant along a response) as the update read
  them;
- ``placement`` (each Megatron engine rank, once built): its global, TP, PP and DP ranks and the
  Ray node it runs on;
- ``sync`` (the ``hf`` rollout adapter, leader rank): after each weight sync, the largest
  difference between the server's weights and the actor's tensors it was sent, and a
  fingerprint (sum of |w|) of those tensors, in all and per tensor name, and each tensor's sha1;
  with veRL's vLLM rollout, ``sync`` (what the adapter sent) and ``served`` (what vLLM serves
  after the sync, compared by value) come from ``audit_vllm``;
- ``prune`` also names each row's prompt by its dataset row (``prompts``: veRL's ``index``; V1),
  which identifies a prompt across runs where the ``uid`` (a fresh uuid4 per draw) does not;
- ``worker`` (``ActorRolloutRefWorker.__init__``, every worker process): its pid, rank and Ray
  actor name (the dead-worker tests kill a rank by it);
- ``draw``, ``evict``, ``clear`` (V1, ``dapo.py``): every prompt submitted for generation (the
  step's batch and each refill of DAPO's filter), the groups the filter drops with their rewards,
  and every group the replay buffer clears unsampled (evicted or surplus);
- ``selective`` (V1 with ``cppo.selective.enabled``, ``selective.py``, once a step at the CPPO seam):
  every candidate the hook drew, in draw order, with its skip decision and why (streak, kind of
  its last group, skip probability, the rates and seed used), and the groups it filed in the
  history with their outcome;
- ``checkpoint`` (``ActorRolloutRefWorker.save_checkpoint`` / ``load_checkpoint``, every rank): the
  folder and a fingerprint of the rank's optimizer state after saving / loading (sum of
  |moments|, Adam steps, learning rates).

Records are single appends; a reader skips a line cut short by a kill (``integrations/records.py``).
Off (the default) it installs nothing. It reads the batch; it never changes what trains.
"""

from __future__ import annotations

import functools
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...importhook import after_import
from ...records import append as _append
from ...records import optimizer_fingerprint, read
from ...wrap import wrap, wrap_methods
from .. import observers
from ..dapo import REPLAY_BUFFER, REWARD_METRIC, metric_values, recorders
from . import AUDIT_ENV, CHANGED

__all__ = ["ENV", "enabled", "install", "observe", "prune_record", "read", "record"]

ENV = AUDIT_ENV
WRAP_TAG = __name__  # marks our layers on veRL's methods (integrations/wrap.py)
V1 = ("verl.trainer.ppo.v1.trainer_base", "PPOTrainer")
LEGACY = ("verl.trainer.ppo.ray_trainer", "RayPPOTrainer")
WORKER = ("verl.workers.engine_workers", "ActorRolloutRefWorker")


def enabled() -> bool:
    return bool(os.environ.get(ENV))


def record(kind: str, role: str = "trainer", **fields: Any) -> None:
    """Append one record to this process's audit file (no-op when audit mode is off)."""
    root = os.environ.get(ENV)
    if not root:
        return
    Path(root).mkdir(parents=True, exist_ok=True)
    line = json.dumps({"kind": kind, "time": time.time(), **fields}, default=_jsonable)
    _append(Path(root) / f"{role}-{os.getpid()}.jsonl", line)


def _jsonable(x):
    if isinstance(x, (np.generic,)):
        return x.item()
    if isinstance(x, (np.ndarray, torch.Tensor)):
        return x.tolist()
    return str(x)


def _row_means(values, mask) -> list[float]:
    """[N] masked means of [N, T] (or jagged) per-token values."""
    if getattr(values, "is_nested", False):
        values = values.to_padded_tensor(0.0)
    if getattr(mask, "is_nested", False):
        mask = mask.to_padded_tensor(0)
    v, m = torch.as_tensor(values).float(), torch.as_tensor(mask).float()
    return ((v * m).sum(-1) / m.sum(-1).clamp(min=1)).tolist()


def _row_sums(values) -> list[float]:
    if getattr(values, "is_nested", False):
        values = values.to_padded_tensor(0.0)
    t = torch.as_tensor(values).float()
    return (t.sum(-1) if t.dim() > 1 else t).tolist()


# ------------------------------------------------------------------------------ V1 (TransferQueue)
def v1_prompt_ids(keys: list, batch) -> list | None:
    """The dataset row (veRL's ``index``, from ``extra_info.index``) each V1 row's prompt came
    from: what identifies a prompt across runs (``uid`` is a fresh uuid4 per draw)."""
    import transfer_queue as tq

    try:
        data = tq.kv_batch_get(keys=list(keys), partition_id=batch.partition_id, select_fields=["index"])
    except Exception as exc:  # noqa: BLE001 - the audit must not stop a run
        return [f"unavailable: {exc}"[:200]]
    return [_jsonable(x) if not isinstance(x, (int, str)) else x for x in list(data["index"])]


def _v1_rows(batch) -> tuple[list[str], list[bool]]:
    return [str(k) for k in batch.keys], [bool(t.get("is_padding", False)) for t in batch.tags]


def _v1_old_log_prob(original):
    @functools.wraps(original)
    def _compute_old_log_prob(self, batch, *args, **kwargs):
        rows, pad = _v1_rows(batch)
        record("old_log_prob", step=int(self.global_steps), loop="v1", rows=rows, padding=pad,
               seq_lens=[int(t["seq_len"]) for t in batch.tags])
        return original(self, batch, *args, **kwargs)

    return _compute_old_log_prob


def _v1_update(original):
    @functools.wraps(original)
    def _update_actor(self, batch, *args, **kwargs):
        import transfer_queue as tq

        rows, pad = _v1_rows(batch)
        real = [k for k, p in zip(batch.keys, pad, strict=False) if not p]
        data = tq.kv_batch_get(keys=real, partition_id=batch.partition_id,
                               select_fields=["uid", "rm_scores", "advantages", "response_mask"])
        record("update", step=int(self.global_steps), loop="v1", rows=[str(k) for k in real],
               uids=[str(u) for u in list(data["uid"])], rewards=_row_sums(data["rm_scores"]),
               advantages=_row_means(data["advantages"], data["response_mask"]), padding_rows=sum(pad))
        return original(self, batch, *args, **kwargs)

    return _update_actor


# ------------------------------------------------------------------------------ legacy (DataProto)
def _legacy_rows(batch) -> tuple[list[int], list[bool]]:
    nt = batch.non_tensor_batch
    n = len(batch)
    rows = [int(r) for r in nt["cppo_row"]] if "cppo_row" in nt else list(range(n))
    pad = [bool(p) for p in nt["cppo_is_padding"]] if "cppo_is_padding" in nt else [False] * n
    return rows, pad


def _legacy_old_log_prob(original):
    @functools.wraps(original)
    def _compute_old_log_prob(self, batch, *args, **kwargs):
        rows, pad = _legacy_rows(batch)
        record("old_log_prob", step=int(self.global_steps), loop="legacy", rows=rows, padding=pad,
               uids=[str(u) for u in batch.non_tensor_batch["uid"]],
               seq_lens=[int(x) for x in batch.batch["attention_mask"].view(len(batch), -1).sum(-1).tolist()])
        return original(self, batch, *args, **kwargs)

    return _compute_old_log_prob


def _legacy_update(original):
    @functools.wraps(original)
    def _update_actor(self, batch, *args, **kwargs):
        rows, pad = _legacy_rows(batch)
        keep = [i for i, p in enumerate(pad) if not p]
        uids = [str(batch.non_tensor_batch["uid"][i]) for i in keep]
        scores = (batch.batch["token_level_scores"] if "token_level_scores" in batch.batch.keys()
                  else batch.batch["rm_scores"])
        mask = batch.batch["response_mask"]
        adv = _row_means(batch.batch["advantages"], mask)
        rew = _row_sums(scores)
        record("update", step=int(self.global_steps), loop="legacy", rows=[rows[i] for i in keep], uids=uids,
               rewards=[rew[i] for i in keep], advantages=[adv[i] for i in keep], padding_rows=len(pad) - len(keep))
        return original(self, batch, *args, **kwargs)

    return _update_actor


# ------------------------------------------------------------------------------ worker processes
def _worker_init(original):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        name = None
        try:
            import ray

            name = ray.get_runtime_context().get_actor_name()
        except Exception:  # noqa: BLE001 - outside Ray (tests) there is no actor name
            pass
        record("worker", role="worker", pid=os.getpid(), rank=int(os.environ.get("RANK", -1)),
               world_size=int(os.environ.get("WORLD_SIZE", -1)), actor_name=name,
               worker_role=getattr(self, "role", None))

    return __init__


def _worker_checkpoint(op: str):
    def make(original):
        @functools.wraps(original)
        def method(self, local_path, *args, **kwargs):
            out = original(self, local_path, *args, **kwargs)
            engine = getattr(getattr(self, "actor", None), "engine", None)
            record("checkpoint", role="worker", op=op, path=str(local_path), pid=os.getpid(),
                   rank=int(os.environ.get("RANK", -1)),
                   optimizer=optimizer_fingerprint(getattr(engine, "optimizer", None)))
            return out

        return method

    return make


_DAPO = recorders(record)
_WRAPPERS = {
    # V1: the passes, and (dapo.py) every prompt drawn and every group the replay buffer drops
    V1: {"_compute_old_log_prob": _v1_old_log_prob, "_update_actor": _v1_update, **_DAPO[V1]},
    REPLAY_BUFFER: _DAPO[REPLAY_BUFFER],
    LEGACY: {"_compute_old_log_prob": _legacy_old_log_prob, "_update_actor": _legacy_update},
    WORKER: {"__init__": _worker_init, "save_checkpoint": _worker_checkpoint("save"),
             "load_checkpoint": _worker_checkpoint("load")},
}


def _patch(module) -> None:
    for target, wrappers in _WRAPPERS.items():
        if module.__name__ == target[0]:
            wrap_methods(module, target, wrappers, tag=WRAP_TAG, changed=CHANGED, who="cppo audit")


MEGATRON_ENGINE = ("verl.workers.engine.megatron.transformer_impl", "MegatronEngine")


def placement() -> dict:
    """Where this Megatron rank runs: global and TP/PP/DP ranks, Ray node id, host, pid."""
    import socket

    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    node = None
    try:
        import ray

        if ray.is_initialized():
            node = ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - outside Ray: no node id
        node = None
    return {"rank": dist.get_rank() if dist.is_initialized() else 0, "tp_rank": mpu.get_tensor_model_parallel_rank(),
            "pp_rank": mpu.get_pipeline_model_parallel_rank(), "dp_rank": mpu.get_data_parallel_rank(),
            "node": node, "host": socket.gethostname(), "pid": os.getpid()}


def _placement_recorder(fn):
    @functools.wraps(fn)
    def initialize(self, *args, **kwargs):
        out = fn(self, *args, **kwargs)
        record("placement", role="megatron", **placement())
        return out

    return initialize


def _record_placement(module) -> None:
    import inspect

    # the engine classes veRL builds (the CPU mode may have given each its own wrapper already)
    for name in (MEGATRON_ENGINE[1], "MegatronEngineWithLMHead", "MegatronEngineWithValueHead"):
        cls = getattr(module, name, None)
        if cls is None or inspect.getattr_static(cls, "initialize", None) is None:
            continue
        # once per class: a subclass that inherits a recorded initialize (or the CPU mode's
        # wrapper over it) is seen through
        wrap(cls, "initialize", _placement_recorder, tag=WRAP_TAG)


def prune_record(d: observers.PruneDecision) -> None:
    """The ``prune`` record of one step (an observer of the seam's decision, ``observers.HUB.on_prune``).
    Legacy loop: each row's index at the seam goes on the batch (``cppo_row``), the row identity
    the later passes' records name."""
    kept = d.result.selection.kept.tolist()
    if d.loop == "legacy":
        d.batch.non_tensor_batch["cppo_row"] = np.arange(len(d.uids), dtype=np.int64)
        record("prune", step=d.step, loop="legacy", rows=list(range(len(d.uids))), uids=d.uids,
               rewards=d.rewards.tolist(), kept=kept)
        return
    keys = list(d.keys or [])
    record("prune", step=d.step, loop="v1", rows=[str(k) for k in keys], uids=d.uids, rewards=d.rewards.tolist(),
           kept=kept, prompts=v1_prompt_ids(keys, d.batch), fields=list(d.batch.fields or []),
           **_filter_record(d.filter_metric, keys, d.batch.partition_id, d.equal_groups))


def _filter_record(metric: str | None, keys: list[str], partition_id: str, equal: list[str]) -> dict:
    """DAPO's filter at the seam: its metric, the groups it passed with all rewards equal and, under
    another metric than reward, each row's metric value (read from TransferQueue), so that
    ``dapo.account_step`` checks the filter's verdicts on what it filtered by."""
    if metric is None:
        return {}
    out: dict = {"filter_metric": metric, "filter_passed_zero_variance": equal}
    if metric != REWARD_METRIC:
        import transfer_queue as tq

        data = tq.kv_batch_get(keys=keys, partition_id=partition_id, select_fields=["extra_fields"])
        out["filter_values"] = metric_values(list(data["extra_fields"]), metric)
    return out


def observe() -> None:
    """Subscribe the audit to the GPU path's observers: the seam's decision and the features'
    named records (idempotent)."""
    observers.HUB.on_prune(prune_record)
    observers.HUB.on_record(record)


def install() -> bool:
    """Install the trainer-side recorders when ``CPPO_VERL_AUDIT`` is set; returns whether."""
    if not enabled():
        return False
    observe()
    for mod_name, _ in _WRAPPERS:
        after_import(mod_name, _patch)
    after_import(MEGATRON_ENGINE[0], _record_placement)  # each Megatron rank: where it runs
    return True
