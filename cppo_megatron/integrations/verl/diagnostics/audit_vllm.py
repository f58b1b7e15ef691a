"""Audit of veRL's vLLM weight sync: the weights vLLM serves after each sync, compared by value
with the tensors the actor sent (audit mode, ``CPPO_VERL_AUDIT``; any platform).

Two records per sync, joined by order within a replica (each replica's syncs are sequential):

- ``sync`` (``ServerAdapter.update_weights``, ``workers/rollout/vllm_rollout/vllm_rollout.py:210``,
  each trainer rank that holds an adapter): ``global_steps``, the sha1 and sum of |w| of every
  tensor handed to veRL's sender, and their total (``fingerprint``);
- ``served`` (``vLLMColocateWorkerExtension.update_weights_from_ipc``,
  ``workers/rollout/vllm_rollout/utils.py:248``, inside the vLLM worker process): the sha1 of every
  tensor the worker received (``_update_weights``, ``utils.py:367``, copied out of the reused
  bucket), then, once veRL has run ``process_weights_after_loading`` (``utils.py:353``), the
  largest |served - received| over all tensors, the names vLLM has no parameter for
  (``missing``), and the names whose served shape cannot hold the received tensor (``mismatched``).

Which served parameter holds a received tensor: the one of the same name, else the fused one
of vLLM's ``packed_modules_mapping`` (``q_proj``/``k_proj``/``v_proj`` -> ``qkv_proj``,
``gate_proj``/``up_proj`` -> ``gate_up_proj``), the shards stacked along dim 0 in the mapping's
order; a vocabulary padded to a multiple is compared on its first rows; a tied ``lm_head``
resolves to the embedding it shares. The received tensor is cast to the served dtype first (bf16
serving of an fp32 actor compares the rounding vLLM itself applies).

Under vLLM tensor parallelism (size > 1) each worker serves a shard, laid out by vLLM's own
rules (column/row parallel, vocabulary parallel, GQA heads replicated when there are fewer KV
heads than ranks). There ``sharded_difference`` asks vLLM's own ``weight_loader`` of each
parameter where this rank's shard of the received tensor goes (loaded into the parameter
filled with NaN, read back, then the served values restored) and compares the served values
there; the record says ``method: "weight_loader"``. That check trusts vLLM's loaders for the
layout; the TP 1 check does not use them.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from ...importhook import after_import
from ...records import tensor_hash
from ...wrap import wrap_methods
from . import CHANGED
from .audit import enabled, record

__all__ = ["ADAPTER", "EXTENSION", "install", "served_difference", "served_parameter", "sharded_difference"]

ADAPTER = ("verl.workers.rollout.vllm_rollout.vllm_rollout", "ServerAdapter")
EXTENSION = ("verl.workers.rollout.vllm_rollout.utils", "vLLMColocateWorkerExtension")
WRAP_TAG = __name__


def _sum_abs(t: torch.Tensor) -> float:
    return float(t.detach().double().abs().sum())


# ------------------------------------------------------------------------------ trainer side
def _keep(sent: dict[str, torch.Tensor | None], name: str, tensor) -> None:
    # a DTensor is the sender's to gather (a collective); plain tensors are hashed here
    sent[name] = None if hasattr(tensor, "full_tensor") else tensor.detach().to("cpu", copy=True)


def _teed(weights, sent: dict[str, torch.Tensor | None]):
    """``weights`` passed through, each tensor kept in ``sent``: a generator for a generator, an async
    generator for an async one (a checkpoint engine's ``receive_weights``, separate_async)."""
    if hasattr(weights, "__aiter__"):
        async def ateed():
            async for name, tensor in weights:
                _keep(sent, name, tensor)
                yield name, tensor

        return ateed()

    def teed():
        for name, tensor in weights:
            _keep(sent, name, tensor)
            yield name, tensor

    return teed()


def _adapter_update(original):
    @functools.wraps(original)
    async def update_weights(self, weights, global_steps: int | None = None, *args, **kwargs):
        sent: dict[str, torch.Tensor | None] = {}
        out = await original(self, _teed(weights, sent), global_steps, *args, **kwargs)
        plain = {k: v for k, v in sent.items() if v is not None}
        sums = {k: _sum_abs(v) for k, v in plain.items()}
        record("sync", role="vllm-adapter", source="vllm-adapter", global_steps=global_steps,
               replica_rank=getattr(self, "replica_rank", None),
               rollout_rank=getattr(self, "rollout_rank", None), rank=int(os.environ.get("RANK", -1)),
               num_tensors=len(sent), not_hashed=sorted(set(sent) - set(plain)), fingerprint=sum(sums.values()),
               sums=sums, hashes={k: tensor_hash(v) for k, v in plain.items()})
        return out

    return update_weights


# ------------------------------------------------------------------------------ vLLM worker side
def served_parameter(model: torch.nn.Module, name: str, sizes: dict[str, int]) -> tuple[torch.Tensor, str] | None:
    """The slice of ``model``'s served parameter that holds the HF tensor ``name``, and the served
    name; None when vLLM has no parameter for it.

    Args:
        model: the vLLM model (``model_runner.model``).
        name: an HF parameter name, e.g. ``model.layers.0.self_attn.k_proj.weight``.
        sizes: dim-0 size of every received HF tensor by name (a fused parameter's shard offset
            is the sum of the sizes of the shards before it in ``packed_modules_mapping``).
    """
    def lookup(n: str) -> torch.Tensor | None:
        try:
            return model.get_parameter(n)
        except AttributeError:
            return None

    direct = lookup(name)
    if direct is not None:
        return direct, name
    module, _, leaf = name.rpartition(".")
    parent, _, proj = module.rpartition(".")
    for fused, shards in (getattr(model, "packed_modules_mapping", None) or {}).items():
        if proj not in shards:
            continue
        served_name = f"{parent}.{fused}.{leaf}"
        param = lookup(served_name)
        if param is None:
            continue
        start = 0
        for shard in shards[: shards.index(proj)]:
            size = sizes.get(f"{parent}.{shard}.{leaf}")
            if size is None:
                return None  # a fused parameter whose other shards were not sent: no offset
            start += size
        return param[start: start + sizes[name]], served_name
    return None


def served_difference(model: torch.nn.Module, received: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Largest |served - received| over ``received`` (each cast to the served dtype), with the
    names vLLM has no parameter for and those whose served shape cannot hold the tensor."""
    if not received:
        raise ValueError("served_difference: no received tensors (the sync delivered nothing)")
    sizes = {k: int(v.shape[0]) if v.dim() else 1 for k, v in received.items()}
    missing, mismatched, diff = [], [], 0.0
    with torch.no_grad():
        for name, want in received.items():
            found = served_parameter(model, name, sizes)
            if found is None:
                missing.append(name)
                continue
            have, served_name = found
            have = have.detach()
            if have.dim() != want.dim() or have.shape[1:] != want.shape[1:] or (
                    want.dim() and have.shape[0] < want.shape[0]):
                mismatched.append(f"{name} -> {served_name} {tuple(have.shape)} for {tuple(want.shape)}")
                continue
            if want.dim():
                have = have[: want.shape[0]]  # a padded vocabulary: its first rows
            delta = (have.cpu().double() - want.to(have.dtype).double()).abs()
            diff = max(diff, float(delta.max()) if delta.numel() else 0.0)
    return {"max_abs_diff": diff, "missing": sorted(missing), "mismatched": sorted(mismatched)}


def _fused_target(model: torch.nn.Module, name: str) -> tuple[str, Any] | None:
    """(served parameter name, loader shard id) of an HF tensor that vLLM keeps inside a fused
    parameter (``packed_modules_mapping``): ``q``/``k``/``v`` for a QKV projection, the shard's
    index otherwise (vLLM's own ``stacked_params_mapping`` convention); None when not fused."""
    module, _, leaf = name.rpartition(".")
    parent, _, proj = module.rpartition(".")
    for fused, shards in (getattr(model, "packed_modules_mapping", None) or {}).items():
        if proj in shards:
            shard_id: Any = proj[0] if fused == "qkv_proj" else shards.index(proj)
            return f"{parent}.{fused}.{leaf}", shard_id
    return None


def sharded_difference(model: torch.nn.Module, received: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Largest |served - expected| on this vLLM rank, where expected is what vLLM's own
    ``weight_loader`` puts in the served parameter from each received (full) tensor.

    Each loader writes into its parameter filled with NaN; the entries it wrote are the rank's
    expected shard, compared with the served values, which are put back exactly afterwards.
    Returns ``max_abs_diff``, ``missing`` (no served parameter), ``mismatched`` (the loader
    refused the tensor) and ``compared_values`` (entries compared on this rank)."""
    if not received:
        raise ValueError("sharded_difference: no received tensors (the sync delivered nothing)")
    missing, mismatched, diff, compared = [], [], 0.0, 0
    with torch.no_grad():
        for name, want in received.items():
            target: tuple[str, Any] | None
            try:
                model.get_parameter(name)
                target = (name, None)
            except AttributeError:
                target = _fused_target(model, name)
            if target is None:
                missing.append(name)
                continue
            served_name, shard_id = target
            try:
                param = model.get_parameter(served_name)
            except AttributeError:
                missing.append(name)
                continue
            loader = getattr(param, "weight_loader", None)
            served = param.detach().clone()
            try:
                param.data.fill_(float("nan"))
                if loader is None:  # a plain parameter: vLLM's default loader copies the whole tensor
                    param.data.copy_(want)
                elif shard_id is None:
                    loader(param, want)
                else:
                    loader(param, want, shard_id)
                expected = param.detach().clone()
            except (AssertionError, RuntimeError, ValueError) as exc:
                mismatched.append(f"{name} -> {served_name}: {type(exc).__name__}: {exc}"[:300])
                continue
            finally:
                param.data.copy_(served)
            written = ~torch.isnan(expected.float())
            n = int(written.sum())
            if n == 0:
                mismatched.append(f"{name} -> {served_name}: the loader wrote nothing")
                continue
            compared += n
            delta = (served.double()[written] - expected.double()[written]).abs()
            diff = max(diff, float(delta.max()))
    return {"max_abs_diff": diff, "missing": sorted(missing), "mismatched": sorted(mismatched),
            "compared_values": compared}


def _extension_update_weights(original):
    @functools.wraps(original)
    def _update_weights(self, weights, *args, **kwargs):
        received = getattr(self, "_cppo_received", None)
        if received is not None:  # copies: the receiver reuses its bucket buffer
            for name, tensor in weights:
                received[name] = tensor.detach().to("cpu", copy=True)
        return original(self, weights, *args, **kwargs)

    return _update_weights


def _extension_update_from_ipc(original):
    @functools.wraps(original)
    def update_weights_from_ipc(self, *args, **kwargs):
        self._cppo_received = {}
        try:
            out = original(self, *args, **kwargs)
            received = self._cppo_received
        finally:
            self._cppo_received = None
        config = self.model_runner.vllm_config.parallel_config
        tp = int(getattr(config, "tensor_parallel_size", 1))
        fields: dict[str, Any] = {"num_tensors": len(received), "tensor_parallel_size": tp, "pid": os.getpid(),
                                  "hashes": {k: tensor_hash(v) for k, v in received.items()}}
        if not received:  # recorded, not raised: the audit must not end the run it watches
            fields.update(compared=False, reason="the sync delivered no tensor")
        elif kwargs.get("peft_config") is not None:
            fields.update(compared=False, reason="a LoRA adapter sync: the base weights are not served anew")
        elif tp != 1:
            fields.update(compared=True, method="weight_loader", tp_rank=_tp_rank(),
                          **sharded_difference(self.model_runner.model, received))
        else:
            fields.update(compared=True, method="direct", **served_difference(self.model_runner.model, received))
        record("served", role="vllm-worker", **fields)
        return out

    return update_weights_from_ipc


def _tp_rank() -> int:
    from vllm.distributed import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def _patch(module) -> None:
    for target, makers in ((ADAPTER, {"update_weights": _adapter_update}),
                           (EXTENSION, {"_update_weights": _extension_update_weights,
                                        "update_weights_from_ipc": _extension_update_from_ipc})):
        if module.__name__ == target[0]:
            wrap_methods(module, target, makers, tag=WRAP_TAG, changed=CHANGED, who="cppo audit")


def install() -> bool:
    """The vLLM sync recorders, when audit mode is on; returns whether they were installed."""
    if not enabled():
        return False
    after_import(ADAPTER[0], _patch)
    after_import(EXTENSION[0], _patch)
    return True
