"""The trainer loop's branches the run tests did not reach (scripts/coverage_floor.py): the progress
bar, an evaluation between steps, the wall-time budget, a Megatron recipe outside torchrun, and
initial weights from a file; each pinned by the records or the message."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from types import SimpleNamespace

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


# ----------------------------------------------------------------------------- what only other ranks, other
# engines or a signal between steps reach (issue 43 item 7): each by the value it produces


def test_the_logger_and_the_backend_say_which_rank_or_call_they_need():
    with pytest.raises(RuntimeError, match="^only the main rank logs metrics: this rank has no logger$"):
        Trainer.main_logger.fget(SimpleNamespace(logger=None))
    with pytest.raises(RuntimeError, match=r"^the Megatron policy is built by Trainer.prepare\(\): call it first$"):
        Trainer.backend.fget(SimpleNamespace(policy=None))


def test_early_stopping_on_megatron_is_refused_before_any_engine_is_built(micro_recipe):
    """The loop's own guard (a recipe object built past validate_recipe's check)."""
    stub = SimpleNamespace(r=micro_recipe(), distributed=True, early_stop=object(), two_wave=None)
    with pytest.raises(ValueError, match=r"^cppo.early_stop runs with backend=hf \(one process\); backend=megatron "
                                         r"does not support it yet: set cppo.early_stop.enabled=false or backend=hf$"):
        Trainer._build_rollout(stub)


def _vllm_kwargs_bind(kwargs: dict) -> None:
    """``kwargs`` name parameters VLLMEngine really has (the class imports without vLLM)."""
    from cppo_megatron.rollout.vllm import VLLMEngine

    inspect.signature(VLLMEngine).bind(object(), **kwargs)


def test_the_vllm_engine_of_one_process_gets_the_recipes_settings(micro_recipe):
    """backend=hf, engine=vllm: what build_engine is handed (the real run: tests/rollout/test_vllm_engine.py,
    in .venv-vllm, which CI's coverage does not measure)."""
    recipe = micro_recipe("rollout.engine=vllm", "seed=11", "rollout.vllm_kv_cache_gb=0.25",
                          "rollout.vllm_gpu_memory_utilization=0.4", "rollout.vllm_sync_via_disk=true")
    model = object()
    stub = SimpleNamespace(r=recipe, model=model, tok=SimpleNamespace(eos_id=2, pad_id=0), device=torch.device("cpu"))
    kwargs = Trainer._engine_kwargs(stub)
    assert kwargs == dict(model=model, eos_id=2, seed=11, kv_cache_gb=0.25, gpu_memory_utilization=0.4,
                          sync_via_disk=True)
    _vllm_kwargs_bind({k: v for k, v in kwargs.items() if k != "model"})


def test_the_vllm_engine_of_a_megatron_rank_joins_the_job_with_its_tensor_parallelism(micro_recipe, monkeypatch):
    """backend=megatron, engine=vllm: every rank builds the HF copy (not shared with the policy) and a vLLM
    engine in the job's process group (the real run: tests/rollout/test_vllm_megatron.py, under torchrun
    in .venv-vllm). vLLM and the rollout are stood in for at our own classes."""
    import cppo_megatron.rollout.vllm as vllm_mod
    import cppo_megatron.trainer.loop as loop
    from cppo_megatron.rollout import HFEngine
    from cppo_megatron.tasks import build_task
    from cppo_megatron.trainer.models import build_model

    recipe = micro_recipe("backend=megatron", "megatron.tp=2", "megatron.pp=1", "rollout.engine=vllm",
                          "rollout.vllm_tp=2", "seed=5", "rollout.vllm_kv_cache_gb=0.5",
                          "rollout.vllm_gpu_memory_utilization=0.6")
    task = build_task(recipe.task)
    model, tok = build_model(recipe.model, task.alphabet, recipe.seed)
    built: dict = {}

    class Engine:
        def __init__(self, model, **kwargs):
            built["vllm"] = (model, kwargs)

    real_signature = inspect.signature(vllm_mod.VLLMEngine)  # read before the stand-in replaces it
    monkeypatch.setattr(vllm_mod, "VLLMEngine", Engine)
    monkeypatch.setattr(loop, "ModelParallelRollout", lambda *args: args)
    stub = SimpleNamespace(r=recipe, distributed=True, early_stop=None, two_wave=None, model=model, tok=tok,
                           device=torch.device("cpu"), task=task)
    hf_engine, engine, got_task, got_tok, got_recipe, device = Trainer._build_rollout(stub)
    assert isinstance(hf_engine, HFEngine) and not hf_engine.shared and isinstance(engine, Engine)
    assert (got_task, got_tok, got_recipe, device) == (task, tok, recipe, torch.device("cpu"))
    vmodel, kwargs = built["vllm"]
    assert vmodel is model
    assert kwargs == dict(eos_id=tok.eos_id, seed=5, kv_cache_gb=0.5, gpu_memory_utilization=0.6,
                          sync_via_disk=False, join_process_group=True, tensor_parallel_size=2)
    real_signature.bind(model, **kwargs)


def test_a_signal_between_steps_checkpoints_the_finished_step(micro_recipe, capsys):
    """A KeyboardInterrupt (a second SIGINT after the repeat window) in the evaluation after step 1, no
    step open: the state is step 1's, so it is checkpointed and --resume goes on from step 1."""
    recipe = micro_recipe("train.steps=2", "eval.every=1", "eval.num_problems=4")
    t = Trainer(recipe)
    real, calls = t._log_eval, []

    def log_eval():
        calls.append(t.step)
        if len(calls) == 2:  # the first is prepare()'s, before RL
            raise KeyboardInterrupt
        return real()

    t._log_eval = log_eval
    result = t.run()
    ckpt = Path(recipe.out_dir) / "checkpoints" / "step_000001"
    assert calls == [0, 1] and result == {"interrupted": True, "step": 1, "checkpoint": str(ckpt)}
    assert "interrupted: checkpoint saved to" in capsys.readouterr().err
    state = torch.load(ckpt / "trainer.pt", weights_only=False)
    assert state["step"] == 1 and state["sampler"] == t.sampler.state_dict()
    assert [r["step"] for r in _records(recipe, "step")] == [1]
    resumed = Trainer(recipe, resume=True)
    assert resumed.step == 1 and resumed.sampler.state_dict() == t.sampler.state_dict()


def test_ranks_whose_selective_histories_differ_stop_the_run():
    from cppo_megatron.config import CPPOConfig, SelectiveConfig
    from cppo_megatron.trainer.selective import SelectiveRollout

    sel = SelectiveRollout(CPPOConfig(selective=SelectiveConfig(enabled=True)), group_size=4, num_prompts=8)
    mine = sel.fingerprint()
    agree = SimpleNamespace(selective=sel, step=2, rollout=SimpleNamespace(gather=lambda d: [d, d]))
    assert Trainer._check_selective_agrees(agree) is None
    differ = SimpleNamespace(selective=sel, step=2, rollout=SimpleNamespace(gather=lambda d: [d, "0f"]))
    with pytest.raises(RuntimeError, match=re.escape(
            f"step 3: the selective-rollout history differs between ranks (digests by rank: ['{mine}', '0f']); "
            "the ranks drew or recorded different prompts")):
        Trainer._check_selective_agrees(differ)


def test_a_rank_leading_its_own_filesystem_writes_rank_0s_trainer_state(tmp_path):
    """Rank 1 of 2, alone on its disk (``_fs_peers`` [1]): it writes the checkpoint's trainer.pt there, and
    the state it writes is rank 0's, gathered (a non-main rank has none of its own)."""
    rank0 = {"sampler": {"drawn": 7}, "elapsed": 3.5}
    gathered = []

    def gather(obj):
        gathered.append(obj)
        return [rank0, obj]

    stub = SimpleNamespace(is_main=False, out=tmp_path, step=4, _fs_peers=[1],
                           rollout=SimpleNamespace(rank=1, world=2, gather=gather, barrier=lambda slow=False: None),
                           backend=SimpleNamespace(state_dict=lambda: {"shard": torch.tensor([1.0, 2.0])}))
    path = Trainer._checkpoint(stub)
    assert path == tmp_path / "checkpoints" / "step_000004" and gathered == [None]
    assert sorted(p.name for p in path.iterdir()) == ["policy_rank00001.pt", "trainer.pt"]
    assert torch.load(path / "trainer.pt", weights_only=False) == {**rank0, "step": 4}
    assert torch.equal(torch.load(path / "policy_rank00001.pt", weights_only=False)["shard"], torch.tensor([1.0, 2.0]))


def test_the_progress_bar_of_several_ranks_shows_the_exchange_imbalance():
    rec = {"reward/mean": 0.25, "cppo/kept_ratio": 0.5, "time/step": 1.234, "cppo/exchange_imbalance": 0.125}
    for world, extra in ((1, {}), (2, {"imbalance": "0.125"})):
        stub = SimpleNamespace(_last_acc=0.75, rollout=SimpleNamespace(world=world))
        assert Trainer._postfix(stub, rec) == {"reward": "0.250", "acc": "0.750", "kept": "0.50", "step_s": "1.23",
                                               **extra}


def test_a_rank_other_than_the_main_one_neither_warms_up_nor_says_what_resume_lacks(micro_recipe, tmp_path, capfd):
    """What rank 1 of a torchrun job does (``is_main`` False, as ``ModelParallelRollout`` sets it): no
    warm-up and no warmup.pt (it takes rank 0's weights from the broadcast, a no-op in one process), no
    recipe.yaml; resuming without selective-rollout state it starts an empty history silently (rank 0
    says so: tests/trainer/test_selective_rollout.py)."""
    warm = micro_recipe("warmup.enabled=true", "warmup.max_steps=2", "warmup.batch_size=2", "train.steps=0")
    t = Trainer(warm)
    t.is_main = False
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    t.prepare(initial_eval=False)
    out = Path(warm.out_dir)
    assert not (out / "warmup.pt").exists() and not (out / "recipe.yaml").exists()
    assert all(torch.equal(v, before[k]) for k, v in t.model.state_dict().items())
    assert _records(warm, "warmup") == []

    run = tmp_path / "plain"
    Trainer(micro_recipe(f"out_dir={run}", "train.steps=1", "log.checkpoint_every=1")).run()
    capfd.readouterr()
    t = Trainer(micro_recipe(f"out_dir={run}", "train.steps=2", "cppo.selective.enabled=true"))
    t.is_main = False
    t._resume()
    assert t.step == 1 and t.selective.history.num_events == 0
    assert capfd.readouterr().err == ""
