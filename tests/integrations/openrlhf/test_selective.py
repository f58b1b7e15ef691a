"""Selective rollout (GRESO) in OpenRLHF 0.11.2, driven through OpenRLHF's own training loop in this
process: the real ``PPOTrainer.fit`` (its episodes, its checkpoint client states and resume),
``prepare_datasets`` (``PromptDataset``, the ``StatefulDataLoader`` of ``setup_dataloader``),
``SamplesGenerator.generate_samples`` / ``_generate_vllm`` / ``_collect_prompt_batch`` /
``_process_response_into_experience`` and ``RemoteExperienceMaker.make_experience_batch`` with the
CPPO hook.

Stood in for, as in the other tests of this package: what runs in other Ray processes — the vLLM
engines (each prompt's G responses are fixed by its label), ``ray.wait`` / ``ray.get``, the actor
ranks' forwards and update, and their DeepSpeed checkpoint (the client states the trainer hands them
are ``torch.save``d per tag and read back, as DeepSpeed's ``save_checkpoint`` / ``load_checkpoint`` do).
"""

from __future__ import annotations

import functools
import json
import types

import pytest
import torch

from cppo_megatron.config import CPPOConfig, SelectiveConfig
from cppo_megatron.core.selective import prompt_uniforms
from cppo_megatron.integrations.openrlhf import hook, selective
from cppo_megatron.integrations.openrlhf.diagnostics import audit
from cppo_megatron.integrations.records import complete_lines

pytestmark = pytest.mark.openrlhf

G = 4
# the data set: row i's answer names its kind; every completion of an "easy" prompt scores 1, of a
# "hard" one 0, a "mixed" one alternates 1, 0 (nonzero variance)
KINDS = ["easy", "mixed", "hard", "mixed", "easy", "hard", "mixed", "hard"]
REWARDS = {"easy": [1.0] * G, "hard": [0.0] * G, "mixed": [1.0, 0.0] * (G // 2)}
BATCH = 3  # --rollout.batch_size (no allocation in these runs: the hook is installed directly)


def _label(row: int) -> str:
    return f"{KINDS[row]}-{row}"


class _Ref:
    def __init__(self, responses):
        self.responses = responses


class ActorGroup:
    """Stands in for the PolicyModelActor ranks (Ray actors running DeepSpeed): records what reaches
    them, trains nothing, and keeps the checkpoint client states the trainer hands to
    ``save_checkpoint`` as DeepSpeed does (one file per tag, ``latest`` naming the newest; read back
    by ``get_checkpoint_states``)."""

    def __init__(self, ckpt):
        self.ckpt = ckpt / "_actor"
        self.appended: list = []

    def async_run_method(self, method_name, **kw):
        if method_name == "save_checkpoint":
            folder = self.ckpt / kw["tag"]
            folder.mkdir(parents=True, exist_ok=True)
            torch.save(kw["client_states"], folder / "client_states.pt")
            (self.ckpt / "latest").write_text(kw["tag"])
            return [None]
        if method_name == "get_checkpoint_states":
            tag = (self.ckpt / "latest").read_text().strip()
            return [torch.load(self.ckpt / tag / "client_states.pt", weights_only=False)]
        if method_name == "fit":
            return [{"policy_loss": 0.0}]
        return [None]

    def async_run_method_batch(self, method_name, **kw):
        self.appended.append(kw)
        return []


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"question": f"q{i}", "answer": _label(i)}) + "\n" for i in range(len(KINDS))))
    return path


