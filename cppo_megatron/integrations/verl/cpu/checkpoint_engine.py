"""A checkpoint engine for veRL's disaggregated trainer mode on CPU (backend ``cpu``).

veRL 0.9.1's ``trainer.v1.trainer_mode=separate_async`` trains on one resource pool and generates
on another, so the actor's weights reach the standalone rollout replicas through a checkpoint
engine (``verl/checkpoint_engine/base.py:380``, ``CheckpointEngineManager.update_weights``:
prepare -> ``build_topology`` -> ``init_process_group`` -> actor ``send_weights`` / rollout
``receive_weights`` -> ``finalize``, at every sync). The in-process ``naive`` engine cannot cross
processes and the mode refuses it (``verl/trainer/ppo/v1/trainer_separate_async.py:68``); veRL's
others need NCCL/cupy, HCCL, NIXL or Mooncake. This one moves the same bytes over ZeroMQ (which veRL
already uses for its bucketed vLLM sync):

- actor rank 0 (``is_master``) binds a ROUTER socket when the engine is built and is the only
  sender; the other actor ranks drain their weight generator (producing a weight may be a
  collective over the actor group, as veRL's NCCL engine notes) and send nothing;
- each rollout worker connects a DEALER, says it is ready, then receives the weights in buckets of
  ``update_weights_bucket_megabytes`` (veRL's ``split_weight_chunks`` / ``merge_weight_chunks``, so a
  tensor larger than a bucket travels in chunks) and acknowledges each bucket: the sender holds at
  most one bucket per receiver, and a receiver that stops answering ends the sync with
  ``WeightSyncError`` after ``CPPO_VLLM_SYNC_TIMEOUT_S`` instead of a hang.

Registered in ``CheckpointEngineRegistry`` only in the CPU mode; ``cpu.prepare`` selects it for a
``separate_async`` run. In audit mode the sender records the sha1 of every tensor it sent
(``sync`` records with ``role: cpu-engine``), so a test compares what the actor sent with what
vLLM received and serves (``diagnostics/audit_vllm.py``).
"""

from __future__ import annotations

import asyncio
import os
import pickle
import time
from typing import Any, cast

import torch
from verl.checkpoint_engine.base import CheckpointEngine, merge_weight_chunks, split_weight_chunks

from ...records import tensor_hash
from ..diagnostics import audit
from .vllm import WeightSyncError, sync_timeout_s

__all__ = ["BACKEND", "CpuCheckpointEngine"]

BACKEND = "cpu"
_READY, _ACK = b"ready", b"ack"
_POLL_S = 0.002
_ALIGN = 16  # bytes: every tensor starts at a multiple (mixed dtypes share a bucket)


def _context() -> Any:
    """The process's one ZeroMQ context, never terminated: a context of our own, collected with an
    engine whose sockets were garbage in the same cycle, would block in ``Context.term`` forever
    from ``__del__`` (term waits for sockets that no finalizer closes any more)."""
    import zmq

    return zmq.Context.instance()


def _node_ip() -> str:
    try:
        import ray

        return str(ray.util.get_node_ip_address()).strip("[]")
    except Exception:  # noqa: BLE001 - outside a Ray worker (tests): loopback
        return "127.0.0.1"


async def _recv(sock, deadline: float, what: str) -> list[bytes]:
    """One multipart message from ``sock`` without blocking the event loop, or WeightSyncError at
    ``deadline`` (monotonic seconds)."""
    import zmq

    while not sock.poll(0, zmq.POLLIN):
        if time.monotonic() > deadline:
            raise WeightSyncError(f"cpu checkpoint engine: no {what} within {sync_timeout_s():g} s "
                                  "(CPPO_VLLM_SYNC_TIMEOUT_S); the other side most likely failed, see its log")
        await asyncio.sleep(_POLL_S)
    return sock.recv_multipart()


