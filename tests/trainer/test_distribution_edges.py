"""The rollout strategies' edges that the runs do not reach in this process (torchrun's ranks are
subprocesses coverage does not follow; scripts/coverage_floor.py found them unreached): a rank with no
prompt, the refusals, and on two gloo ranks (``run_local``) which rank keeps which engine and the
collectives the loop uses. Engines are recorders: these are the strategies' own decisions."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from cppo_megatron.distributed import run_local
from cppo_megatron.trainer.distribution import LocalRollout, ModelParallelRollout
from cppo_megatron.trainer.step import PhaseTimer


class Engine:
    """Records the weights it was given."""

    def __init__(self, name: str) -> None:
        self.name, self.updates = name, []

    def update_weights(self, items) -> None:
        self.updates.append(dict(items))


def _recipe(engine="vllm", vllm_tp=1):
    return SimpleNamespace(rollout=SimpleNamespace(engine=engine, vllm_tp=vllm_tp, group_size=2))


@pytest.mark.parametrize(("engine", "logprobs"), [("hf", None), ("vllm", [])])
def test_a_rank_without_prompts_generates_nothing(engine, logprobs):
    rollout = LocalRollout(None, None, None, _recipe(engine))  # the engine is never called
    rows = rollout.generate([], 7, PhaseTimer(torch.device("cpu")))
    assert rows == dict(prompts=[], completions=[], rewards=[], correct=[], formatted=[], truncated=[],
                        logprobs=logprobs, seconds=0.0, stopped=None)


def test_model_parallel_rollout_outside_torchrun_says_how_to_start():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"^ModelParallelRollout needs torch.distributed: start with "
                                           r"`cppo-megatron train --nproc N`$"):
        ModelParallelRollout(None, None, None, None, _recipe(), torch.device("cpu"))


def _two_ranks(rank, world):
    """Both ranks in one model-parallel group (mp_src 0) and the DP group of themselves."""
    world_group = dist.group.WORLD
    singles = [dist.new_group([r]) for r in range(world)]
    out: dict = {}
    # a vLLM engine apart from the HF copy: rank 0 generates and keeps both, rank 1 keeps only its vLLM
    hf, vllm = Engine("hf"), Engine("vllm")
    r = ModelParallelRollout(hf, vllm, None, None, _recipe(), torch.device("cpu"))
    r.attach(dp_group=singles[rank], mp_group=world_group, tp_group=world_group)
    r.sync({"w": 1})
    out["vllm"] = dict(generates=r.generates, hf=r.hf_engine is not None, engine=r.engine is not None,
                       weight_ranks=r.weight_ranks, hf_updates=len(hf.updates), vllm_updates=len(vllm.updates))
    # HF generation: the engine is the HF copy, which rank 1 (not generating) drops with it
    shared = Engine("hf")
    r = ModelParallelRollout(shared, shared, None, None, _recipe("hf"), torch.device("cpu"))
    r.attach(dp_group=world_group, mp_group=singles[rank], tp_group=singles[rank])  # each rank its own MP group
    out["hf_dp2"] = dict(generates=r.generates, weight_ranks=r.weight_ranks, dp=(r.dp_rank, r.dp))
    # the DP reductions and rank 0's weights broadcast
    out["sum"] = r.reduce_dp(torch.tensor([1.0 + rank, 10.0])).tolist()
    out["max"] = r.reduce_dp(torch.tensor([1.0 + rank, -float(rank)]), op="max").tolist()
    out["reduce_max"] = r.reduce_max(torch.tensor([float(rank), 5.0 - rank])).tolist()
    torch.manual_seed(rank)
    module = torch.nn.Linear(2, 2)
    r.broadcast_module(module)
    out["weights"] = [v.tolist() for v in module.state_dict().values()]
    # vLLM TP 2 over ranks 0..1, but each rank's Megatron TP group is itself: refused on both
    r = ModelParallelRollout(hf, vllm, None, None, _recipe(vllm_tp=2), torch.device("cpu"))
    try:
        r.attach(dp_group=singles[rank], mp_group=world_group, tp_group=singles[rank])
    except RuntimeError as exc:
        out["refused"] = str(exc)
    return out


def test_on_two_ranks_each_keeps_the_engines_it_uses_and_the_collectives_reduce():
    rank0, rank1 = run_local(_two_ranks, 2, timeout=120)
    assert rank0["vllm"] == dict(generates=True, hf=True, engine=True, weight_ranks=[0], hf_updates=1, vllm_updates=1)
    assert rank1["vllm"] == dict(generates=False, hf=False, engine=True, weight_ranks=[0], hf_updates=0,
                                 vllm_updates=0)  # its vLLM engine stays (every rank is a vLLM worker), unsynced
    assert rank0["hf_dp2"] == dict(generates=True, weight_ranks=[0, 1], dp=(0, 2))
    assert rank1["hf_dp2"] == dict(generates=True, weight_ranks=[0, 1], dp=(1, 2))
    for out in (rank0, rank1):
        assert out["sum"] == [3.0, 20.0] and out["max"] == [2.0, 0.0] and out["reduce_max"] == [1.0, 5.0]
        assert out["refused"] == ("rollout.vllm_tp=2: vLLM's TP group of ranks 0..1 is not inside one Megatron TP "
                                  "group; use rollout.vllm_tp=1")
    assert rank1["weights"] == rank0["weights"]  # rank 0's, broadcast
    torch.manual_seed(0)
    assert rank0["weights"] == [v.tolist() for v in torch.nn.Linear(2, 2).state_dict().values()]
