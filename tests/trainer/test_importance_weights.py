"""Importance weights reach the embedded trainer's loss; keep_mass fills the capacity."""

import copy

import pytest
import torch

from cppo_megatron.core import group_advantages, inclusion_probabilities, prune
from cppo_megatron.trainer import Trainer
from cppo_megatron.trainer.policy import HFPolicy, KeptBatch, forward_logprobs


def _grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def test_weights_reach_the_update_loss(micro_recipe):
    """A weight of 2 on a row gives the gradient of that row appearing twice, and the loss
    is the hand-computed weighted token sum over the given (full-batch) token count."""
    t = Trainer(micro_recipe("train.grad_clip=0", "train.loss_agg=token-mean"))
    tok = t.tok
    prompts = [tok.prompt_ids("12+34="), tok.prompt_ids("56-7="), tok.prompt_ids("56-7=")]
    comps = [[5, 6, tok.eos_id], [7, tok.eos_id], [4, 4, 4, 4]]
    adv, _ = group_advantages(torch.tensor([1.0, 0.0, 0.5]), torch.tensor([0, 0, 0]))
    full_tokens = 20.0  # the denominator importance passes: tokens of the whole generated batch

    def policy():
        return HFPolicy(copy.deepcopy(t.model), device=t.device, pad_id=tok.pad_id, train_cfg=t.r.train, total_steps=1)

    weighted = policy()
    w = torch.tensor([2.0, 1.0, 0.5])
    lp = [forward_logprobs(weighted.model, KeptBatch(prompts, comps), [i], tok.pad_id, t.device)[0, : len(comps[i])]
          for i in range(3)]
    by_hand = sum(float(-adv[i] * w[i] * len(lp[i])) for i in range(3)) / full_tokens  # ratio 1: -A per token
    m = weighted.update(KeptBatch(prompts, comps), [[0], [1, 2]], adv, None, None, norm_constant=4.0,
                        weights=w, num_tokens=full_tokens)
    assert m.iterations[0]["loss"] == pytest.approx(by_hand, rel=1e-5)
    g_weighted = _grads(weighted.model)

    dup = policy()  # row 0 twice and row 2 at half weight, written out by hand
    dup_batch = KeptBatch([prompts[0], prompts[0], prompts[1], prompts[2]], [comps[0], comps[0], comps[1], comps[2]])
    dup_adv = torch.stack([adv[0], adv[0], adv[1], 0.5 * adv[2]])
    dup.update(dup_batch, [[0, 1, 2, 3]], dup_adv, None, None, norm_constant=4.0, num_tokens=full_tokens)
    assert torch.allclose(g_weighted, _grads(dup.model), atol=1e-6, rtol=1e-4)
    with pytest.raises(ValueError, match=r"weights \(2,\) must be \[3\]"):
        policy().update(KeptBatch(prompts, comps), [[0, 1, 2]], adv, None, None, norm_constant=4.0,
                        weights=torch.ones(2))


def expected_importance(batch, cfg, k: int) -> tuple[torch.Tensor, float, float]:
    """From first principles, for a step's ``RolloutBatch``: [N] 1/pi of every row (pi
    proportional to |A| within its group of G, summing to k, capped at 1), and the full
    generated batch's (response tokens, rows) — every valid row, kept or pruned."""
    rows = batch.valid_rows
    G = batch.group_size
    adv, _ = group_advantages(batch.rewards[rows], batch.group_ids[rows], eps=cfg.eps)
    scores = adv.abs().double().reshape(-1, G)
    pi = inclusion_probabilities(scores, torch.ones_like(scores, dtype=torch.bool),
                                 torch.full((scores.shape[0],), k, dtype=torch.int64))
    inv = torch.full((batch.num_rows,), float("nan"), dtype=torch.float64)
    inv[rows] = 1.0 / pi.reshape(-1)
    return inv, float(batch.completion_lengths[rows].sum()), float(rows.numel())


def ht_token_mean_loss(advantages, weights, tokens, full_tokens: float) -> float:
    """The first update of a step (ratio 1: the behaviour policy is the current one, so the
    clipped surrogate is -A per token): the Horvitz-Thompson token mean
    sum_i w_i (-A_i) T_i over the full batch's tokens."""
    return sum(-float(a) * float(w) * int(t) for a, w, t in zip(advantages, weights, tokens)) / full_tokens


