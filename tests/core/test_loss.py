import pytest
import torch

from cppo_megatron.core import aggregate_loss, clipped_surrogate, kl_penalty, token_logprobs


def _batch():
    loss = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0], [9.0, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    return loss, mask


def test_aggregation_modes_by_hand():
    loss, mask = _batch()
    assert aggregate_loss(loss, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert aggregate_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert aggregate_loss(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(10 / (2 * 4))
    assert aggregate_loss(loss, mask, "seq-mean-token-sum-norm", norm_constant=10).item() == pytest.approx(
        10 / 20
    )


def test_global_denominators_make_shards_sum_to_the_global_mean():
    gen = torch.Generator().manual_seed(0)
    loss = torch.rand(10, 7, generator=gen)
    mask = (torch.rand(10, 7, generator=gen) < 0.6).int()
    mask[:, 0] = 1
    shards = [slice(0, 1), slice(1, 8), slice(8, 10)]  # uneven "ranks"
    for mode, kw in (
        ("token-mean", {"global_num_tokens": float(mask.sum())}),
        ("seq-mean-token-mean", {"global_num_seqs": 10.0}),
        ("seq-mean-token-sum", {"global_num_seqs": 10.0}),
    ):
        total = sum(aggregate_loss(loss[s], mask[s], mode, **kw) for s in shards)
        assert total.item() == pytest.approx(aggregate_loss(loss, mask, mode).item(), rel=1e-6)
        # a per-shard mean would weight shards unequally
        naive = sum(aggregate_loss(loss[s], mask[s], mode) for s in shards) / len(shards)
        assert naive.item() != pytest.approx(total.item(), rel=1e-3)


def test_clipped_surrogate():
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.0]]))
    old = torch.zeros(1, 3)
    loss, clipped = clipped_surrogate(logp, old, torch.tensor([1.0]), clip_low=0.2)
    # ratio 1.5 with A>0 -> clipped to 1.2; ratio 0.5 with A>0 -> unclipped min(-0.5,-0.8) is max = -0.5
    assert loss.tolist()[0] == pytest.approx([-1.2, -0.5, -1.0])
    assert clipped.tolist() == [[True, False, False]]
    loss_neg, _ = clipped_surrogate(logp, old, torch.tensor([-1.0]), clip_low=0.2, clip_high=0.28)
    assert loss_neg.tolist()[0] == pytest.approx([1.5, 0.8, 1.0])


def test_kl_estimators():
    p = torch.tensor([[-1.0, -2.0]])
    q = torch.tensor([[-1.5, -2.0]])
    k3 = kl_penalty(p, q, "k3")
    assert k3[0, 0].item() == pytest.approx(torch.exp(torch.tensor(-0.5)).item() + 0.5 - 1)
    assert k3[0, 1].item() == 0.0
    assert kl_penalty(p, q, "k1")[0, 0].item() == pytest.approx(0.5)
    assert kl_penalty(p, q, "k2")[0, 0].item() == pytest.approx(0.125)
    big = kl_penalty(torch.tensor([[0.0]]), torch.tensor([[50.0]]), "low_var_kl")
    assert big.item() == 10.0
    with pytest.raises(ValueError, match="kind"):
        kl_penalty(p, q, "k4")


def test_token_logprobs_and_shape_errors():
    logits = torch.randn(2, 3, 5)
    targets = torch.randint(0, 5, (2, 3))
    lp = token_logprobs(logits, targets)
    ref = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    assert torch.allclose(lp, ref)
    with pytest.raises(ValueError, match="same shape"):
        aggregate_loss(torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="mode must be one of"):
        aggregate_loss(torch.zeros(2, 3), torch.zeros(2, 3), "mean")
    with pytest.raises(ValueError, match="global_num_tokens must be > 0"):
        aggregate_loss(torch.zeros(2, 3), torch.zeros(2, 3), global_num_tokens=0)


