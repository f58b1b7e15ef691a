"""The CPU mode's checkpoint engine (integrations/verl/cpu/checkpoint_engine.py) in one process:
veRL's topology for 2 actor ranks and 2 rollout workers, the weights in buckets smaller than some
tensors, bit for bit, twice over the same sockets; a receiver that stops answering ends the sync
with WeightSyncError; the audit record names what was sent. The run through veRL's
CheckpointEngineManager is the separate_async e2e run (test_cpu_e2e.py)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.verl
pytest.importorskip("zmq")

BUCKET = 64  # bytes: the 40-float tensor (160 bytes) travels in 3 chunks


@pytest.fixture(scope="module", autouse=True)
def _no_zmq_threads_left():
    """The engines share the process's ZeroMQ context (its I/O threads live as long as it does): end
    it after this module, every socket closed by the tests, so that later tests fork a pytest
    process without ZeroMQ's threads in it."""
    yield
    import zmq

    zmq.Context.instance().term()


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"model.embed_tokens.weight": torch.randn(8, 5, generator=g),
            "model.layers.0.mlp.down_proj.weight": torch.randn(40, generator=g),
            "model.norm.weight": torch.randn(3, generator=g).to(torch.bfloat16),
            "lm_head.bias": torch.randn(1, generator=g)}


def _group():
    from cppo_megatron.integrations.verl.cpu.checkpoint_engine import CpuCheckpointEngine

    master, other_actor = CpuCheckpointEngine(BUCKET, is_master=True), CpuCheckpointEngine(BUCKET)
    receivers = [CpuCheckpointEngine(BUCKET), CpuCheckpointEngine(BUCKET)]
    actors = [master, other_actor]
    return actors, receivers


def _connect(actors, receivers):
    from cppo_megatron.integrations.verl.cpu.checkpoint_engine import CpuCheckpointEngine

    meta = [e.prepare() for e in actors + receivers]
    a_kw, r_kw = CpuCheckpointEngine.build_topology(len(actors), len(receivers), meta)
    assert a_kw["rank"] == [0, -1] and r_kw["rank"] == [1, 2] and set(a_kw["world_size"]) == {3}
    for i, e in enumerate(actors):
        e.init_process_group(**{k: v[i] for k, v in a_kw.items()})
    for i, e in enumerate(receivers):
        e.init_process_group(**{k: v[i] for k, v in r_kw.items()})


async def _collect(engine) -> dict[str, torch.Tensor]:
    return {name: t.clone() async for name, t in engine.receive_weights()}


async def _sync(actors, receivers, weights):
    drained = []

    def gen():  # the non-sender actor rank still walks its generator (a collective in veRL's engines)
        for item in weights.items():
            drained.append(item[0])
            yield item

    out = await asyncio.gather(actors[0].send_weights(iter(weights.items()), global_steps=3),
                               actors[1].send_weights(gen()), *[_collect(r) for r in receivers])
    assert drained == list(weights)
    return out[2:]


def test_two_syncs_deliver_every_tensor_bit_for_bit_to_every_rollout_worker(tmp_path, monkeypatch):
    from cppo_megatron.integrations.records import tensor_hash
    from cppo_megatron.integrations.verl.diagnostics import audit
    from cppo_megatron.integrations.verl.cpu.vllm import SYNC_TIMEOUT_ENV

    monkeypatch.setenv(audit.ENV, str(tmp_path))
    monkeypatch.setenv(SYNC_TIMEOUT_ENV, "30")  # a broken engine fails here instead of waiting 300 s
    actors, receivers = _group()
    for seed in (0, 1):  # the second sync reuses the sockets
        weights = _weights(seed)
        _connect(actors, receivers)
        for got in asyncio.run(_sync(actors, receivers, weights)):
            assert list(got) == list(weights)
            for name, t in weights.items():
                assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
        for e in actors + receivers:
            e.finalize()
    for e in actors + receivers:
        e.close()
    (first, second) = [r for r in audit.read(tmp_path) if r["kind"] == "sync"]
    assert first["source"] == "cpu-engine" and first["receivers"] == 2 and first["global_steps"] == 3
    assert second["hashes"] == {k: tensor_hash(v) for k, v in _weights(1).items()}
    assert second["bytes"] == sum(t.nbytes for t in _weights(1).values())


def test_a_receiver_that_stops_answering_ends_the_sync_with_a_message(monkeypatch):
    from cppo_megatron.integrations.verl.cpu.vllm import SYNC_TIMEOUT_ENV, WeightSyncError

    monkeypatch.setenv(SYNC_TIMEOUT_ENV, "0.5")
    actors, receivers = _group()
    _connect(actors, receivers)

    async def only_one_receives():
        return await asyncio.gather(actors[0].send_weights(iter(_weights(0).items())), _collect(receivers[0]))

    with pytest.raises(WeightSyncError, match="no bucket acknowledgement within 0.5 s"):
        asyncio.run(only_one_receives())
    for e in actors + receivers:
        e.close()


# engines dropped unclosed inside a reference cycle, then collected: with a ZeroMQ context per engine,
# the context's __del__ blocked in Context.term forever (its sockets, garbage in the same cycle, were
# never closed); it hung a CI run at the next test's garbage collection
COLLECT = """
import gc
from cppo_megatron.integrations.verl.cpu.checkpoint_engine import CpuCheckpointEngine
master, receiver = CpuCheckpointEngine(64, is_master=True), CpuCheckpointEngine(64)
receiver.init_process_group(rank=1, world_size=2, address=master.address)
cycle = [master, receiver]
cycle.append(cycle)
del master, receiver, cycle
gc.collect()
print("collected")
"""


def test_engines_collected_unclosed_do_not_block_the_process():
    # a blocked Context.term never returns; a healthy run imports veRL (10 s idle, up to 60 s measured on
    # the loaded 2-core CI machine) and exits in seconds: 60 s once failed a healthy run, 240 s does not
    out = subprocess.run([sys.executable, "-c", COLLECT], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0 and out.stdout.strip() == "collected", out.stderr[-2000:]


def test_the_topology_needs_the_senders_address():
    from cppo_megatron.integrations.verl.cpu.checkpoint_engine import CpuCheckpointEngine

    with pytest.raises(ValueError, match="actor rank 0 reported no address"):
        CpuCheckpointEngine.build_topology(1, 1, [{}, {}])
    with pytest.raises(ValueError, match="bucket_size must be a positive number of bytes, got 0"):
        CpuCheckpointEngine(0)