@pytest.fixture
def run_fit(orl, make_args, make_maker, data_file, tmp_path, monkeypatch, audit_on):
    """``run_fit(name, cfg, *flags, seed=0, audited=True)``: OpenRLHF's ``PPOTrainer.fit`` over the data set
    with the hook (and selective rollout) installed; returns the audit records of the run (none when
    ``audited`` is False: no observer listens) and the trainer."""
    import openrlhf.trainer.ppo_trainer as pt
    import openrlhf.trainer.ppo_utils.samples_generator as sg
    from openrlhf.utils.deepspeed import DeepspeedStrategy

    monkeypatch.setattr(sg, "ray", types.SimpleNamespace(
        wait=lambda refs, num_returns=1, timeout=None: (refs[:1], refs[1:]), get=lambda ref: ref.responses))
    monkeypatch.setattr(pt, "ray", types.SimpleNamespace(get=lambda refs: refs))
    installed = []

    def run(name, cfg, *flags, seed=0, ckpt=None, audited=True):
        args = make_args("--data.prompt_dataset", str(data_file), "--data.input_key", "question",
                         "--data.label_key", "answer", "--rollout.n_samples_per_prompt", str(G),
                         "--rollout.batch_size", str(BATCH), "--train.num_episodes", "3",
                         "--ckpt.path", str(ckpt or tmp_path / f"{name}_ckpt"), "--ckpt.save_steps", "1", *flags)
        args.eval.steps = float("inf")  # as PPOTrainer.__init__ does for -1
        audit_dir = tmp_path / f"{name}_audit"
        if audited:
            audit_on(audit_dir)
        hook.install(cfg)
        installed.append(True)
        strategy = types.SimpleNamespace(
            args=args, print=lambda *a, **k: None, is_rank_0=lambda: True,
            setup_dataloader=functools.partial(DeepspeedStrategy.setup_dataloader, types.SimpleNamespace()))
        # the class Ray runs as the trainer actor: @ray.remote copied every method onto it (tracing
        # wrappers), so BasePPOTrainer's methods there are those copies, as in the real trainer process
        trainer_cls = pt.PPOTrainer.__ray_metadata__.modified_class
        trainer = trainer_cls.__new__(trainer_cls)
        torch.manual_seed(seed)  # OpenRLHF's unseeded RandomSampler takes its seed from torch's global RNG
        trainer.prompts_dataloader, trainer.eval_dataloader, trainer.max_steps = pt.prepare_datasets(strategy, None)
        trainer.generate_kwargs = {"max_len": 64}
        trainer.samples_generator = sg.SamplesGenerator(strategy=strategy, prompts_dataloader=trainer.prompts_dataloader,
                                                        eval_dataloader=None, tokenizer=None, vllm_engines=[])
        uids = iter(range(0, 100000, G))

        def dispatch(prompts, labels, images=None, **kw):  # the vLLM engines: G responses per prompt
            refs = []
            for prompt, label in zip(prompts, labels, strict=True):
                uid = next(uids)
                refs.append(_Ref([{
                    "observation_tokens": [10, 11, 12] + [100 + j] * (2 + j), "action_ranges": [(3, 5 + j)],
                    "reward": r, "scores": r, "rollout_log_probs": None, "prompt": prompt, "label": label,
                    "extra_logs": {"uid": uid + j}, "truncated": False,
                } for j, r in enumerate(REWARDS[label.split("-")[0]])]))
            return refs

        trainer.samples_generator._dispatch_prompts_to_vllm = dispatch
        group = ActorGroup(ckpt or tmp_path / f"{name}_ckpt")
        tokenizer = types.SimpleNamespace(decode=lambda seq, skip_special_tokens=True: ["text"], pad_token_id=0)
        pt.BasePPOTrainer.__init__(trainer, strategy, group, None, None, None, None, tokenizer)
        trainer.experience_maker = make_maker(args)
        trainer.fit()
        return {"audit": audit.read(audit_dir) if audit_dir.is_dir() else [], "trainer": trainer, "args": args,
                "group": group}

    yield run
    if installed:
        hook.uninstall()


def _draws(records):
    """The generator's ``selective`` records that drew something (a call at an epoch's end draws none)."""
    return [r for r in records if r["kind"] == "selective" and r["drawn"]]


def _prunes(records):
    return [r for r in records if r["kind"] == "prune"]


def _info(experiences, key):
    """A metric as the actor ranks receive it: on every survivor's ``info`` (OpenRLHF averages it)."""
    values = torch.cat([e.info[key].reshape(-1) for e in experiences]).double()
    assert bool((values == values[0]).all()), key
    return float(values[0])


P_EASY, P_HARD = 0.2, 0.8
CFG = CPPOConfig(pruning_rate=0.5, eps=1e-9,
                 selective=SelectiveConfig(enabled=True, p_easy=P_EASY, p_hard=P_HARD))
