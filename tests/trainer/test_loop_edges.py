"""The trainer loop's branches the run tests did not reach (scripts/coverage_floor.py): the progress
bar, an evaluation between steps, the wall-time budget, a Megatron recipe outside torchrun, and
initial weights from a file; each pinned by the records or the message."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cppo_megatron.trainer import Trainer
from cppo_megatron.trainer.logger import read_metrics
from cppo_megatron.trainer.loop import load_weights


def _records(recipe, kind):
    return [r for r in read_metrics(Path(recipe.out_dir) / "metrics.jsonl") if r.get("kind") == kind]


@pytest.fixture
def keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_a_run_with_a_progress_bar_and_an_evaluation_every_step(micro_recipe, capfd, keep_threads):
    recipe = micro_recipe("log.progress=true", "eval.every=1", "train.steps=2", "threads=2")
    Trainer(recipe).run()
    assert [r["step"] for r in _records(recipe, "step")] == [1, 2]
    assert [r["step"] for r in _records(recipe, "eval")] == [0, 1, 2]  # before RL, after step 1, the final one
    err = capfd.readouterr().err
    assert "RL" in err and "2/2" in err and "kept=" in err and "reward=" in err  # the bar and its postfix
    assert torch.get_num_threads() == 2


def test_the_wall_time_budget_ends_the_run_before_its_steps(micro_recipe):
    recipe = micro_recipe("train.max_time_s=0.001", "train.steps=5")
    summary = Trainer(recipe).run()
    assert summary["steps"] == 1 and [r["step"] for r in _records(recipe, "step")] == [1]


def test_a_megatron_recipe_outside_torchrun_says_how_to_launch_it(micro_recipe):
    pytest.importorskip("megatron.core")
    assert not torch.distributed.is_initialized()
    with pytest.raises(ValueError, match=r"^backend='megatron' runs under torchrun: `cppo-megatron train RECIPE "
                                         r"--nproc N`"):
        Trainer(micro_recipe("backend=megatron"))


def test_initial_weights_come_from_a_file_or_its_model_entry(tmp_path):
    weights = {"w": torch.arange(3.0)}
    torch.save(weights, tmp_path / "warmup.pt")
    torch.save({"model": weights, "step": 4}, tmp_path / "final.pt")
    for name in ("warmup.pt", "final.pt"):
        assert torch.equal(load_weights(str(tmp_path / name))["w"], weights["w"])
    with pytest.raises(FileNotFoundError, match=f"^init_checkpoint {tmp_path / 'nope.pt'} does not exist$"):
        load_weights(str(tmp_path / "nope.pt"))


def test_a_run_from_initial_weights_starts_from_them(micro_recipe, tmp_path):
    first = micro_recipe("train.steps=1")
    Trainer(first).run()
    final = Path(first.out_dir) / "final.pt"
    recipe = micro_recipe(f"init_checkpoint={final}", "train.steps=1", f"out_dir={tmp_path / 'second'}")
    trainer = Trainer(recipe)
    trainer.prepare()
    start = load_weights(str(final))
    assert all(torch.equal(v, start[k]) for k, v in trainer.model.state_dict().items())


def test_a_warmup_with_a_progress_bar_logs_its_evaluations(micro_recipe, capfd):
    recipe = micro_recipe("warmup.enabled=true", "warmup.max_steps=2", "warmup.eval_every=1", "warmup.batch_size=2",
                          "warmup.eval_problems=4", "warmup.target_accuracy=2.0", "log.progress=true", "train.steps=0")
    trainer = Trainer(recipe)
    trainer.prepare()
    warm = _records(recipe, "warmup")
    assert [r["warmup/step"] for r in warm] == [0.0, 1.0, 2.0] and "warmup/loss" in warm[1]
    assert "warm-up (SFT)" in capfd.readouterr().err
    assert (Path(recipe.out_dir) / "warmup.pt").exists()


def test_an_engine_that_returns_its_sampling_log_probs_gets_them_compared(micro_recipe, monkeypatch):
    """``rollout/logprob_diff`` (trainer/record.py), which vLLM's runs log: here the HF engine asked for
    its log-probs. It samples with the trainer's own weights, so engine and trainer agree to float32
    rounding, and a threshold of 0 warns on rank 0."""
    from cppo_megatron.trainer import distribution

    monkeypatch.setattr(distribution._Rollout, "want_logprobs", property(lambda self: True))
    recipe = micro_recipe("train.steps=1", "rollout.logprob_warn_threshold=0.0")
    with pytest.warns(UserWarning, match=r"^rollout/logprob_diff=0.0000 exceeds 0.0: the rollout engine and the "):
        Trainer(recipe).run()
    (step,) = _records(recipe, "step")
    assert 0 < step["rollout/logprob_diff"] <= step["rollout/logprob_diff_max"] < 1e-5
