"""Early stopping in the HF engine: segment-wise ``generate`` continued from the sliced KV cache
(``rollout/hf_segments.py``). Greedy parity with one call, the views a monitor sees, and stops
that really shrink the batch."""

import pytest
import torch

from cppo_megatron.rollout import HFEngine, SamplingParams, mix_seed

from .conftest import reference_greedy, sample_prompts
from .early_stop_helpers import PlantedMonitor

CPU = torch.device("cpu")


def _engine(model, tok, **kw):
    return HFEngine(model, pad_id=tok.pad_id, eos_id=tok.eos_id, device=CPU, **kw)


def test_segments_without_stops_are_one_greedy_call_and_views_are_true_prefixes(tiny):
    model, tok, task = tiny
    prompts = sample_prompts(tok, task, 5)
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=10, logprobs=True)
    whole = _engine(model, tok).generate(prompts, params)
    mon = PlantedMonitor(3, entropies=True, hidden=True)
    seg = _engine(model, tok).generate(prompts, params, monitor=mon)
    assert seg.tokens == whole.tokens == reference_greedy(model, prompts, 10, tok.eos_id)
    assert seg.finish_reasons == whole.finish_reasons
    for a, b in zip(seg.logprobs, whole.logprobs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert [t for t, _ in mon.calls] == [3, 6, 9][: len(mon.calls)] and mon.calls
    tokens, view = mon.calls[0]
    assert view.rows.tolist() == list(range(5))
    for r in range(5):
        n = int(view.lengths[r])
        assert n == min(3, len(whole.tokens[r])) and int(view.status[r]) == (0 if n == 3 and
                                                                            whole.tokens[r][2] != tok.eos_id else 1)
        torch.testing.assert_close(view.logprobs[r, :n], whole.logprobs[r][:n], atol=1e-5, rtol=0)
        with torch.no_grad():  # entropy of the policy's distribution, hidden = final norm at the last fed token
            out = model(input_ids=torch.tensor([prompts[r] + whole.tokens[r][: n - 1]]), output_hidden_states=True)
        logp = torch.log_softmax(out.logits[0, -n:].float(), -1)
        torch.testing.assert_close(view.entropies[r, :n], -(logp.exp() * logp).sum(-1), atol=1e-4, rtol=0)
        torch.testing.assert_close(view.hidden[r], out.hidden_states[-1][0, -1], atol=1e-4, rtol=0)


def test_planted_stops_end_exactly_those_rows_and_shrink_the_batch(tiny):
    model, tok, task = tiny
    prompts = sample_prompts(tok, task, 8)
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=9)
    whole = _engine(model, tok).generate(prompts, params)
    long_rows = [r for r, t in enumerate(whole.tokens) if len(t) == 9]
    assert len(long_rows) >= 3, "the perturbed micro model should run some rows to the limit"
    first, second = set(long_rows[:2]), {long_rows[2]}
    rows_seen: list[int] = []
    hook = model.register_forward_pre_hook(lambda _m, args, kw: rows_seen.append(kw["input_ids"].shape[0]),
                                           with_kwargs=True)
    try:
        out = _engine(model, tok).generate(prompts, params, monitor=PlantedMonitor(3, {3: first, 6: second}))
    finally:
        hook.remove()
    for r in range(8):
        if r in first | second:
            cut = 3 if r in first else 6
            assert out.finish_reasons[r] == "stopped" and out.tokens[r] == whole.tokens[r][:cut]
        else:
            assert out.tokens[r] == whole.tokens[r] and out.finish_reasons[r] == whole.finish_reasons[r]
    # forwards of the second segment run the rows still running after boundary 3 only
    alive_after_3 = sum(1 for r in range(8) if r not in first and len(whole.tokens[r]) > 3
                        and whole.tokens[r][2] != tok.eos_id)
    assert rows_seen[3] == alive_after_3 < 8
    assert sum(out.lengths) < sum(whole.lengths)
    assert out.metrics()["rollout/stopped_ratio"] == 3 / 8


def test_seeded_segmented_sampling_is_reproducible(tiny):
    model, tok, task = tiny
    prompts = sample_prompts(tok, task, 3)
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=8, seed=mix_seed(0, 3), logprobs=True)
    a = _engine(model, tok).generate(prompts, params, monitor=PlantedMonitor(4, {4: {0, 5}}))
    b = _engine(model, tok).generate(prompts, params, monitor=PlantedMonitor(4, {4: {0, 5}}))
    assert a.tokens == b.tokens and a.finish_reasons == b.finish_reasons
    assert a.finish_reasons[0] in ("stopped", "stop") and len(a.logprobs) == 12
    assert all(lp.shape == (len(t),) for lp, t in zip(a.logprobs, a.tokens, strict=True))