# what OpenRLHF's loop draws with torch.manual_seed(0) (its RandomSampler's seed), 3 episodes over the 8
# rows at 3 prompts a step: (drawn, skipped) per step; episode 1 has no history, so nothing is skipped
PINNED = [
    ([2, 5, 4], []), ([6, 1, 7], []), ([0, 3], []),  # episode 1
    ([6, 1, 3], []), ([0, 7, 2, 4, 5], [2, 4]),  # episode 2: the mixed ones first; then 2 (hard), 4 (easy)
    ([4, 2, 1, 6], [4]), ([0, 5, 7, 3], [0]),  # episode 3
]  # fmt: skip
CODE = {"mixed": 0, "easy": 1, "hard": 2}  # core INFORMATIVE / EASY / HARD


def _oracle(records, cfg):
    """Each draw's skips recomputed here: a row whose groups since its last informative one were all of
    one zero-variance kind (streak z) is skipped when its uniform u(seed, step, row) < 1 - max(p^z, 0.01),
    p the draw's rate for that kind; the history is rebuilt from the prune records (rows, outcomes)."""
    streak: dict[int, tuple[int, int]] = {}  # row -> (kind code, z)
    prunes = {r["step"]: r for r in _prunes(records)}
    for step in sorted({d["step"] for d in _draws(records)}):
        for draw in (d for d in _draws(records) if d["step"] == step):
            u = prompt_uniforms(torch.tensor(draw["drawn"]), seed=cfg.seed, step=step).tolist()
            want = []
            for row, ui in zip(draw["drawn"], u, strict=True):
                code, z = streak.get(row, (0, 0))
                p = draw["p_easy"] if code == 1 else draw["p_hard"]
                if z and ui < 1 - max(p**z, 0.01):
                    want.append(row)
            assert draw["skipped"] == want, (step, draw["skipped"], want)
        account = prunes[step]["selective"]
        for row, zv, easy in zip(account["rows"], account["zero_variance"], account["easy"], strict=True):
            code = 1 if easy else 2 if zv else 0
            old = streak.get(row, (0, 0))
            streak[row] = (code, old[1] + 1 if code and old[0] == code else int(code > 0))


def test_the_loop_skips_what_the_core_decides_per_data_row(run_fit, tmp_path):
    """OpenRLHF's loop, 3 episodes: each step draws from the dataloader until it has 3 kept prompts
    (or the epoch ends), the skips are the core's decisions for each row's history, every group is
    filed under its data row (its prompt is that row's question), and each episode draws every row once."""
    out = run_fit("a", CFG)
    records = out["audit"]
    # the samples generator's draws go to its own file, the hook's prune records to the trainer's
    roles = {f.name.split("-")[0]: {json.loads(line)["kind"] for line in complete_lines(f)}
             for f in (tmp_path / "a_audit").glob("*.jsonl")}
    assert roles == {"generator": {"selective"}, "trainer": {"prune"}}
    draws = _draws(records)
    assert [(d["drawn"], d["skipped"]) for d in draws] == PINNED
    assert [d["step"] for d in draws] == list(range(7))
    _oracle(records, CFG)
    for d in draws:
        assert d["kept"] == [r for r in d["drawn"] if r not in d["skipped"]]  # kept = drawn - skipped, in order
    # each episode draws every row exactly once: skipped rows are used up, not put back
    assert [sorted(sum((d["drawn"] for d in draws[a:b]), [])) for a, b in ((0, 3), (3, 5), (5, 7))] == \
        [list(range(8))] * 3
    for pr in _prunes(records):
        acc = pr["selective"]
        # the group's prompt is its row's question: the index is the data row
        rows = acc["rows"]
        assert [p for p in pr["prompts"]] == [f"q{r}" for r in rows for _ in range(G)]
        assert [1 if e else 2 if z else 0 for z, e in zip(acc["zero_variance"], acc["easy"], strict=True)] == \
            [CODE[KINDS[r]] for r in rows]
        assert acc["drawn"] == acc["skipped"] + acc["generated"] and acc["generated"] == len(rows)
    # the history in OpenRLHF's checkpoint after episode 1 (global_step3), inside the dataloader state it
    # saves: every row, in draw order, with its outcome: keyed by the data row, not by its place in a batch
    saved = torch.load(out["group"].ckpt / "global_step3" / "client_states.pt", weights_only=False)
    hist = saved["data_loader_state_dict"][selective.STATE_KEY]["history"]
    assert hist["prompt_ids"].tolist() == [2, 5, 4, 6, 1, 7, 0, 3]
    assert hist["outcomes"].tolist() == [CODE[KINDS[r]] for r in [2, 5, 4, 6, 1, 7, 0, 3]]
    # OpenRLHF counts every drawn prompt as consumed (its progress bar and checkpoint)
    last = torch.load(out["group"].ckpt / "global_step7" / "client_states.pt", weights_only=False)
    assert last["total_consumed_prompts"] == 24 == sum(len(d["drawn"]) for d in draws)


