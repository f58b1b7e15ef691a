from pathlib import Path

import pytest
import torch

from cppo_megatron.core import group_advantages
from cppo_megatron.trainer import Trainer
from cppo_megatron.trainer.config import load_recipe
from cppo_megatron.trainer.logger import read_metrics
from cppo_megatron.trainer.policy import KeptBatch, forward_logprobs, micro_batches
from tests.recipes import recipe_path


def _steps(out_dir):
    return [r for r in read_metrics(out_dir / "metrics.jsonl") if r.get("kind") == "step"]


def test_two_step_run_writes_metrics_checkpoint_and_report(micro_recipe):
    recipe = micro_recipe("log.plots=true", "log.tensorboard=true")
    summary = Trainer(recipe).run()
    out_dir = Path(recipe.out_dir)
    steps = _steps(out_dir)
    assert [s["step"] for s in steps] == [1, 2]
    for phase in ("rollout", "reward", "cppo", "old_logprob", "ref_logprob", "update"):
        assert f"time/{phase}" in steps[0]
    # allocation: capacity 16, k = 2 of 4 -> 8 prompts, 32 generated, 16 trained
    assert steps[0]["alloc/prompts_drawn"] == 8 and steps[0]["cppo/num_kept"] == 16
    assert steps[-1]["alloc/total_completions_generated"] == 64
    assert (out_dir / "checkpoints" / "step_000002" / "trainer.pt").exists()
    assert (out_dir / "checkpoints" / "step_000002" / "policy_rank00000.pt").exists()
    assert (out_dir / "report.md").exists() and (out_dir / "report.png").exists()
    assert any((out_dir / "tensorboard").iterdir())
    assert summary["steps"] == 2 and 0.0 <= summary["accuracy_after"] <= 1.0


def test_pruned_completions_never_reach_the_expensive_passes(micro_recipe):
    recipe = micro_recipe("train.mu=2", "train.beta=0.04", "cppo.pruning_rate=0.75", "train.steps=3")
    trainer = Trainer(recipe)
    trainer.run()
    steps = _steps(Path(recipe.out_dir))
    kept = sum(s["cppo/num_kept"] for s in steps)
    generated = sum(s["cppo/num_completions"] for s in steps)
    assert kept == generated / 4  # k = 1 of 4
    assert trainer.policy.rows_seen["old_logprob"] == kept
    assert trainer.policy.rows_seen["ref_logprob"] == kept
    assert trainer.policy.rows_seen["update"] == 2 * kept  # mu = 2 passes over the kept rows


def test_grpo_p0_loss_equals_hand_computed_grpo_loss(micro_recipe):
    recipe = micro_recipe("cppo.pruning_rate=0.0", "train.beta=0.1", "train.kl_type=k3")
    trainer = Trainer(recipe)
    tok, model = trainer.tok, trainer.model
    gen = torch.Generator().manual_seed(0)
    prompts = [tok.prompt_ids("12+34="), tok.prompt_ids("56-7=")]
    completions = [[5, 6, tok.eos_id], [7, tok.eos_id], [4, 4, 4, 4], [tok.eos_id], [8, 9], [3, tok.eos_id]]
    rows_prompt = [prompts[0]] * 3 + [prompts[1]] * 3
    rewards = torch.rand(6, generator=gen)
    gids = torch.tensor([0, 0, 0, 1, 1, 1])
    adv, _ = group_advantages(rewards, gids)
    batch = KeptBatch(rows_prompt, completions)
    mbs = [[0, 1], [2, 3, 4, 5]]  # two micro-batches: the global denominator must still hold
    ref = torch.zeros(6, batch.max_completion) - 1.5
    # by hand: one sequence at a time, token-mean over ALL completion tokens of the batch
    total, ntok = 0.0, sum(len(c) for c in completions)
    for i in range(6):
        lp = forward_logprobs(model, batch, [i], tok.pad_id, trainer.device)[0, : len(completions[i])]
        ratio = torch.exp(lp - lp.detach())
        pg = -adv[i] * ratio  # no clipping at ratio 1
        k3 = torch.exp(ref[i, : len(completions[i])] - lp) - (ref[i, : len(completions[i])] - lp) - 1
        total = total + (pg + 0.1 * k3).sum()
    by_hand = float(total) / ntok
    res = trainer.policy.hf.update(batch, mbs, adv, None, ref, norm_constant=4.0)
    assert res.iterations[0]["loss"] == pytest.approx(by_hand, rel=1e-5)