def test_trainer_passes_selection_weights_and_full_denominators(micro_recipe, monkeypatch):
    """HF backend, metric=importance, P = 0.5 of G = 4 (k = 2): the update receives, row by row,
    the 1/pi of the survivor it trains (computed here from the step's rewards) and the whole
    generated batch's token and row counts, and its loss is the HT loss with them."""
    import cppo_megatron.trainer.loop as loop

    t = Trainer(micro_recipe("cppo.metric=importance", "cppo.pruning_rate=0.5", "rollout.group_size=4"))
    t.prepare(initial_eval=False)
    seen = {}
    real_select = loop.select_survivors

    def spy_select(batch, cfg, planner, *, step):
        seen["surv"] = real_select(batch, cfg, planner, step=step)
        seen["batch"] = batch
        return seen["surv"]

    real_update = t.policy.hf.update

    def spy_update(batch, mbs, adv, old, ref, **kw):
        seen["kw"], seen["kept_batch"], seen["adv"] = kw, batch, adv
        return real_update(batch, mbs, adv, old, ref, **kw)

    monkeypatch.setattr(loop, "select_survivors", spy_select)
    monkeypatch.setattr(t.policy.hf, "update", spy_update)
    rec = t.step_once()
    batch, surv, kw = seen["batch"], seen["surv"], seen["kw"]
    inv_pi, full_tokens, full_rows = expected_importance(batch, t.r.cppo, k=2)
    kept = surv.kept
    assert seen["kept_batch"].completions == [batch.completions[i] for i in kept.tolist()]  # row i = kept[i]
    got = kw.get("weights")  # None (or missing): the update would weigh every survivor 1
    assert ([] if got is None else got.tolist()) == pytest.approx(inv_pi[kept].tolist(), rel=1e-6)
    assert max(inv_pi[kept].tolist()) >= 2.0  # P = 0.5: every pi <= 1/2 except where |A| forces certainty
    # the denominators are the full generated batch's, not the kept set's
    kept_tokens = sum(len(c) for c in seen["kept_batch"].completions)
    assert (kw.get("num_tokens"), kw.get("num_seqs")) == (full_tokens, full_rows) == (
        float(batch.completion_lengths.sum()), float(batch.num_rows))
    assert full_tokens > kept_tokens and rec["cppo/num_completions"] == full_rows == 32.0
    want = ht_token_mean_loss(seen["adv"], inv_pi[kept], [len(c) for c in seen["kept_batch"].completions],
                              full_tokens)
    assert rec["train/loss"] == pytest.approx(want, rel=1e-5, abs=1e-7)