class CpuCheckpointEngine(CheckpointEngine):
    """veRL checkpoint engine over ZeroMQ for CPU processes (see the module docstring).

    Args:
        bucket_size: bytes per bucket (veRL passes ``update_weights_bucket_megabytes << 20``).
        is_master: True on actor rank 0, the sender (veRL passes it on the actor side only).
    """

    def __init__(self, bucket_size: int, is_master: bool = False, **_: Any) -> None:
        if not isinstance(bucket_size, int) or bucket_size <= 0:
            raise ValueError(f"cpu checkpoint engine: bucket_size must be a positive number of bytes, got "
                             f"{bucket_size!r} (rollout.checkpoint_engine.update_weights_bucket_megabytes)")
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.rank: int | None = None
        self.world_size: int | None = None
        self.address: str | None = None
        self._sock: Any = None
        if is_master:
            import zmq

            self._sock = _context().socket(zmq.ROUTER)
            self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a receiver that reconnects keeps its identity
            self._sock.setsockopt(zmq.LINGER, 0)
            ip = _node_ip()
            port = self._sock.bind_to_random_port(f"tcp://{ip}")
            self.address = f"tcp://{ip}:{port}"

    # --- topology (called by CheckpointEngineManager.build_process_group before every sync)
    def prepare(self) -> dict[str, Any]:
        return {"address": self.address} if self.is_master else {}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]):
        address = (metadata[0] or {}).get("address") if metadata else None
        if not address:
            raise ValueError("cpu checkpoint engine: actor rank 0 reported no address; it must be built with "
                             "is_master=True (veRL's actor worker does)")
        world = 1 + rollout_world_size
        actor = {"rank": [0] + [-1] * (actor_wg_world_size - 1), "world_size": [world] * actor_wg_world_size,
                 "address": [address] * actor_wg_world_size}
        rollout = {"rank": list(range(1, world)), "world_size": [world] * rollout_world_size,
                   "address": [address] * rollout_world_size}
        return actor, rollout

    def init_process_group(self, rank: int, world_size: int, address: str) -> None:  # type: ignore[override]
        self.rank, self.world_size = rank, world_size
        if rank < 1:
            return
        import zmq

        if self._sock is None or self.address != address:
            self.close()
            self._sock = _context().socket(zmq.DEALER)
            self._sock.setsockopt(zmq.IDENTITY, f"r{rank}".encode())
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.connect(address)
            self.address = address
        self._sock.send(_READY)

    def finalize(self) -> None:
        """Nothing to free between syncs: the sockets are kept (one bucket lives only while sent)."""

    def close(self) -> None:
        """Close this engine's socket (nothing pending is kept: linger 0)."""
        if self._sock is not None:
            self._sock.close(0)
        self._sock = None

    # --- the transfer
    @torch.no_grad()
    async def send_weights(self, weights, global_steps: int | None = None):
        if self.rank is None:
            raise RuntimeError("cpu checkpoint engine: send_weights before init_process_group")
        if self.rank < 0:  # not the sender: produce the weights (may be collective), send nothing
            for _ in weights:
                pass
            return {}
        deadline = time.monotonic() + sync_timeout_s()
        receivers: list[bytes] = []
        while len(receivers) < int(self.world_size or 1) - 1:
            missing = int(self.world_size or 1) - 1 - len(receivers)
            ident, msg = await _recv(self._sock, deadline, f"'ready' from {missing} rollout worker(s)")
            if msg == _READY and ident not in receivers:
                receivers.append(ident)
        hashes: dict[str, str] = {}
        recording = audit.enabled()
        buf = torch.empty(self.bucket_size, dtype=torch.uint8)
        meta: dict[str, Any] = {}
        offset = sent_bytes = 0

        async def flush(last: bool) -> None:
            header = pickle.dumps({"bucket_meta": meta, "is_last": last, "length": offset,
                                   "global_steps": global_steps})
            payload = buf[:offset].numpy().tobytes()
            for ident in receivers:
                self._sock.send_multipart([ident, header, payload])
            acked: set[bytes] = set()
            end = time.monotonic() + sync_timeout_s()
            while len(acked) < len(receivers):
                ident, msg = await _recv(self._sock, end, "bucket acknowledgement")
                if msg == _ACK:
                    acked.add(ident)

        def tee(items):
            for name, tensor in items:
                if hasattr(tensor, "full_tensor"):  # veRL's engines yield full tensors (gathered in the generator)
                    raise TypeError(f"cpu checkpoint engine: {name} arrived as a DTensor shard; the actor's "
                                    "get_per_tensor_param must yield full tensors")
                full = tensor.detach().cpu().contiguous()
                if recording:
                    hashes[name] = tensor_hash(full)
                yield name, full

        async for tensor_meta, chunk in split_weight_chunks(tee(weights), self.bucket_size):
            offset = -(-offset // _ALIGN) * _ALIGN  # the receiver views the bytes as the tensor's dtype
            if offset + tensor_meta.chunk_size > self.bucket_size:
                await flush(False)
                sent_bytes += sum(m.chunk_size for m in meta.values())
                meta, offset = {}, 0
            tensor_meta.offset = offset
            meta[f"{tensor_meta.name}@{tensor_meta.chunk_offset}"] = tensor_meta
            buf[offset:offset + tensor_meta.chunk_size].copy_(cast(torch.Tensor, chunk))  # None only with meta_only
            offset += tensor_meta.chunk_size
        await flush(True)
        sent_bytes += sum(m.chunk_size for m in meta.values())
        if recording:
            audit.record("sync", role="cpu-engine", source="cpu-engine", global_steps=global_steps,
                         rank=int(os.environ.get("RANK", -1)),
                         receivers=len(receivers), num_tensors=len(hashes), hashes=hashes, bytes=sent_bytes)
        return {}

    async def receive_weights(self, global_steps: int | None = None):
        async for name, weight in merge_weight_chunks(self._chunks(), self.bucket_size):
            yield name, weight

    async def _chunks(self):
        if self.rank is None or self.rank < 1:
            raise RuntimeError("cpu checkpoint engine: receive_weights on a rank that is not a rollout worker")
        while True:
            deadline = time.monotonic() + sync_timeout_s()
            header, payload = await _recv(self._sock, deadline, "weight bucket from the actor")
            bucket = pickle.loads(header)
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)  # its own copy: tensors may outlive it
            for tensor_meta in bucket["bucket_meta"].values():
                yield tensor_meta, data[tensor_meta.offset:tensor_meta.offset + tensor_meta.chunk_size]
            self._sock.send(_ACK)
            if bucket["is_last"]:
                return