def test_the_rates_and_metrics_reach_openrlhfs_logs(run_fit):
    """The selective/* metrics ride on every survivor's info to the actor ranks (OpenRLHF averages
    info into its logged status); the rates adapt from the first step after the first pass."""
    out = run_fit("m", CFG)
    steps = [kw["experience"] for kw in out["group"].appended]  # what each step sent to the actors
    assert len(steps) == 7
    rates = [(round(_info(e, "selective/p_easy"), 6), round(_info(e, "selective/p_hard"), 6)) for e in steps]
    # episode 1: not adapted; step 3 (no zero-variance group): both up; step 4 (1 easy, 2 hard of 3): both
    # down; step 5 (rows 2 hard, 1 and 6 mixed): easy up, hard down; step 6 (5, 7 hard; 3 mixed): the same
    assert rates == [(0.2, 0.8)] * 3 + [(0.21, 0.81), (0.2, 0.8), (0.21, 0.79), (0.22, 0.78)]
    assert [_info(e, "selective/adapted") for e in steps] == [0, 0, 0, 1, 1, 1, 1]
    m = {k: _info(steps[4], f"selective/{k}") for k in (
        "prompts_drawn", "prompts_skipped", "prompts_generated", "skipped_easy", "skipped_hard", "skip_ratio",
        "zero_variance_share", "easy_share", "hard_share", "tokens_saved_estimate", "history_prompts",
        "total_prompts_drawn", "total_prompts_skipped", "total_tokens_saved_estimate")}
    # step 4 drew 0, 7, 2, 4, 5; skipped 2 (hard) and 4 (easy); generated 0 (easy), 7 and 5 (hard); the
    # completions are 2..5 tokens long (mean 3.5): 2 skipped x G=4 x 3.5 = 28 tokens saved (an estimate)
    assert m == pytest.approx({
        "prompts_drawn": 5, "prompts_skipped": 2, "prompts_generated": 3, "skipped_easy": 1, "skipped_hard": 1,
        "skip_ratio": 0.4, "zero_variance_share": 1.0, "easy_share": 1 / 3, "hard_share": 2 / 3,
        "tokens_saved_estimate": 28.0, "history_prompts": 8, "total_prompts_drawn": 16, "total_prompts_skipped": 2,
        "total_tokens_saved_estimate": 28.0})
    # nothing of the history travels to the actor ranks: the tags are dropped at the hook
    for exps in steps:
        for e in exps:
            assert selective.INDEX_ATTR not in e.__dict__ and selective.DRAW_ATTR not in e.__dict__


def test_without_the_audit_the_loop_skips_and_logs_the_same(run_fit, tmp_path):
    """No observer listening (the audit off, as in a user's run): no record is built, and the draws,
    skips and ``selective/*`` metrics on the survivors are those the audited run pins."""
    from cppo_megatron.integrations.openrlhf import observers

    out = run_fit("quiet", CFG, audited=False)
    assert not observers.HUB.recording() and out["audit"] == [] and not (tmp_path / "quiet_audit").exists()
    steps = [kw["experience"] for kw in out["group"].appended]
    assert len(steps) == 7
    # (drawn, skipped) of each step: PINNED's counts, read from the metrics the actor ranks receive
    assert [(_info(e, "selective/prompts_drawn"), _info(e, "selective/prompts_skipped")) for e in steps] == [
        (len(d), len(s)) for d, s in PINNED]
    rates = [(round(_info(e, "selective/p_easy"), 6), round(_info(e, "selective/p_hard"), 6)) for e in steps]
    assert rates == [(0.2, 0.8)] * 3 + [(0.21, 0.81), (0.2, 0.8), (0.21, 0.79), (0.22, 0.78)]
    last = torch.load(out["group"].ckpt / "global_step7" / "client_states.pt", weights_only=False)
    assert last["total_consumed_prompts"] == 24  # the skipped prompts counted as consumed, as with the audit


