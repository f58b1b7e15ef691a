"""prune_and_exchange on 4 real gloo processes: uneven inputs (one rank empty, one with no
survivors), groups spanning ranks, ragged and dense fields; checked against a
single-process reference computed from the same generated data."""

import math

import numpy as np
import pytest
import torch

from cppo_megatron import CPPOConfig
from cppo_megatron.core import balance_partitions, prune, sequence_workload
from cppo_megatron.distributed import make_plan, prune_and_exchange, rank_wait_metrics, run_local
from cppo_megatron.distributed.exchange import GlobalMetadata

COUNTS = [7, 0, 5, 9]  # rank 1 holds nothing
GROUP = 3  # groups of 3 consecutive global rows: group 2 spans ranks 0 and 2


def global_data(seed=0):
    n = sum(COUNTS)
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 40, (n,), generator=g)
    rewards = torch.rand(n, generator=g, dtype=torch.float64)
    rewards[6:12] = 0.5  # groups 2 and 3 have no signal: rank 2 (rows 7..11) keeps nothing
    tokens = [torch.randint(0, 1000, (int(L),), generator=g) for L in lengths]
    logp = [-torch.rand(int(L), generator=g) for L in lengths]
    mask = torch.rand(n, 8, generator=g) > 0.3
    extra = torch.randn(n, 2, 3, generator=g, dtype=torch.float64)
    group_ids = torch.arange(n) // GROUP + 100
    return dict(lengths=lengths, rewards=rewards, tokens=tokens, logp=logp, mask=mask, extra=extra, group_ids=group_ids)


def local_slice(d, rank):
    lo = sum(COUNTS[:rank])
    hi = lo + COUNTS[rank]
    return {k: (v[lo:hi] if isinstance(v, torch.Tensor) else v[lo:hi]) for k, v in d.items()}


def row_value(tokens):
    return float(tokens.sum()) + 0.25 * tokens.numel()


CONFIGS = {
    "batch": dict(pruning_rate=0.5, scope="batch", seed=3),
    "group_equal": dict(keep_per_group=2, scope="group", equal_size=True, seed=1),
    "no_rebalance": dict(pruning_rate=0.5, scope="batch", rebalance=False, seed=3),
    "importance": dict(metric="importance", keep_per_group=2, scope="group", seed=4),
}


# 4 ranks x 5 sequences, every one kept (P = 0), equal-size parts: the balancer's parts are
# [0 2 3 4 13], [7 16 17 18 19], [5 10 11 12 14], [1 6 8 9 15] (global indices; rank r holds
# 5r .. 5r+4). Each has one rank holding most of it: 4 of 5 on rank 0, 4 on rank 3, 4 on rank 2,
# 3 on rank 1. So part 0 goes to rank 0, part 1 to rank 3, part 2 to rank 2, part 3 to rank 1,
# and exactly 5 sequences move: 1 (0 -> 1), 5 (1 -> 2), 7 (1 -> 3), 13 (2 -> 0), 15 (3 -> 1).
DESIGNED_LENGTHS = [[117, 163, 195, 118, 7], [44, 131, 194, 34, 62], [39, 146, 167, 139, 178],
                    [185, 120, 154, 28, 80]]
DESIGNED_CFG = CPPOConfig(pruning_rate=0.0, equal_size=True)
DESIGNED_RECEIVED = [[0, 2, 3, 4, 13], [1, 6, 8, 9, 15], [5, 10, 11, 12, 14], [7, 16, 17, 18, 19]]


def majority_owner_assignment(parts, owners, world) -> list:
    """Reference for the balanced plan: rank -> the balancer part it trains. Parts go, largest
    overlap first, to the rank already holding most of their items (ties: lower part, then lower
    rank); each rank takes one part."""
    pairs = sorted((-int((owners[p] == r).sum()), i, r) for i, p in enumerate(parts) for r in range(world))
    out, used_parts = [None] * world, set()
    for _, i, r in pairs:
        if out[r] is None and i not in used_parts:
            out[r] = parts[i]
            used_parts.add(i)
    return out


