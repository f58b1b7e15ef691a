"""Checkpoints when ranks do not share a filesystem (nodes with local disks), on 4 gloo
processes: ranks 0-1 write under one directory and ranks 2-3 under another, each rank its own
shard, each "node" a trainer.pt equal to rank 0's; resume agrees on the newest step every rank
holds and can read. One shared directory keeps the usual layout."""

from __future__ import annotations

import pytest
import torch

from cppo_megatron.distributed import run_local
from cppo_megatron.trainer.checkpoint import filesystem_peers, find_checkpoint, load_checkpoint, save_checkpoint


def _gather(obj):
    import torch.distributed as dist

    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _barrier():
    import torch.distributed as dist

    dist.barrier()


def _any_failed(failed: bool) -> bool:
    import torch.distributed as dist

    t = torch.tensor([float(failed)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t[0] > 0)


def _worker(rank, world, dirs, damage):
    out_dir = dirs[rank]
    peers = filesystem_peers(out_dir, rank, gather=_gather, barrier=_barrier)
    for step in (1, 2):
        state = {"sampler": {"drawn": 10 * step}, "elapsed": 1.5 * step} if rank == 0 else None
        state = _gather(state)[0]  # what the trainer does when not every rank shares one directory
        save_checkpoint(out_dir, step, state, {"shard": torch.full((3,), 100.0 * step + rank)}, rank=rank,
                        barrier=_barrier, peers=peers)
    if damage is not None and rank == damage[1]:
        latest = out_dir / "checkpoints" / "step_000002"
        if damage[0] == "corrupt":
            (latest / f"policy_rank{rank:05d}.pt").write_bytes(b"truncated")
        else:  # that node's disk never got the latest checkpoint
            import shutil

            shutil.rmtree(latest)
    _barrier()
    logs: list = []
    path, trainer_state, policy = find_checkpoint(out_dir, rank, any_rank_failed=_any_failed, gather=_gather,
                                                  log=logs.append)
    return peers, path.name, trainer_state, policy["shard"].tolist(), logs


def _files(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_ranks_on_two_filesystems_write_and_resume_their_own_shards(tmp_path):
    node_a, node_b = tmp_path / "node_a", tmp_path / "node_b"
    results = run_local(_worker, 4, [node_a, node_a, node_b, node_b], None, timeout=120)
    assert [r[0] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    for root, ranks in ((node_a, (0, 1)), (node_b, (2, 3))):
        assert _files(root) == sorted([f"checkpoints/step_00000{s}/policy_rank0000{r}.pt" for s in (1, 2) for r in ranks]
                                      + [f"checkpoints/step_00000{s}/trainer.pt" for s in (1, 2)])
        # every node's trainer.pt is rank 0's state
        state, _ = load_checkpoint(root / "checkpoints" / "step_000002", ranks[0])
        assert state == {"sampler": {"drawn": 20}, "elapsed": 3.0, "step": 2}
    for rank, (_, name, state, shard, _) in enumerate(results):
        assert name == "step_000002" and state["sampler"] == {"drawn": 20}
        assert shard == [200.0 + rank] * 3  # its own shard, from its own disk


@pytest.mark.parametrize("damage,message", [(("corrupt", 3), "step_000002 is truncated or corrupt"),
                                            (("missing", 2), "step_000002 not on every rank's filesystem")])
def test_a_damaged_latest_checkpoint_on_one_node_sends_every_rank_back_one_step(tmp_path, damage, message):
    node_a, node_b = tmp_path / "node_a", tmp_path / "node_b"
    results = run_local(_worker, 4, [node_a, node_a, node_b, node_b], damage, timeout=120)
    for rank, (_, name, state, shard, _) in enumerate(results):
        assert name == "step_000001" and state["step"] == 1 and shard == [100.0 + rank] * 3
    assert any(message in line for line in results[0][4]), results[0][4]


def test_one_shared_directory_is_the_usual_layout(tmp_path):
    results = run_local(_worker, 4, [tmp_path] * 4, None, timeout=120)
    assert all(r[0] == [0, 1, 2, 3] for r in results)
    assert _files(tmp_path) == sorted([f"checkpoints/step_00000{s}/policy_rank0000{r}.pt" for s in (1, 2)
                                       for r in range(4)] + [f"checkpoints/step_00000{s}/trainer.pt" for s in (1, 2)])
    assert [r[3] for r in results] == [[200.0 + r] * 3 for r in range(4)]
