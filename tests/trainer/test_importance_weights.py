"""Importance weights reach the embedded trainer's loss; keep_mass fills the capacity."""

import copy

import pytest
import torch

from cppo_megatron.core import group_advantages
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


def test_trainer_passes_selection_weights_and_full_denominators(micro_recipe, monkeypatch):
    t = Trainer(micro_recipe("cppo.metric=importance", "cppo.pruning_rate=0.5", "rollout.group_size=4"))
    t.prepare(initial_eval=False)
    seen = {}
    from cppo_megatron.trainer import step as step_module

    real_prune = step_module.prune

    def spy_prune(*a, **k):
        res = real_prune(*a, **k)
        seen["selection"] = res.selection
        return res

    real_update = t.policy.hf.update

    def spy_update(batch, mbs, adv, old, ref, **kw):
        seen["kw"] = kw
        seen["batch"] = batch
        return real_update(batch, mbs, adv, old, ref, **kw)

    monkeypatch.setattr(step_module, "prune", spy_prune)
    monkeypatch.setattr(t.policy.hf, "update", spy_update)
    rec = t.step_once()
    sel, kw = seen["selection"], seen["kw"]
    assert torch.equal(kw["weights"], sel.weights) and sel.weighted
    assert kw["num_seqs"] == rec["cppo/num_completions"] == sel.num_total
    assert kw["num_tokens"] >= sum(len(c) for c in seen["batch"].completions)
    assert float(sel.weights.min()) >= 1.0  # 1/pi


def test_keep_mass_trains_with_fill_rounds(micro_recipe):
    # f = 0.3 keeps about one completion per group with signal, none of the flat groups: the
    # first round (planned at G/2 = 2 survivors per prompt) cannot fill the capacity of 16
    t = Trainer(micro_recipe("cppo.pruning_rate=null", "cppo.keep_mass=0.3", "rollout.group_size=4",
                             "train.steps=2"))
    t.prepare(initial_eval=False)
    first = t.step_once()
    assert first["alloc/prompts_planned"] == 8 and first["alloc/fill_rounds"] >= 1
    assert first["alloc/prompts_drawn"] > 8
    for rec in (first, t.step_once()):
        # the fill rounds stop when the survivors fill the capacity (16) or after max_refill_rounds
        assert rec["cppo/num_kept"] >= 16 or rec["alloc/fill_rounds"] == t.r.cppo.max_refill_rounds
        assert rec["alloc/prompts_drawn"] * 4 == rec["cppo/num_completions"]
        assert rec["cppo/kept_per_group_max"] <= 4 and rec["cppo/weight_max"] == 1.0


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
    valid = batch.valid_rows
    return {"weights": kw["weights"].tolist(), "n": seen["n"], "full": kw["full_denominators"],
            "row_weights": surv.weights[seen["rows"].rows].tolist(),
            "expected_full": (float(batch.completion_lengths[valid].sum()), float(valid.numel())),
            "sel_weights": sorted(surv.prune.selection.weights.tolist()), "num_kept": rec["cppo/num_kept"]}


def test_megatron_backend_passes_importance_weights_and_full_denominators(tmp_path):
    """backend=megatron (DP 2): each rank's update gets the 1/pi weights of exactly the
    survivors it received and the full generated batch's (tokens, sequences)."""
    pytest.importorskip("megatron.core")
    from cppo_megatron.distributed import run_local

    results = run_local(_megatron_importance_worker, 2, tmp_path / "run", timeout=300)
    received = sorted(w for r in results for w in r["weights"])
    assert received == pytest.approx(results[0]["sel_weights"])  # every survivor once, with its 1/pi
    assert sum(r["n"] for r in results) == results[0]["num_kept"]
    assert max(received) > 1.0  # P = 0.5 of G = 4: some pi < 1
    for r in results:
        assert r["weights"] == r["row_weights"]  # aligned with the rows this rank received
        assert r["full"] == r["expected_full"] == results[0]["expected_full"]
        assert r["full"][1] == 32.0  # every generated row, kept or pruned: 16 / k=2 prompts x G=4
