"""MegatronActor on 2 gloo processes (DP2, reference model, mu=2): three CPPO steps move the
policy toward the positive-advantage completions, only survivors are forwarded, and the
exported HF weights reproduce the updated policy's log-probs (the rollout weight sync)."""

import pytest
import torch

from ._common import VOCAB, hf_logprobs, hf_model, transformers

import cppo_megatron.megatron as cm
from cppo_megatron import CPPOConfig
from cppo_megatron.core import prune
from cppo_megatron.distributed import run_local

pytestmark = pytest.mark.megatron

N, G, MU = 16, 4, 2
CPPO = dict(pruning_rate=0.5, seed=2)


def rollouts():
    g = torch.Generator().manual_seed(9)
    lengths = torch.randint(5, 12, (N,), generator=g)
    seqs = [torch.randint(0, VOCAB, (int(L),), generator=g) for L in lengths]
    masks = [torch.arange(int(L) - 1) >= 2 for L in lengths]
    rewards = torch.randint(0, 2, (N,), generator=g).double()
    return seqs, masks, rewards, torch.arange(N) // G


def _worker(rank, world):
    hf = hf_model()
    actor = cm.MegatronActor(hf.config, hf.state_dict(), cm.ActorConfig(lr=3e-3, mu=MU, clip_grad=1.0,
                                                                       loss=cm.PolicyLossConfig(kl_coef=0.04)))
    seqs, masks, rewards, gids = rollouts()
    mine = slice(rank * N // 2, (rank + 1) * N // 2)
    before = actor.logprobs(seqs)
    steps = [actor.step(seqs[mine], masks[mine], rewards[mine], gids[mine], CPPOConfig(**CPPO), step=0)
             for _ in range(3)]
    metrics = [s.metrics for s in steps]
    # the result carries the survivors this rank trained and their pre-update log-probs
    first = steps[0]
    assert len(first.old_logprobs) == first.exchange.handle.num_received == first.counter.sequences // (2 + MU)
    after = actor.logprobs(seqs)
    exported = actor.hf_state_dict()
    cm.destroy_parallel()
    # metric=importance through step(): one update (mu = 1, no KL) of a fresh actor
    imp = cm.MegatronActor(hf.config, hf.state_dict(), cm.ActorConfig(lr=1e-3, mu=1, clip_grad=0.0,
                                                                     loss=cm.PolicyLossConfig(kl_coef=0.0)))
    res = imp.step(seqs[mine], masks[mine], rewards[mine], gids[mine], CPPOConfig(metric="importance", **CPPO), step=0)
    importance = dict(loss=res.metrics["train/loss"], received=res.exchange.global_index.tolist())
    cm.destroy_parallel()
    return dict(before=before, after=after, exported=exported, metrics=metrics, importance=importance)


@pytest.fixture(scope="module")
def results():
    return run_local(_worker, 2, timeout=240)


def test_actor_steps_learn_and_sync(results):
    seqs, masks, rewards, gids = rollouts()
    res = prune(rewards, gids, CPPOConfig(**CPPO), step=0)
    kept, adv = res.selection.kept.tolist(), res.advantages

    def score(lps):  # advantage-weighted mean response log-prob of the survivors
        return sum(float(adv[i]) * float(lps[i][masks[i]].mean()) for i in kept)

    r0 = results[0]
    assert score(r0["after"]) > score(r0["before"]) + 1e-3
    for m in r0["metrics"]:
        assert m["cppo/num_kept"] == len(kept)
        assert sum(r["metrics"][0]["cppo/forwarded_sequences_self"] for r in results) == len(kept) * (2 + MU)
        assert m["train/grad_norm"] > 0 and m["cppo/rank_wait_max"] >= 0
    # weight sync: the exported state dict, loaded into the HF model, is the updated policy
    synced = hf_model()
    missing, unexpected = synced.load_state_dict(r0["exported"], strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied head = the embedding
    if synced.config.tie_word_embeddings:
        assert synced.lm_head.weight.data_ptr() == synced.model.embed_tokens.weight.data_ptr()
    for got, want in zip(r0["after"], hf_logprobs(synced, seqs)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    for k, v in results[1]["exported"].items():
        assert torch.equal(v, r0["exported"][k])


def test_actor_step_trains_the_importance_weighted_loss(results):
    """metric=importance through ``MegatronActor.step``: the survivors carry 1/pi (pi from |A|
    within each group of G = 4, summing to k = 2) and the loss divides by every generated
    response token, so the first update's loss (ratio 1: -A per token) is the HT estimate
    sum_kept (1/pi_i) (-A_i) T_i / T_all, the same on both DP ranks."""
    from cppo_megatron.core import group_advantages, inclusion_probabilities

    seqs, masks, rewards, gids = rollouts()
    kept = prune(rewards, gids, CPPOConfig(metric="importance", **CPPO), step=0).selection.kept.tolist()
    assert sorted(i for r in results for i in r["importance"]["received"]) == kept
    adv, _ = group_advantages(rewards, gids)
    scores = adv.abs().double().reshape(-1, G)
    pi = inclusion_probabilities(scores, torch.ones_like(scores, dtype=torch.bool),
                                 torch.full((N // G,), 2, dtype=torch.int64)).reshape(-1)
    tokens = [int(m.sum()) for m in masks]
    want = sum(-float(adv[i]) / float(pi[i]) * tokens[i] for i in kept) / sum(tokens)
    assert max(1.0 / float(pi[i]) for i in kept) > 1.0  # the weights are not all 1 here
    assert [r["importance"]["loss"] for r in results] == pytest.approx([want, want], rel=1e-4, abs=1e-6)