def test_two_runs_decide_alike(run_fit):
    """The same data, seed and dataloader order: the same draws, skips and skip probabilities. (Ranks:
    only OpenRLHF's trainer process draws prompts and records outcomes; there is one history.)"""
    a, b = run_fit("r1", CFG), run_fit("r2", CFG)
    keys = ("step", "drawn", "skipped", "kept", "skip_prob", "streak", "p_easy", "p_hard")
    assert [{k: d[k] for k in keys} for d in _draws(a["audit"])] == [{k: d[k] for k in keys} for d in
                                                                     _draws(b["audit"])]


def test_a_resumed_run_restores_the_history_from_openrlhfs_checkpoint(run_fit, tmp_path):
    """Resumed from global_step4 (mid episode 2) through OpenRLHF's own resume (--ckpt.load_enable: the
    client states of actor rank 0's checkpoint, whose dataloader state carries the history), the run
    decides steps 4-6 exactly as the run that never stopped: the history and rates came back keyed by
    data row. Without them (a checkpoint with no selective state) step 4 skips nothing."""
    import shutil

    straight = run_fit("s", CFG)
    for name, drop in (("resumed", False), ("lost", True)):
        ckpt = tmp_path / f"{name}_ckpt"
        shutil.copytree(straight["group"].ckpt.parent, ckpt)
        (ckpt / "_actor" / "latest").write_text("global_step4")
        if drop:
            path = ckpt / "_actor" / "global_step4" / "client_states.pt"
            states = torch.load(path, weights_only=False)
            del states["data_loader_state_dict"][selective.STATE_KEY]
            torch.save(states, path)
        if not drop:
            resumed = run_fit(name, CFG, "--ckpt.load_enable", ckpt=ckpt)
        else:
            with pytest.warns(UserWarning, match="has no selective-rollout state"):
                lost = run_fit(name, CFG, "--ckpt.load_enable", ckpt=ckpt)
    keys = ("step", "drawn", "skipped", "kept", "skip_prob", "p_easy", "p_hard")
    want = [{k: d[k] for k in keys} for d in _draws(straight["audit"]) if d["step"] >= 4]
    assert [{k: d[k] for k in keys} for d in _draws(resumed["audit"])] == want
    assert [d["drawn"] for d in _draws(lost["audit"])][0] == [0, 7, 2] and not _draws(lost["audit"])[0]["skipped"]
    final = [selective.state_of(r["trainer"].samples_generator).history.state_dict() for r in (straight, resumed)]
    for key in ("prompt_ids", "steps", "outcomes"):
        assert torch.equal(final[0][key], final[1][key])
    # row 7 (hard): generated at step 1 before the restart, at 4 and 6 after it; skipped at none
    steps, outcomes = selective.state_of(resumed["trainer"].samples_generator).history.trace(7)
    assert steps.tolist() == [1, 4, 6] and outcomes.tolist() == [2, 2, 2]


def test_evaluation_draws_are_not_decided(run_fit, orl):
    """OpenRLHF's evaluation goes through the same _generate_vllm with its own iterator: every eval
    prompt is generated, none tagged, nothing recorded."""
    out = run_fit("e", CFG)
    from openrlhf.datasets import PromptDataset

    gen = out["trainer"].samples_generator
    train = gen.prompts_dataloader.dataset
    evaluation = PromptDataset([{"question": f"q{i}", "answer": _label(i)} for i in range(8)], None, gen.strategy)
    assert isinstance(train[3][0], selective.IndexedSource) and train[3][0].row == 3 and train[3][0] == "default"
    assert not isinstance(evaluation[3][0], selective.IndexedSource)
    loader = [evaluation.collate_fn([evaluation[i]]) for i in range(8)]
    before = len(selective.state_of(gen).pending)
    exps, consumed, _ = gen._generate_vllm(iter(loader), 8, False, max_len=64)
    assert consumed == 8 and len(exps) == 8 * G and len(selective.state_of(gen).pending) == before
    assert not any(selective.INDEX_ATTR in e.__dict__ for e in exps)