def test_resume_continues_the_same_run(micro_recipe, tmp_path):
    full = micro_recipe("train.steps=4", f"out_dir={tmp_path / 'full'}")
    Trainer(full).run()
    part = micro_recipe("train.steps=4", "log.checkpoint_every=2", f"out_dir={tmp_path / 'part'}")
    t = Trainer(part)
    real_step = t._rl_step

    def crash_after_two():
        if t.step == 2:
            raise KeyboardInterrupt  # as Ctrl-C would
        return real_step()

    t._rl_step = crash_after_two
    result = t.run()
    assert result["interrupted"] and result["step"] == 2
    Trainer(part, resume=True).run()
    a, b = _steps(tmp_path / "full"), _steps(tmp_path / "part")
    assert [s["step"] for s in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):
        for key in ("reward/mean", "alloc/total_prompts_drawn", "cppo/num_kept", "train/loss", "data/epoch"):
            assert ra[key] == pytest.approx(rb[key], rel=1e-5, abs=1e-7), (ra["step"], key)


def test_unknown_and_bad_recipe_keys_are_named(micro_recipe):
    with pytest.raises(ValueError, match="cppo.pruning_rat"):
        load_recipe(None, ["cppo.pruning_rat=0.5"])
    with pytest.raises(ValueError, match="train.lrr"):
        load_recipe(None, ["train.lrr=1"])
    with pytest.raises(ValueError, match="train.capacity"):
        load_recipe(None, ["train.capacity=abc"])
    with pytest.raises(ValueError, match="rollout.engine"):
        load_recipe(None, ["rollout.engine=tgi"])
    with pytest.raises(ValueError, match="pruning_rate"):
        load_recipe(None, ["cppo.pruning_rate=1.0"])
    with pytest.raises(ValueError, match="keep_per_group=20 is larger"):
        load_recipe(None, ["cppo.keep_per_group=20"])


def test_shipped_recipes_load():
    for name in ("tiny_cpu", "tiny_cpu_grpo", "smollm2_cpu"):
        r = load_recipe(recipe_path(name))
        assert r.rollout.group_size >= 2
    assert load_recipe(recipe_path("tiny_cpu_grpo")).cppo.pruning_rate == 0.0


def test_without_allocation_fewer_completions_train(micro_recipe):
    recipe = micro_recipe("cppo.allocation=false")
    Trainer(recipe).run()
    s = _steps(Path(recipe.out_dir))[0]
    assert s["alloc/prompts_drawn"] == 4 and s["cppo/num_kept"] == 8  # capacity 16 / G 4; half kept


def test_micro_batches_respect_budget():
    batch = KeptBatch([[1, 2, 3]] * 5, [[4] * n for n in (1, 5, 2, 9, 3)])
    mbs = micro_batches(batch, 14)
    assert sorted(i for mb in mbs for i in mb) == list(range(5))
    counts = batch.token_counts
    assert all(sum(counts[i] for i in mb) <= 14 for mb in mbs)
    with pytest.raises(ValueError, match="completion 1 is empty"):
        KeptBatch([[1], [1]], [[2], []])


def test_dynamic_sampling_drops_zero_variance_groups(micro_recipe):
    recipe = micro_recipe("cppo.dynamic_sampling=true", "cppo.max_refill_rounds=2")
    t = Trainer(recipe)
    t.run()
    s = _steps(Path(recipe.out_dir))
    tot = s[-1]
    assert tot["alloc/total_prompts_drawn"] == (
        tot["alloc/total_prompts_trained"] + tot["alloc/total_prompts_fully_pruned"] + tot["alloc/total_prompts_dropped"]
    )
    assert tot["alloc/total_prompts_dropped"] > 0  # an untrained model gets many all-equal groups