def test_weighted_aggregation_by_hand_and_unit_weights():
    loss, mask = _batch()
    w = torch.tensor([2.0, 0.5, 3.0])
    # token-mean: weighted token sum over the (HT) weighted token count, or a given count
    assert aggregate_loss(loss, mask, "token-mean", weights=w).item() == pytest.approx((2 * 6 + 0.5 * 4) / (2 * 3 + 0.5))
    assert aggregate_loss(loss, mask, "token-mean", weights=w, global_num_tokens=8).item() == pytest.approx(14 / 8)
    assert aggregate_loss(loss, mask, "seq-mean-token-mean", weights=w).item() == pytest.approx((2 * 2 + 0.5 * 4) / 2.5)
    assert aggregate_loss(loss, mask, "seq-mean-token-sum", weights=w, global_num_seqs=5).item() == pytest.approx(
        (2 * 6 + 0.5 * 4) / 5)
    ones = torch.ones(3)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        assert aggregate_loss(loss, mask, mode, weights=ones).item() == pytest.approx(
            aggregate_loss(loss, mask, mode).item())
    with pytest.raises(ValueError, match="weights must be a \\[N\\] tensor for 3 sequences"):
        aggregate_loss(loss, mask, weights=torch.ones(2))
    with pytest.raises(ValueError, match="finite and >= 0"):
        aggregate_loss(loss, mask, weights=torch.tensor([1.0, -1.0, 1.0]))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_weighted_kept_loss_is_unbiased_for_the_full_batch_loss(mode):
    """Importance-pruned, weighted, with the full batch's denominators: the mean over many
    seeded draws of the kept-set loss is the full-batch loss (within 3 standard errors)."""
    from cppo_megatron import CPPOConfig
    from cppo_megatron.core import prune

    gen = torch.Generator().manual_seed(1)
    rewards = torch.tensor([1.0, 0, 0, 1, 0, 0, 0, 0, 1, 1, 1, 0.5, 0, 0, 0, 0])
    gids = torch.arange(16) // 8
    mask = (torch.rand(16, 5, generator=gen) < 0.7).float()
    mask[:, 0] = 1
    x = torch.randn(16, 5, generator=gen)
    cfg = CPPOConfig(metric="importance", keep_per_group=2, seed=9)
    est = []
    for step in range(600):
        res = prune(rewards, gids, cfg, step=step)
        adv = res.advantages
        # a policy-gradient-shaped per-token loss, correlated with the sign of A so that the
        # full sum is far from 0 and a missing or wrong weight shows
        per_token = adv.unsqueeze(1) * (x + 2 * adv.sign().unsqueeze(1))
        kept = res.selection.kept
        kw = {"global_num_tokens": float(mask.sum())} if mode == "token-mean" else {"global_num_seqs": 16.0}
        est.append(float(aggregate_loss(per_token[kept], mask[kept], mode, weights=res.selection.weights, **kw)))
    full = float(aggregate_loss(per_token, mask, mode))
    est_t = torch.tensor(est, dtype=torch.float64)
    se = float(est_t.std()) / len(est) ** 0.5
    assert abs(float(est_t.mean()) - full) <= 3 * se, (float(est_t.mean()), full, se)


def test_clipped_surrogate_takes_an_advantage_per_token():
    # ratios [[1.5, 0.5], [1.0, 1.1]], a different advantage on every token
    logp = torch.log(torch.tensor([[1.5, 0.5], [1.0, 1.1]]))
    adv = torch.tensor([[1.0, -1.0], [2.0, 0.5]])
    loss, clipped = clipped_surrogate(logp, torch.zeros(2, 2), adv, clip_low=0.2)
    # (0,0): A 1, r 1.5 -> clip 1.2: -1.2; (0,1): A -1, r 0.5 -> clip 0.8: 0.8; row 1 inside the range: -A r
    assert loss.tolist()[0] == pytest.approx([-1.2, 0.8])
    assert loss.tolist()[1] == pytest.approx([-2.0, -0.55])
    assert clipped.tolist() == [[True, True], [False, False]]
    with pytest.raises(ValueError, match=r"advantages \(2, 3\) must be \[N\] or \(2, 2\)"):
        clipped_surrogate(logp, torch.zeros(2, 2), torch.zeros(2, 3))