def test_chunks_keep_global_row_numbers(tiny):
    model, tok, task = tiny
    prompts = sample_prompts(tok, task, 4)
    mon = PlantedMonitor(2)
    _engine(model, tok, max_batch_sequences=4).generate(prompts, SamplingParams(n=2, temperature=0.0,
                                                                                 max_new_tokens=6), monitor=mon)
    firsts = [v.rows.tolist() for t, v in mon.calls if t == 2]
    assert firsts == [[0, 1, 2, 3], [4, 5, 6, 7]]  # two chunks of two prompts x n = 2


def test_hidden_needs_a_final_norm(tiny):
    from cppo_megatron.rollout.hf_segments import _final_norm

    class NoNorm(torch.nn.Module):
        def get_decoder(self):
            return torch.nn.Module()

    with pytest.raises(ValueError, match="features=logprob"):
        _final_norm(NoNorm())


def test_replay_on_full_completions_names_the_stops_the_engine_makes(tiny):
    """core.replay_early_stop on greedy completions generated in full stops what the engine stopped
    with the same predictor, boundary by boundary (bench gradient relies on it)."""
    from cppo_megatron.core.early_stop import PrefixPredictor, decide_at_boundary, replay_early_stop
    from cppo_megatron.core.settings import EarlyStopConfig

    model, tok, task = tiny
    prompts = sample_prompts(tok, task, 8)
    es = EarlyStopConfig(enabled=True, segment_tokens=3, min_confidence=0.5)
    gen = torch.Generator().manual_seed(4)
    p = PrefixPredictor().fit(torch.randn(40, 10, generator=gen), torch.tensor([0.0, 1.0] * 20), torch.rand(40))
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=10, logprobs=True)
    G = 4

    class Monitor:
        segment_tokens, entropies, hidden = 3, False, False

        def __init__(self):
            self.q = torch.full((8,), float("nan"), dtype=torch.float64)
            self.b = 0

        def on_boundary(self, tokens, view):
            out = decide_at_boundary(p, logprobs=view.logprobs, lengths=view.lengths, status=view.status,
                                     group_ids=view.rows // G, explore=torch.zeros(8, dtype=torch.bool),
                                     q_last=self.q, shadowed=torch.zeros(8, dtype=torch.bool), segment_tokens=3,
                                     max_new_tokens=10, min_running=es.min_running_for(G, 1), min_confidence=0.5,
                                     seed=0, step=0, stream=self.b)
            self.b += 1
            return out.stop

    stopped_run = _engine(model, tok).generate(prompts, params, monitor=Monitor())
    whole = _engine(model, tok).generate(prompts, params)
    lp = torch.zeros(8, 10)
    for i, v in enumerate(whole.logprobs):
        lp[i, : v.numel()] = v
    rep = replay_early_stop(p, lp, torch.tensor(whole.lengths), torch.tensor([r == "stop" for r in whole.finish_reasons]),
                            torch.arange(8) // G, cfg=es, group_size=G, keep=1, max_new_tokens=10)
    engine_stopped = [r == "stopped" for r in stopped_run.finish_reasons]
    assert rep.stopped.tolist() == engine_stopped and any(engine_stopped)
    for i in range(8):
        if engine_stopped[i]:
            assert int(rep.stopped_at[i]) == len(stopped_run.tokens[i])
    known = replay_early_stop(None, lp, torch.tensor(whole.lengths), torch.zeros(8, dtype=torch.bool),
                              torch.arange(8) // G, cfg=es, group_size=G, keep=1, max_new_tokens=10,
                              known_q=torch.tensor([0.9, 0.1, 0.1, 0.1, 0.9, 0.9, 0.9, 0.1]))
    # group 0 (share 0.3): the likely failures 1-3 are the candidates; group 1 (0.7): the likely successes
    # 4-6; two of each may go (min_running 2); rows 0 and 7, in their group's minority, never
    s = known.stopped.tolist()
    assert not s[0] and not s[7] and 0 < sum(s[1:4]) <= 2 and 0 < sum(s[4:7]) <= 2