def test_keep_mass_trains_with_fill_rounds(micro_recipe):
    """f = 0.3 keeps about one completion per group with signal, none of the flat groups: the
    first round (planned at G/2 = 2 survivors per prompt) cannot fill the capacity of 16, so
    fill rounds draw more prompts, and they stop at the first round after which the
    survivors (recomputed here over the prompts drawn so far) reach the capacity — not
    before, not later, and well within max_refill_rounds."""
    import cppo_megatron.trainer.loop as loop

    t = Trainer(micro_recipe("cppo.pruning_rate=null", "cppo.keep_mass=0.3", "rollout.group_size=4",
                             "train.steps=2"))
    t.prepare(initial_eval=False)
    batches, draws = [], []
    real_select, real_draw = loop.select_survivors, t.sampler.draw

    def select(batch, cfg, planner, *, step):
        batches.append(batch)
        return real_select(batch, cfg, planner, step=step)

    def draw(n):
        draws[-1].append(n)
        return real_draw(n)

    loop.select_survivors, t.sampler.draw = select, draw
    try:
        recs = []
        for _ in range(2):
            draws.append([])
            recs.append(t.step_once())
    finally:
        loop.select_survivors = real_select
    assert recs[0]["alloc/prompts_planned"] == 8 and recs[0]["alloc/fill_rounds"] >= 1
    G, capacity, limit = 4, 16, t.r.cppo.max_refill_rounds
    for rec, batch, rounds in zip(recs, batches, draws):
        step = int(rec["step"]) - 1

        def kept_after(prompts: int) -> int:  # the keep_mass selection over the first `prompts` prompts
            rows = torch.arange(prompts * G)
            return int(prune(batch.rewards[rows], rows // G, t.r.cppo, step=step).selection.num_kept)

        drawn = [sum(rounds[: i + 1]) for i in range(len(rounds))]
        assert (rounds[0], len(rounds) - 1, drawn[-1]) == (rec["alloc/prompts_planned"], rec["alloc/fill_rounds"],
                                                           rec["alloc/prompts_drawn"])
        assert rec["alloc/fill_rounds"] < limit  # stopped because full, not at the limit
        assert kept_after(drawn[-1]) == rec["cppo/num_kept"] >= capacity
        assert [kept_after(d) < capacity for d in drawn[:-1]] == [True] * (len(drawn) - 1)  # each earlier round fell short
        assert rec["alloc/prompts_drawn"] * G == rec["cppo/num_completions"]
        assert rec["cppo/kept_per_group_max"] <= G and rec["cppo/weight_max"] == 1.0


def _megatron_importance_worker(rank, world, root):
    """One importance step on DP 2 (backend=megatron): what the step decided and what
    reached ``MegatronActor.update`` on this rank."""
    import cppo_megatron.trainer.loop as loop
    from cppo_megatron.megatron import MegatronActor
    from cppo_megatron.trainer.backends.megatron import MegatronBackend
    from cppo_megatron.trainer.config import load_recipe
    from tests.recipes import MICRO

    seen: dict = {}
    real_select, real_update, real_place = loop.select_survivors, MegatronActor.update, MegatronBackend.place

    def select(batch, cfg, planner, *, step):
        surv = real_select(batch, cfg, planner, step=step)
        seen["surv"], seen["batch"] = surv, batch
        return surv

    def update(self, sequences, masks, advantages, *a, **kw):
        seen["kw"], seen["n"] = kw, len(sequences)
        seen["adv"], seen["tokens"] = torch.as_tensor(advantages).tolist(), [int(m.sum()) for m in masks]
        return real_update(self, sequences, masks, advantages, *a, **kw)

    def place(self, *a, **kw):
        seen["rows"] = real_place(self, *a, **kw)
        return seen["rows"]

    loop.select_survivors = select
    MegatronActor.update = update
    MegatronBackend.place = place
    try:
        over = [o for o in MICRO if not o.startswith("train.steps")]
        t = Trainer(load_recipe(None, over + ["backend=megatron", "megatron.tp=1", "megatron.pp=1", "train.steps=1",
                                              "cppo.metric=importance", f"out_dir={root}"]))
        t.prepare(initial_eval=False)
        rec = t.step_once()
    finally:
        loop.select_survivors, MegatronActor.update, MegatronBackend.place = real_select, real_update, real_place
    surv, batch, kw = seen["surv"], seen["batch"], seen["kw"]
    inv_pi, full_tokens, full_rows = expected_importance(batch, t.r.cppo, k=2)  # MICRO: P = 0.5 of G = 4
    rows = seen["rows"].rows
    got = kw.get("weights")
    return {"weights": [] if got is None else torch.as_tensor(got).tolist(), "n": seen["n"],
            "full": kw.get("full_denominators"), "rows": rows.tolist(), "expected_weights": inv_pi[rows].tolist(),
            "expected_full": (full_tokens, full_rows), "all_expected": inv_pi[surv.kept].tolist(),
            "adv": seen["adv"], "tokens": seen["tokens"], "loss": rec["train/loss"], "num_kept": rec["cppo/num_kept"]}


def test_megatron_backend_passes_importance_weights_and_full_denominators(tmp_path):
    """backend=megatron (DP 2): each rank's update gets the 1/pi weights (computed here from the
    step's rewards) of exactly the survivors it received and the full generated batch's
    (tokens, sequences), and the step's loss is the HT loss over both ranks with them."""
    pytest.importorskip("megatron.core")
    from cppo_megatron.distributed import run_local

    results = run_local(_megatron_importance_worker, 2, tmp_path / "run", timeout=300)
    received = sorted(w for r in results for w in r["weights"])
    assert received == pytest.approx(sorted(results[0]["all_expected"]), rel=1e-6)  # every survivor once
    assert sum(r["n"] for r in results) == results[0]["num_kept"] == len(results[0]["all_expected"])
    assert max(received) > 1.0  # P = 0.5 of G = 4: some pi < 1
    for r in results:
        assert r["weights"] == pytest.approx(r["expected_weights"], rel=1e-6)  # aligned with its rows
        assert r["full"] == r["expected_full"] == results[0]["expected_full"]
        assert r["full"][1] == 32.0  # every generated row, kept or pruned: 16 / k=2 prompts x G=4
    want = sum(-a * w * t for r in results for a, w, t in zip(r["adv"], r["expected_weights"], r["tokens"]))
    want /= results[0]["expected_full"][0]
    for r in results:
        assert r["loss"] == pytest.approx(want, rel=1e-4, abs=1e-6)