@pytest.mark.parametrize("flags, message", [
    (["--train.async_enable"], "cppo.selective.enabled=true with --train.async_enable: the asynchronous trainer "
     "draws prompts in another actor"),
    (["--algo.dynamic_filtering_enable"], "cppo.selective.enabled=true with --algo.dynamic_filtering_enable: "
     "OpenRLHF's filter drops the zero-variance groups inside the samples generator"),
    (["--rollout.vllm_generate_batch_size", "8"], "cppo.selective.enabled=true with "
     "--rollout.vllm_generate_batch_size 8: one generation call's groups would be trained"),
])  # fmt: skip
def test_what_is_not_built_is_refused_in_one_line(flags, message, capsys, make_args):
    from cppo_megatron.integrations.openrlhf.train import main

    recipe = ["--actor.model_name_or_path", "m", "--algo.advantage.estimator", "group_norm",
              "--rollout.n_samples_per_prompt", "8", "--rollout.batch_size", "4", "--reward.remote_url", "r.py",
              "--cppo.pruning_rate", "0.75", "--cppo.selective.enabled", "true"]  # fmt: skip
    assert main([*recipe, "--dry-run"]) == 0
    assert ("note: selective rollout: each step draws prompts from OpenRLHF's prompt dataloader until 16 are kept"
            in capsys.readouterr().out)
    assert main([*recipe, *flags, "--dry-run"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()[-1:]
    assert line.startswith(f"error: {message}") and ("remove" in line or "leave" in line)
    with pytest.raises(ValueError, match=message.split(":")[0]):  # the patch route: at the first draw
        selective.check_args(make_args(*flags))


def test_a_batch_without_its_row_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="without its row index.*--data.dataloader_num_workers 0"):
        selective._row_of((["default"], ["q0"], ["easy-0"], [None]), 0)
    row, batch = selective._row_of(([selective.IndexedSource("default", 5)], ["q5"], ["hard-5"], [None]), 0)
    assert row == 5 and batch == (["default"], ["q5"], ["hard-5"], [None]) and type(batch[0][0]) is str


def test_the_history_rides_on_the_dataloader_state_because_the_trainer_actor_cannot_be_wrapped(orl):
    """Ray copies every method of an actor class onto the class it ships (its tracing wrappers) when
    @ray.remote runs, so wrapping BasePPOTrainer later does not reach the trainer actor: the seam is the
    train dataloader's state, which PPOTrainer.fit checkpoints and restores itself. A module still being
    imported (the hook installs inside other modules' imports) is left for its own import callback."""
    import openrlhf.trainer.ppo_trainer as pt

    ray_class = pt.PPOTrainer.__ray_metadata__.modified_class
    assert "save_logs_and_checkpoints" in ray_class.__dict__  # Ray's copy, bound to the original function
    assert ray_class.save_logs_and_checkpoints is not pt.BasePPOTrainer.save_logs_and_checkpoints
    for patch in (selective._patch_dataset, selective._patch_generator, selective._patch_loader):
        patch(types.ModuleType("half_imported"))  # no class defined yet: nothing to wrap, no error


def test_the_run_state_loads_only_its_own_step_and_says_what_does_not_fit():
    state = selective.OpenRLHFSelective(CFG, num_prompts=4, step=3)
    saved = state.state_dict()
    assert saved["step"] == 3 and saved["num_prompts"] == 4
    other = selective.OpenRLHFSelective(CFG, num_prompts=4)
    other.load_state_dict(saved)  # no step given: the saved one
    assert other.next_step == 3 and other.fingerprint() == state.fingerprint()
    with pytest.raises(ValueError, match="the checkpoint of global step 5 holds the history of step 3"):
        other.load_state_dict(saved, step=5)
    with pytest.raises(ValueError, match="checkpoint state has no step"):
        other.load_state_dict({k: v for k, v in saved.items() if k != "step"})
    with pytest.raises(ValueError, match="checkpoint state must be a dict, got list"):
        other.load_state_dict([])  # type: ignore[arg-type]
    bigger = selective.OpenRLHFSelective(CFG, num_prompts=8)
    with pytest.warns(UserWarning, match="saved over a train data set of 4 prompts, this run has 8"):
        bigger.load_state_dict(saved, step=3)
    with pytest.raises(RuntimeError, match=r"the prompts of hook step 4 were drawn for step\(s\) \[3\]"):
        state.begin_call()
        state.record(4, [], torch.zeros(0), torch.zeros(0), torch.zeros(0, dtype=torch.int64), torch.zeros(0))