def _worker(rank, world):
    d = local_slice(global_data(), rank)
    out = {}
    for name, kw in CONFIGS.items():
        cfg = CPPOConfig(**kw)
        fields = {"tokens": d["tokens"], "logp": d["logp"], "mask": d["mask"], "extra": d["extra"]}
        res = prune_and_exchange(fields, d["rewards"], d["group_ids"], d["lengths"], cfg, step=5)
        got = res.fields
        # what a log-prob pass would compute on the received rows
        dense = torch.tensor([row_value(t) for t in got["tokens"]], dtype=torch.float64)
        ragged = [2.0 * t for t in got["logp"]]
        out[name] = dict(
            global_index=res.global_index,
            fields=got,
            advantages=res.advantages,
            weights=res.weights,
            num_total=res.num_total,
            group_ids=res.group_ids,
            loads=res.handle.plan.loads,
            loads_without=res.handle.plan.loads_unbalanced,
            local_kept=res.handle.local_kept,
            back_dense=res.handle.return_to_owners(dense),
            back_ragged=res.handle.return_to_owners(ragged),
            metrics=res.metrics,
        )
    out["wait"] = rank_wait_metrics(float(rank + 1))
    # the hand-checked balanced plan (test_balanced_parts_go_to_the_rank_holding_most_of_them)
    lengths = torch.tensor(DESIGNED_LENGTHS[rank])
    ids = [torch.tensor([5 * rank + i]) for i in range(len(lengths))]  # each row names its global index
    res = prune_and_exchange({"id": ids}, torch.rand(len(lengths), dtype=torch.float64),
                             torch.full((len(lengths),), rank), lengths, DESIGNED_CFG, step=0)
    out["designed"] = dict(global_index=res.global_index, ids=[int(t) for t in res.fields["id"]],
                           dest=res.handle.plan.dest, method=res.handle.plan.method,
                           transfers=res.handle.plan.transfer_counts(), metrics=res.metrics)
    return out


@pytest.fixture(scope="module")
def results():
    return run_local(_worker, len(COUNTS), timeout=120)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_exchange_preserves_moves_and_returns(results, name):
    d = global_data()
    cfg = CPPOConfig(**CONFIGS[name])
    ref = prune(d["rewards"], d["group_ids"], cfg, step=5)
    kept = ref.selection.kept
    world = len(COUNTS)
    per_rank = [r[name] for r in results]

    # every rank decided the same plan, identical to a one-process decision on the whole batch
    received = torch.cat([r["global_index"] for r in per_rank])
    assert sorted(received.tolist()) == kept.tolist(), "a survivor was lost or duplicated"
    for r in per_rank[1:]:
        np.testing.assert_array_equal(r["loads"], per_rank[0]["loads"])

    work = sequence_workload(d["lengths"].double())
    for rank, r in enumerate(per_rank):
        gi = r["global_index"]
        assert gi.tolist() == sorted(gi.tolist()), "received rows must be in global order"
        # contents travelled intact, ragged and dense, every dtype
        assert len(r["fields"]["tokens"]) == gi.numel()
        for j, i in enumerate(gi.tolist()):
            assert torch.equal(r["fields"]["tokens"][j], d["tokens"][i])
            assert torch.equal(r["fields"]["logp"][j], d["logp"][i])
        assert torch.equal(r["fields"]["mask"], d["mask"][gi])
        assert torch.equal(r["fields"]["extra"], d["extra"][gi])
        assert r["fields"]["mask"].dtype == torch.bool
        torch.testing.assert_close(r["advantages"], ref.advantages[gi].float())
        # the loss weights of the received rows are the one-process selection's (1/pi)
        pos = torch.searchsorted(kept, gi)
        assert torch.equal(r["weights"], ref.selection.weights[pos])
        assert r["num_total"] == sum(COUNTS)
        assert torch.equal(r["group_ids"], d["group_ids"][gi])
        # the workload this rank holds is the planned one
        assert math.isclose(float(work[gi].sum()), float(r["loads"][rank]), rel_tol=1e-12, abs_tol=1e-9)

        # results come back to their owners in the original order; pruned rows get the fill
        lo = sum(COUNTS[:rank])
        mine_kept = [i - lo for i in kept.tolist() if lo <= i < lo + COUNTS[rank]]
        assert r["local_kept"].tolist() == mine_kept
        back = r["back_dense"]
        assert back.shape == (COUNTS[rank],)
        for i in range(COUNTS[rank]):
            if i in mine_kept:
                assert back[i].item() == row_value(d["tokens"][lo + i])
                assert torch.equal(r["back_ragged"][i], 2.0 * d["logp"][lo + i])
            else:
                assert math.isnan(back[i].item()) and r["back_ragged"][i] is None

    loads = per_rank[0]["loads"]
    without = per_rank[0]["loads_without"]
    owner_load = [float(work[[i for i in kept.tolist() if sum(COUNTS[:s]) <= i < sum(COUNTS[: s + 1])]].sum())
                  for s in range(world)]
    np.testing.assert_allclose(without, owner_load)
    if name == "no_rebalance":
        np.testing.assert_allclose(loads, without)
    else:
        assert loads.max() < without.max(), "rebalancing must lower the largest rank workload here"
    if name == "batch":
        # the uneven case the issue names: rank 1 had no rows, rank 2 no survivors
        assert per_rank[0]["metrics"]["cppo/exchange_imbalance"] < per_rank[0]["metrics"]["cppo/exchange_imbalance_without"]
        assert without[1] == 0 and without[2] == 0
        assert per_rank[1]["global_index"].numel() > 0 and per_rank[2]["global_index"].numel() > 0
    if name == "importance":  # known weights: 1/pi > 1 for the sampled rows of the signal groups
        w = torch.cat([r["weights"] for r in per_rank])
        assert bool((w >= 1).all()) and bool((w > 1).any())
    if name == "group_equal":  # the balancer's equal-size parts, each on the rank holding most of it
        sizes = [r["global_index"].numel() for r in per_rank]
        assert max(sizes) - min(sizes) <= 1
        owners = torch.repeat_interleave(torch.arange(world), torch.tensor(COUNTS))[kept]
        part = balance_partitions(work[kept], world, equal_size=True)
        want = majority_owner_assignment([torch.tensor(p, dtype=torch.int64) for p in part.parts], owners, world)
        got = [r["global_index"].tolist() for r in per_rank]
        assert got == [sorted(kept[p].tolist()) for p in want]
        stay = sum(int((owners[p] == rank).sum()) for rank, p in enumerate(want))
        assert per_rank[0]["metrics"]["cppo/exchange_moved_sequences"] == kept.numel() - stay
        assert per_rank[0]["metrics"]["cppo/exchange_keep_local_plan"] == 0.0


