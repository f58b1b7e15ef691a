"""The whole Megatron-side CPPO step on 4 gloo processes (TP2 x DP2): rollouts held per DP
rank (groups spanning ranks) -> prune_and_exchange over the DP group -> old log-probs on
the survivors -> results back to their owners -> policy update. Pruned rows never enter a
forward pass: each rank records what it saw."""

import pytest
import torch

from ._common import VOCAB, hf_logprobs, hf_model

import cppo_megatron.megatron as cm
from cppo_megatron import CPPOConfig
from cppo_megatron.core import prune
from cppo_megatron.distributed import prune_and_exchange, run_local

pytestmark = pytest.mark.megatron

COUNTS = [10, 6]  # sequences held by DP rank 0 and 1
G = 4  # groups of 4 consecutive global rows: group 2 spans both DP ranks
CFG = dict(pruning_rate=0.5, scope="group", seed=11)


def rollouts():
    n = sum(COUNTS)
    g = torch.Generator().manual_seed(5)
    lengths = torch.randint(4, 14, (n,), generator=g)
    # first token = global index: identifies every row that enters a forward pass
    seqs = [torch.cat([torch.tensor([i]), torch.randint(0, VOCAB, (int(L) - 1,), generator=g)]) for i, L in enumerate(lengths)]
    masks = [torch.arange(int(L) - 1) >= 2 for L in lengths]
    rewards = torch.randint(0, 2, (n,), generator=g).double()
    return seqs, masks, rewards, torch.arange(n) // G, lengths


def _worker(rank, world):
    from megatron.core import parallel_state as ps

    lay = cm.init_parallel(2, 1, seed=0)
    hf = hf_model()
    model = cm.build_gpt_model(hf.config)
    cm.load_hf_weights(model, hf.state_dict(), hf.config)
    ddp, opt = cm.build_ddp_and_optimizer(model, lr=1e-3)

    seqs, masks, rewards, gids, lengths = rollouts()
    lo = sum(COUNTS[: lay.dp_rank])
    mine = slice(lo, lo + COUNTS[lay.dp_rank])
    res = prune_and_exchange({"tokens": seqs[mine], "mask": masks[mine]}, rewards[mine], gids[mine], lengths[mine],
                             CPPOConfig(**CFG), step=3, group=ps.get_data_parallel_group())
    toks, msk = res.fields["tokens"], res.fields["mask"]
    seen_logp, seen_update = cm.ForwardCounter(), cm.ForwardCounter()
    old = cm.compute_logprobs(ddp, toks, max_tokens_per_micro_batch=24, counter=seen_logp)
    back = res.handle.return_to_owners(old)
    batch = cm.UpdateBatch(toks, msk, res.advantages, old, ref_logprobs=None)
    met = cm.policy_update(ddp, opt, batch, cm.PolicyLossConfig(kl_coef=0.0), max_tokens_per_micro_batch=24,
                           counter=seen_update)
    cm.destroy_parallel()
    return dict(dp_rank=lay.dp_rank, received=res.global_index, seen_logp=seen_logp.seen, seen_update=seen_update.seen,
                back=back, grad_norm=met["grad_norm"], num_seqs=met["num_seqs"], loads=res.handle.plan.loads)


@pytest.fixture(scope="module")
def results():
    return run_local(_worker, 4, timeout=240)


def test_only_survivors_enter_forward_passes_and_results_return(results):
    seqs, masks, rewards, gids, lengths = rollouts()
    kept = prune(rewards, gids, CPPOConfig(**CFG), step=3).selection.kept.tolist()
    assert 0 < len(kept) < len(seqs)
    ref = hf_logprobs(hf_model(), seqs)
    by_dp = {}
    for r in results:
        by_dp.setdefault(r["dp_rank"], []).append(r)
    assert sorted(by_dp) == [0, 1] and all(len(v) == 2 for v in by_dp.values())
    seen_all = []
    for dp, (a, b) in sorted(by_dp.items()):
        # TP peers hold the same rows and saw the same sequences
        assert torch.equal(a["received"], b["received"]) and a["seen_logp"] == b["seen_logp"]
        rows = a["received"].tolist()
        for pass_seen in (a["seen_logp"], a["seen_update"]):
            assert sorted(first for first, _ in pass_seen) == rows, "a pruned or foreign row entered a forward pass"
            assert all(length == int(lengths[first]) for first, length in pass_seen)
        seen_all += rows
        # log-probs came back to the owner, in its order, for its kept rows only
        lo = sum(COUNTS[:dp])
        for i, lp in enumerate(a["back"]):
            if lo + i in kept:
                torch.testing.assert_close(lp, ref[lo + i], atol=1e-5, rtol=0)
            else:
                assert lp is None
    assert sorted(seen_all) == kept
    norms = {round(r["grad_norm"], 9) for r in results}
    assert len(norms) == 1 and next(iter(norms)) > 0
    assert results[0]["num_seqs"] == len(kept)
