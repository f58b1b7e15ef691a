"""The ``signal/*`` step metrics inside veRL (``core.signal``; the embedded trainer and the
OpenRLHF hook log the same keys).

- at ``_balance_batch`` (the hook's seam, where every reward is on the batch and nothing has been
  pruned): ``signal/zero_variance_share``, ``all_correct_share``, ``all_wrong_share``, ``groups``,
  ``completions``, ``mean_length`` and ``generated_tokens`` over the rows of the step (with the
  ``cppo`` estimator from the data the pruning reads anyway; with any other estimator from the
  batch: the legacy ``DataProto`` in memory, or one TransferQueue read in V1). A group is all
  correct when its rewards are equal and ``>= 1.0`` (the tasks' correct reward). With veRL's DAPO
  filter on, the rows reaching the seam are the groups that passed it (the dropped ones are in
  ``training/filter_groups/*``);
- ``signal/gen_share``: ``timing_s/gen / timing_s/step``, added where veRL computes its timing
  metrics (``compute_timing_metrics``, as both loops call it: ``ray_trainer.py:1783``,
  ``v1/trainer_base.py:1945``).
"""

from __future__ import annotations

import functools

import torch

from ...core.signal import gen_share, signal_metrics
from ..importhook import after_import, remove
from ..wrap import unwrap, wrap

__all__ = ["TIMING_MODULES", "batch_signal", "dataproto_signal", "install", "kv_batch_signal", "row_rewards",
           "row_tokens", "uninstall"]

# modules that call compute_timing_metrics by the name they imported
TIMING_MODULES = ("verl.trainer.ppo.ray_trainer", "verl.trainer.ppo.v1.trainer_base")
WRAP_TAG = __name__


def row_rewards(rm_scores) -> torch.Tensor:
    """[N] per-row sums of ``rm_scores`` (a jagged nested tensor in TransferQueue, or [N, T])."""
    if getattr(rm_scores, "is_nested", False):
        return rm_scores.to_padded_tensor(0.0).sum(dim=-1)
    t = torch.as_tensor(rm_scores)
    return t.sum(dim=-1) if t.dim() > 1 else t


def row_tokens(response_mask) -> torch.Tensor:
    """[N] int64 tokens generated per row: ``response_mask`` summed per row (a jagged nested tensor in
    TransferQueue, or [N, T]); a tool's tokens inside a multi-turn response are masked out."""
    if getattr(response_mask, "is_nested", False):
        return response_mask.to_padded_tensor(0).sum(dim=-1).to(torch.int64)
    t = torch.as_tensor(response_mask)
    return (t.sum(dim=-1) if t.dim() > 1 else t).to(torch.int64)


def batch_signal(uids: list, rewards: torch.Tensor, lengths: torch.Tensor | None) -> dict[str, float]:
    """``signal/*`` of one step's rows: ``uids`` [N] (veRL's prompt ``uid``, a group each),
    ``rewards`` [N] float (``rm_scores`` summed per row), ``lengths`` [N] int64 tokens generated."""
    first: dict[str, int] = {}
    gids = torch.tensor([first.setdefault(str(u), len(first)) for u in uids], dtype=torch.int64)
    return signal_metrics(rewards, gids, lengths=lengths)


def dataproto_signal(batch) -> dict[str, float]:
    """Legacy loop: ``signal/*`` of a ``DataProto`` with ``uid``, ``rm_scores`` and ``response_mask``
    (rows veRL padded in are left out); {} when the batch lacks them."""
    tensors, extra = batch.batch, batch.non_tensor_batch
    if tensors is None or "rm_scores" not in tensors.keys() or "uid" not in extra:
        return {}
    keep = [i for i in range(len(batch)) if not bool(extra.get("cppo_is_padding", [False] * len(batch))[i])]
    uids = [str(extra["uid"][i]) for i in keep]
    rewards = row_rewards(tensors["rm_scores"])[keep]
    lengths = row_tokens(tensors["response_mask"])[keep] if "response_mask" in tensors.keys() else None
    return batch_signal(uids, rewards.to(torch.float32), lengths)


def kv_batch_signal(batch) -> dict[str, float]:
    """V1: ``signal/*`` of a ``KVBatchMeta`` (its real rows, not veRL's ``is_padding`` ones), read from
    TransferQueue."""
    import transfer_queue as tq

    keys = [k for k, tag in zip(batch.keys, batch.tags, strict=True) if not bool(tag.get("is_padding", False))]
    if not keys:
        return {}
    data = tq.kv_batch_get(keys=keys, partition_id=batch.partition_id,
                           select_fields=["uid", "rm_scores", "response_mask"])
    return batch_signal([str(u) for u in list(data["uid"])], row_rewards(data["rm_scores"]).to(torch.float32),
                        row_tokens(data["response_mask"]))


def _with_gen_share(original):
    @functools.wraps(original)
    def compute_timing_metrics(batch, timing_raw):
        out = original(batch, timing_raw)
        if "gen" in timing_raw and "step" in timing_raw:
            out.update(gen_share(float(timing_raw["gen"]), float(timing_raw["step"])))
        return out

    return compute_timing_metrics


def _patch(module) -> None:
    if not hasattr(module, "compute_timing_metrics"):
        raise RuntimeError(f"cppo: {module.__name__} no longer imports compute_timing_metrics; veRL changed")
    wrap(module, "compute_timing_metrics", _with_gen_share, tag=WRAP_TAG)


def install() -> None:
    """``signal/gen_share`` in both loops' timing metrics, as their modules are imported (idempotent)."""
    for name in TIMING_MODULES:
        after_import(name, _patch)


def uninstall() -> None:
    """Remove the timing wrapper (tests)."""
    import sys

    remove(_patch)
    for name in TIMING_MODULES:
        module = sys.modules.get(name)
        if module is not None:
            unwrap(module, "compute_timing_metrics", tag=WRAP_TAG)