def test_balanced_parts_go_to_the_rank_holding_most_of_them(results):
    """The balanced plan (equal-size parts) on 4 real gloo ranks, by value: which rank gets which
    rows, the rows themselves, and how many sequences move (DESIGNED_* above)."""
    d = [r["designed"] for r in results]
    lengths = torch.tensor(sum(DESIGNED_LENGTHS, []))
    part = balance_partitions(sequence_workload(lengths.double()), 4, equal_size=True)
    assert part.parts == [[0, 2, 3, 4, 13], [7, 16, 17, 18, 19], [5, 10, 11, 12, 14], [1, 6, 8, 9, 15]]
    assert [r["method"] for r in d] == ["balanced"] * 4
    assert [r["global_index"].tolist() for r in d] == DESIGNED_RECEIVED
    assert [r["ids"] for r in d] == DESIGNED_RECEIVED  # the rows themselves travelled there
    assert d[0]["dest"].tolist() == [0, 1, 0, 0, 0, 2, 1, 3, 1, 1, 2, 2, 2, 0, 2, 1, 3, 3, 3, 3]
    assert d[0]["transfers"].tolist() == [[4, 1, 0, 0], [0, 3, 1, 1], [1, 0, 4, 0], [0, 1, 0, 4]]
    assert [r["metrics"]["cppo/exchange_moved_sequences"] for r in d] == [5.0] * 4
    assert d[0]["metrics"]["cppo/exchange_kept_sequences"] == 20.0


def test_rank_wait_metrics(results):
    # ranks took 1, 2, 3, 4 s: they wait 3, 2, 1, 0 s for the slowest
    for r in results:
        w = r["wait"]
        assert w["cppo/rank_time_max"] == 4.0 and w["cppo/rank_time_mean"] == 2.5
        assert w["cppo/rank_wait_max"] == 3.0 and w["cppo/rank_wait_mean"] == 1.5
        assert w["cppo/rank_wait_fraction"] == pytest.approx(6.0 / 16.0)
        assert w["cppo/rank_time_imbalance"] == pytest.approx(1.6)


def test_plan_rejects_bad_kept():
    meta = GlobalMetadata([2, 1], torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.int64),
                          torch.ones(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="duplicates"):
        make_plan(meta, [0, 0], CPPOConfig())
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        make_plan(meta, [5], CPPOConfig())


def test_plan_keeps_survivors_local_when_balance_allows():
    # 64 ranks, 100k long-tailed sequences: the keep-local plan must balance as well as the
    # balancer (within the tolerance) while moving a small share of the survivors
    w, per = 64, 1500
    n = w * per
    g = torch.Generator().manual_seed(0)
    meta = GlobalMetadata([per] * w, torch.rand(n, generator=g, dtype=torch.float64), torch.arange(n) // 16,
                          torch.exp(6 + torch.randn(n, generator=g)).clamp(8, 16384).long())
    cfg = CPPOConfig(pruning_rate=0.875)
    kept = prune(meta.rewards, meta.group_ids, cfg).selection.kept
    local = make_plan(meta, kept, cfg)
    best = make_plan(meta, kept, cfg, move_tolerance=0.0)
    spread = make_plan(meta, kept, CPPOConfig(pruning_rate=0.875, equal_size=True))
    for plan in (local, best, spread):
        assert torch.equal((plan.dest >= 0).nonzero().squeeze(1), kept)  # survivors placed, pruned not
    m = local.metrics()
    assert local.method == "keep-local" and m["cppo/exchange_keep_local_plan"] == 1.0
    assert m["cppo/exchange_imbalance"] <= 1.01 * best.metrics()["cppo/exchange_imbalance"]
    assert m["cppo/exchange_imbalance"] < 0.85 * m["cppo/exchange_imbalance_without"]
    assert m["cppo/exchange_moved_sequences"] < 0.3 * kept.numel()
    assert spread.method == "balanced"
    np.testing.assert_allclose(local.loads.sum(), local.loads_unbalanced.sum())
