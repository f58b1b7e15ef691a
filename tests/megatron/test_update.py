"""The policy update under TP1, TP2, DP2 (uneven, and with an empty rank) and PP2 gives the
same grad norm and post-step loss as a plain-torch reference on the HF model (AdamW, the
core's clipped surrogate + k3 KL + aggregate_loss over the whole kept set)."""

import math

import pytest
import torch

from ._common import hf_logprobs, hf_model, sequences

import cppo_megatron.megatron as cm
from cppo_megatron.core import aggregate_loss, clipped_surrogate, kl_penalty
from cppo_megatron.distributed import run_local

pytestmark = pytest.mark.megatron

LENGTHS = [5, 9, 3, 12, 7, 6, 10, 4]
LR = 1e-2
KL = 0.1
MAX_TOKENS = 16
# name -> (tp, pp, per-DP-rank row indices)
LAYOUTS_2 = {
    "tp2": (2, 1, [list(range(8))]),
    "dp2_uneven": (1, 1, [[0, 2, 5], [1, 3, 4, 6, 7]]),
    "dp2_empty_rank": (1, 1, [[], list(range(8))]),
    "pp2": (1, 2, [list(range(8))]),
}


def batch_data():
    seqs = sequences(LENGTHS)
    masks = [torch.arange(L - 1) >= 2 for L in LENGTHS]  # the first two targets are "prompt"
    g = torch.Generator().manual_seed(7)
    adv = torch.randn(len(LENGTHS), generator=g)
    old = hf_logprobs(hf_model(), seqs)
    ref = [o + 0.05 * torch.sin(torch.arange(o.numel(), dtype=torch.float32)) for o in old]
    return seqs, masks, adv, old, ref


# "+weights": known per-sequence loss weights (importance 1/pi) and given full-batch
# denominators, as the actor passes them for metric=importance
WEIGHTS = torch.tensor([1.0, 2.0, 1.5, 4.0, 1.0, 3.0, 1.25, 2.5])
FULL_DENOMINATORS = (90.0, 16.0)


def _mode(mode):
    return mode.removesuffix("+weights"), mode.endswith("+weights")


def reference(mode):
    model = hf_model().train()
    seqs, masks, adv, old, ref = batch_data()
    mode, weighted = _mode(mode)
    n_tok = float(sum(m.sum() for m in masks))
    n_seq = float(sum(1 for m in masks if m.any()))
    if weighted:
        n_tok, n_seq = FULL_DENOMINATORS

    def loss_fn():
        total = 0.0
        for s, m, a, o, r, w in zip(seqs, masks, adv, old, ref, WEIGHTS):
            logits = model(s[None]).logits[0, :-1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, s[1:, None]).squeeze(-1)[None]
            pg, _ = clipped_surrogate(lp, o[None], a[None])
            tok = pg + KL * kl_penalty(lp, r[None], "k3")
            total = total + aggregate_loss(tok, m[None].float(), mode, global_num_tokens=n_tok, global_num_seqs=n_seq,
                                           weights=w[None] if weighted else None)
        return total

    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    loss = loss_fn()
    loss.backward()
    norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in model.parameters() if p.grad is not None))
    opt.step()
    with torch.no_grad():
        post = float(loss_fn())
    return float(loss), norm, post


def _run_layout(tp, pp, split, mode):
    lay = cm.init_parallel(tp, pp, seed=0)
    hf = hf_model()
    model = cm.build_gpt_model(hf.config)
    cm.load_hf_weights(model, hf.state_dict(), hf.config)
    seqs, masks, adv, old, ref = batch_data()
    idx = split[lay.dp_rank]
    mode, weighted = _mode(mode)
    batch = cm.UpdateBatch([seqs[i] for i in idx], [masks[i] for i in idx], adv[idx],
                           [old[i] for i in idx], [ref[i] for i in idx],
                           weights=WEIGHTS[idx] if weighted else None,
                           full_denominators=FULL_DENOMINATORS if weighted else None)
    ddp, opt = cm.build_ddp_and_optimizer(model, lr=LR)
    cfg = cm.PolicyLossConfig(kl_coef=KL, kl_kind="k3", loss_agg_mode=mode)
    counter = cm.ForwardCounter()
    met = cm.policy_update(ddp, opt, batch, cfg, max_tokens_per_micro_batch=MAX_TOKENS, clip_grad=0.0, counter=counter)
    post = cm.policy_loss(ddp, batch, cfg, max_tokens_per_micro_batch=MAX_TOKENS, forward_only=True)
    cm.destroy_parallel()
    return met["loss"], met["grad_norm"], post["loss"], counter.sequences


# seq-mean-token-mean only where the denominators differ per rank (keeps the test short)
RUNS = [(n, "token-mean") for n in ["tp1", *LAYOUTS_2]] + [(n, "seq-mean-token-mean") for n in ("tp1", "dp2_uneven")]
RUNS += [(n, "seq-mean-token-mean+weights") for n in ("tp1", "dp2_uneven")]


def _worker(rank, world, layouts):
    return {(name, mode): _run_layout(*layouts[name], mode) for name, mode in RUNS if name in layouts}


@pytest.fixture(scope="module")
def results():
    one = run_local(_worker, 1, {"tp1": (1, 1, [list(range(8))])}, timeout=120)
    two = run_local(_worker, 2, LAYOUTS_2, timeout=240)
    return {"tp1": one, **{name: two for name in LAYOUTS_2}}


@pytest.mark.parametrize("name,mode", RUNS)
def test_update_matches_reference(results, name, mode):
    loss, norm, post = reference(mode)
    for rank, r in enumerate(results[name]):
        m_loss, m_norm, m_post, seen = r[(name, mode)]
        assert m_loss == pytest.approx(loss, rel=1e-5, abs=1e-6)
        assert m_norm == pytest.approx(norm, rel=1e-5)
        assert m_post == pytest.approx(post, rel=1e-4, abs=1e-6)
        assert post < loss  # the step moved the loss (so the comparison is not vacuous)
    # every layout agrees with TP1 run by megatron itself
    tp1 = results["tp1"][0][("tp1", mode)]
    assert results[name][0][(name, mode)][1] == pytest.approx(tp1[1], rel=1e-5)
    assert results[name][0][(name, mode)][2] == pytest.approx(tp1[2], rel=1e-4, abs=1e-6)
    if name == "dp2_empty_rank":
        assert [r[(name, mode)][3] for r in results[name]] == [0, 8]
