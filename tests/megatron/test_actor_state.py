"""MegatronActor's checkpoint shard and its refusals on one gloo rank in this process (the backend
matrix saves and loads shards inside forked ranks; scripts/coverage_floor.py found these branches
unreached there): a shard loads back into a fresh actor as the same policy, with the plain and the
distributed optimizer, before and after the first step; a shard of another layout or dtype is
refused by name; the learning rate per optimizer step; reference log-probs without a reference."""

from __future__ import annotations

import pytest
import torch

from ._common import VOCAB, hf_model

import cppo_megatron.megatron as cm  # noqa: E402

pytestmark = [pytest.mark.megatron, pytest.mark.in_process_dist]


def _batch():
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, VOCAB, (int(n),), generator=g) for n in (6, 9, 7, 8)]
    masks = [torch.arange(s.numel() - 1) >= 2 for s in seqs]
    return seqs, masks, torch.tensor([1.0, -1.0, 0.5, -0.5])


def _actor(**kw):
    hf = hf_model(seed=1)
    return cm.MegatronActor(hf.config, hf.state_dict(), cm.ActorConfig(lr=1e-2, loss=cm.PolicyLossConfig(kl_coef=0.0),
                                                                       **kw))


def test_reference_log_probs_need_a_reference_model(one_rank):
    actor = _actor()
    with pytest.raises(ValueError, match=r"^reference log-probs need a reference model: build the actor with "
                                         r"loss.kl_coef > 0$"):
        actor.logprobs(_batch()[0], reference=True)
    with pytest.raises(ValueError, match="^loss_masks has 1 rows for 4 sequences$"):
        actor.step(_batch()[0], _batch()[1][:1], torch.zeros(4), torch.zeros(4, dtype=torch.int64), None)


def test_each_optimizer_step_takes_its_learning_rate(one_rank):
    actor = _actor(mu=2)
    seqs, masks, adv = _batch()
    old = actor.logprobs(seqs)
    with pytest.raises(ValueError, match="^lrs has 1 entries for mu=2 optimizer steps$"):
        actor.update(seqs, masks, adv, old, lrs=[0.1])
    actor.update(seqs, masks, adv, old, lrs=[0.02, 0.005])
    assert {g["lr"] for g in actor.optimizer.param_groups} == {0.005}


@pytest.mark.parametrize("distributed", [False, True])
def test_a_shard_loads_back_as_the_same_policy(one_rank, distributed):
    """Train, save, train once more; a fresh actor loaded from the save and trained once more ends
    at the same policy (the weights and the optimizer state came back). A second live actor rebuilds
    the process's model-parallel state, so the first one's later steps are taken before it exists."""
    seqs, masks, adv = _batch()
    trained = _actor(distributed_optimizer=distributed)
    fresh_state = trained.state_dict()
    assert (fresh_state["optimizer"] is None) is distributed  # the distributed one has no state before a step
    trained.update(seqs, masks, adv, trained.logprobs(seqs))
    saved = trained.state_dict()
    assert saved["layout"] == ((1, 1, 1, 0, 0, 0) if distributed else (1, 1, 1, 0, 0))
    assert saved["distributed_optimizer"] is distributed and saved["dtype"] == "float32"
    at_save = trained.logprobs(seqs)
    trained.update(seqs, masks, adv, at_save)
    after = trained.logprobs(seqs)
    resumed = _actor(distributed_optimizer=distributed)
    resumed.load_state_dict(saved)
    assert all(torch.equal(a, b) for a, b in zip(at_save, resumed.logprobs(seqs), strict=True))
    resumed.update(seqs, masks, adv, resumed.logprobs(seqs))
    for a, b in zip(after, resumed.logprobs(seqs), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    # a shard written before the first step: its weights become the master weights
    early = _actor(distributed_optimizer=distributed)
    early.load_state_dict(fresh_state)
    early.update(seqs, masks, adv, early.logprobs(seqs))


def test_a_shard_of_another_layout_or_dtype_is_refused(one_rank):
    actor = _actor()
    state = actor.state_dict()
    with pytest.raises(ValueError, match=r"checkpoint shard is for layout \(tp, pp, dp, tp_rank, pp_rank\[, dp_rank\]\) "
                                         r"= \(2, 1, 1, 0, 0\), this rank is \(1, 1, 1, 0, 0\): resume with the same"):
        actor.load_state_dict({**state, "layout": (2, 1, 1, 0, 0)})
    with pytest.raises(ValueError, match="^checkpoint shard was written with dtype='bfloat16', this run has "
                                         "dtype='float32': resume with the same setting$"):
        actor.load_state_dict({**state, "dtype": "bfloat16"})


def test_a_step_balances_on_the_workloads_it_is_given(one_rank):
    """``lengths`` replaces the token counts as the balancer's workload: with a * len (a = 1) the
    rank's load is the sum of the given lengths of the survivors."""
    from cppo_megatron.core.settings import CPPOConfig

    actor = _actor()
    seqs, masks, _ = _batch()  # 6, 9, 7 and 8 tokens
    cfg = CPPOConfig(pruning_rate=0.5, workload_linear=1.0, workload_quadratic=0.0)
    # one group: mean 0.475, |A| largest for rows 0 and 3, the k = 2 kept
    rewards, groups = torch.tensor([1.0, 0.5, 0.4, 0.0]), torch.zeros(4, dtype=torch.int64)
    res = actor.step(seqs, masks, rewards, groups, cfg, lengths=torch.tensor([10, 20, 30, 40]))
    assert res.exchange.global_index.tolist() == [0, 3]
    assert res.metrics["cppo/exchange_max_load"] == 50.0  # 10 + 40, not the token counts 6 + 8
    assert res.metrics["cppo/exchange_kept_sequences"] == 2.0
    default = actor.step(seqs, masks, rewards, groups, cfg)
    assert default.metrics["cppo/exchange_max_load"] == 14.0


def test_the_distributed_optimizer_state_needs_one_megatron_distributed_optimizer(one_rank):
    """megatron-core chains one optimizer per parameter kind (0.16: optimizer/__init__.py:689 adds the
    expert parameters' after the dense ones'); a shard of the first alone would lose the others'
    state, so a second chained optimizer is refused by type."""
    actor = _actor(distributed_optimizer=True)
    chain = actor.optimizer.chained_optimizers
    assert [type(o).__name__ for o in chain] == ["DistributedOptimizer"]
    chain.append(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))
    with pytest.raises(TypeError, match=r"^expected one megatron DistributedOptimizer, got "
                                        r"\['DistributedOptimizer', 'SGD'\]$"):
        actor.state_dict()
    chain.pop()
    assert actor.state_dict()["optimizer"] is None  # one again: no step yet, nothing beyond the weights
