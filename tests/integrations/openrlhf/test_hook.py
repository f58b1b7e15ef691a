"""The CPPO hook on OpenRLHF 0.11.2's real RemoteExperienceMaker, sample classes and advantage step."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cppo_megatron import CPPOConfig
from cppo_megatron.core import group_advantages, keep_order, prune
from cppo_megatron.integrations import wrap
from cppo_megatron.integrations.openrlhf import hook

pytestmark = pytest.mark.openrlhf

# 6 prompts, G = 8 except one prompt with 5 samples (a group left uneven by filtering);
# one all-equal group (no signal) and the paper's [1,0,0,0,0,0,0,0] example.
GROUPS = [
    ("p0", [1, 0, 0, 0, 0, 0, 0, 0]),
    ("p1", [1, 1, 0, 1, 0, 0, 1, 1]),
    ("p2", [0, 0, 0, 0, 0, 0, 0, 0]),
    ("p3", [0.5, 1, 0, 0.25, 1, 0, 0.75, 1]),
    ("p4", [1, 0, 1, 0, 1]),
    ("p0", [0, 0, 1, 1, 0, 0, 0, 1]),  # the same prompt drawn again: a separate group
]
GROUP_IDS = torch.tensor([g for g, (_, r) in enumerate(GROUPS) for _ in r])
REWARDS = torch.tensor([float(x) for _, r in GROUPS for x in r])


def _by_uid(experiences):
    """uid -> (advantages over response tokens, reward, prompt, label, sequence) for every row."""
    rows = {}
    for exp in experiences:
        for i, uid in enumerate(exp.info["uid"].tolist()):
            n = int(exp.action_mask[i].sum())
            rows[int(uid)] = dict(
                adv=exp.advantages[i][exp.action_mask[i].bool()][:n],
                reward=float(exp.rewards[i]),
                info_reward=float(exp.info["reward"][i]),
                prompt=exp.prompts[i],
                label=exp.labels[i],
                seq=exp.sequences[i][exp.attention_mask[i].bool()].tolist(),
            )
    return rows


def _run(orl, make_maker, args, samples, cfg=None):
    maker = make_maker(args)
    if cfg is None:
        hook.uninstall(orl.Maker)
        out = maker.make_experience_batch(samples)
    else:
        hook.install(cfg, orl.Maker)
        try:
            out = maker.make_experience_batch(samples)
        finally:
            hook.uninstall(orl.Maker)
    return maker, out


def test_groups_follow_prompt_runs_not_a_fixed_reshape(make_rollout):
    samples = make_rollout(GROUPS)
    assert hook.group_ids_from_samples(samples, 8).tolist() == GROUP_IDS.tolist()
    # a fixed reshape by n = 8 would put p4's 5 samples and 3 of the next group together
    assert len(samples) % 8 != 0
    with pytest.raises(ValueError, match="n_samples_per_prompt"):
        hook.group_ids_from_samples(samples, 0)


def test_a_prompt_drawn_twice_in_a_row_is_two_groups_with_their_own_statistics(
    orl, make_args, make_maker, make_rollout, fresh
):
    # allocation's larger draws from a small data set repeat prompts; here "p0" back to back:
    # two groups of n = 4 (cut after n samples), not one group of 8
    groups = [("p0", [1, 0, 0, 0]), ("p0", [1, 1, 1, 0]), ("p1", [0, 1, 0, 0])]
    samples = make_rollout(groups)
    assert hook.group_ids_from_samples(samples, 4).tolist() == [0] * 4 + [1] * 4 + [2] * 4
    args = make_args("--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "4",
                     "--rollout.micro_batch_size", "1", "--train.batch_size", "1")
    maker, out = _run(orl, make_maker, args, fresh(samples), CPPOConfig(pruning_rate=0.5, eps=1e-9, scope="group"))
    got = _by_uid(out)
    # each group's own (r - mean) / std, unbiased: [1,0,0,0] -> +1.5 / -0.5, [1,1,1,0] -> +0.5 / -1.5
    # (merged into one group of 8 they would all be +-0.935)
    own = {0: 1.5, 1: -0.5, 2: -0.5, 3: -0.5, 4: 0.5, 5: 0.5, 6: 0.5, 7: -1.5,
           8: -0.5, 9: 1.5, 10: -0.5, 11: -0.5}
    # k = 2 per group of 4: the largest |A| of each group, ties broken by the seeded rule
    kept = sorted(got)
    assert [u for u in kept if u < 4][0] == 0 and 7 in kept and 9 in kept
    assert [sum(1 for u in kept if u // 4 == g) for g in range(3)] == [2, 2, 2]
    for uid, row in got.items():
        assert row["adv"][-1].item() == pytest.approx(own[uid] - 0.01 * 1e-3 * uid, abs=1e-5), uid
    m = maker._cppo_last_metrics
    assert m["cppo/num_groups"] == 3 and m["cppo/num_kept"] == 6


@pytest.mark.parametrize("estimator,adv_norm", [("group_norm", "std"), ("dr_grpo", "none")])
def test_survivors_and_full_group_advantages_in_openrlhf_output(
    orl, make_args, make_maker, make_rollout, fresh, estimator, adv_norm
):
    args = make_args(
        "--algo.advantage.estimator", estimator, "--rollout.n_samples_per_prompt", "8",
        "--rollout.micro_batch_size", "1", "--train.batch_size", "1",  # any kept count is usable
    )  # fmt: skip
    samples = make_rollout(GROUPS)
    cfg = CPPOConfig(pruning_rate=0.75, eps=1e-9)

    maker, out = _run(orl, make_maker, args, fresh(samples), cfg)
    got = _by_uid(out)

    # survivors are exactly the core's selection over the full groups, and only they were forwarded
    expected = prune(REWARDS, GROUP_IDS, dataclasses.replace(cfg, adv_norm=adv_norm), step=0).selection
    assert sorted(got) == expected.kept.tolist()
    assert sorted(maker.forwarded_uids) == expected.kept.tolist()
    assert maker._cppo_last_metrics["cppo/num_pruned"] == len(samples) - expected.num_kept
    assert maker._cppo_last_metrics["cppo/topped_up"] == 0

    # OpenRLHF's own advantage output for the kept samples = vanilla full-group advantages
    adv_core, _ = group_advantages(REWARDS, GROUP_IDS, adv_norm=adv_norm, eps=1e-9)
    for uid, row in got.items():
        # the last response token carries reward - kl_coef * kl; with kl = 1e-3 * uid per token
        last = row["adv"][-1].item()
        assert last == pytest.approx(adv_core[uid].item() - 0.01 * 1e-3 * uid, abs=1e-5)

    # paper example: group p0 = [1,0,...,0] keeps +2.47 (not +1.50 from survivors-only stats)
    if adv_norm == "std":
        assert got[0]["adv"][-1].item() == pytest.approx(2.4749, abs=1e-3)

    # nothing misaligned: each row's prompt, label, sequence and reward are its own sample's
    for uid, row in got.items():
        src = samples[uid]
        assert row["prompt"] == src.prompts[0] and row["label"] == src.labels[0]
        assert row["seq"] == src.sequences[0][src.attention_mask[0].bool()].tolist()
        assert row["reward"] == pytest.approx(float(REWARDS[uid]))
        assert row["info_reward"] == pytest.approx(float(REWARDS[uid]))
    # every completion is kept or counted pruned
    m = maker._cppo_last_metrics
    assert m["cppo/num_kept"] + m["cppo/num_pruned"] == len(samples)
    # the private statistics are consumed by the advantage step, the metrics are logged per sample
    assert all(hook.MEAN_KEY not in e.info and hook.STD_KEY not in e.info for e in out)
    assert all(torch.all(e.info["cppo/kept_ratio"] == m["cppo/kept_ratio"]) for e in out)



def test_signal_metrics_cover_every_sample_before_pruning(orl, make_args, make_maker, make_rollout, fresh):
    from cppo_megatron.core.signal import signal_metrics
    from cppo_megatron.integrations.openrlhf.metrics import with_gen_share

    args = make_args("--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "8",
                     "--rollout.micro_batch_size", "1", "--train.batch_size", "1")
    samples = make_rollout(GROUPS)
    lengths = torch.cat([torch.as_tensor(s.response_length).reshape(-1) for s in samples])
    maker, out = _run(orl, make_maker, args, fresh(samples), CPPOConfig(pruning_rate=0.75, eps=1e-9))
    got = {k: v for k, v in maker._cppo_last_metrics.items() if k.startswith("signal/")}
    assert got == signal_metrics(REWARDS, GROUP_IDS, lengths=lengths)
    # p2 (all 0) is the one group with equal rewards: all wrong; 45 samples, not the 11 kept
    assert (got["signal/zero_variance_share"], got["signal/all_wrong_share"], got["signal/all_correct_share"]) == (
        pytest.approx(1 / 6), pytest.approx(1 / 6), 0.0)
    assert got["signal/completions"] == len(samples) and got["signal/generated_tokens"] == float(lengths.sum())
    assert float(out[0].info["signal/groups"][0]) == 6.0  # carried on the survivors for OpenRLHF's logs
    # the share of the step generating, from OpenRLHF's own timings, where the logger writes
    assert with_gen_share({"timing/generation": 3.0, "timing/step_total": 4.0})["signal/gen_share"] == 0.75
    assert with_gen_share({"timing/ppo_train": 1.0}) == {"timing/ppo_train": 1.0}


def test_the_log_wrapper_adds_gen_share_to_train_lines_only(tmp_path, monkeypatch):
    """OpenRLHF's TensorboardLogger.log_train, wrapped: the line in metrics.jsonl and what OpenRLHF's
    own logger receives both carry signal/gen_share; an eval line is written as it came."""
    import json

    from cppo_megatron.integrations.openrlhf import metrics

    monkeypatch.setenv(metrics.ENV, str(tmp_path / "metrics.jsonl"))
    seen = []
    log_train = metrics._wrap_log(lambda self, step, logs: seen.append(logs), "train")
    log_eval = metrics._wrap_log(lambda self, step, logs: seen.append(logs), "eval")
    log_train(None, 3, {"timing/generation": 1.0, "timing/step_total": 4.0})
    log_eval(None, 3, {"eval_arithmetic_pass1": 0.5})
    assert seen == [{"timing/generation": 1.0, "timing/step_total": 4.0, "signal/gen_share": 0.25},
                    {"eval_arithmetic_pass1": 0.5}]
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["data"]["signal/gen_share"] == 0.25 and lines[1]["data"] == {"eval_arithmetic_pass1": 0.5}

@pytest.mark.parametrize("estimator", ["group_norm", "dr_grpo"])
def test_kept_advantages_equal_vanilla_full_batch(orl, make_args, make_maker, make_rollout, fresh, estimator):
    # whole groups of 8, so OpenRLHF's own reshape by n is right and serves as the reference
    groups = [g for g in GROUPS if len(g[1]) == 8]
    args = make_args("--algo.advantage.estimator", estimator, "--rollout.n_samples_per_prompt", "8")
    samples = make_rollout(groups)
    full_maker, full = _run(orl, make_maker, args, fresh(samples))
    assert sorted(full_maker.forwarded_uids) == list(range(len(samples)))
    maker, out = _run(orl, make_maker, args, fresh(samples), CPPOConfig(pruning_rate=0.75, eps=1e-9))
    vanilla, got = _by_uid(full), _by_uid(out)
    assert len(got) == len(groups) * 2 and sorted(maker.forwarded_uids) == sorted(got)
    for uid, row in got.items():
        torch.testing.assert_close(row["adv"], vanilla[uid]["adv"], rtol=1e-5, atol=1e-6)


def test_pruning_rate_zero_is_vanilla_openrlhf(orl, make_args, make_maker, make_rollout, fresh):
    # whole groups of 8 so OpenRLHF's own reshape is correct; length penalties on
    groups = [g for g in GROUPS if len(g[1]) == 8]
    args = make_args(
        "--rollout.n_samples_per_prompt", "8",
        "--reward.overlong_buffer_len", "4", "--rollout.max_new_tokens", "14",
        "--reward.stop_properly_penalty_coef", "0.5",
    )  # fmt: skip
    samples = make_rollout(groups)
    _, vanilla_out = _run(orl, make_maker, args, fresh(samples))
    _, hooked_out = _run(orl, make_maker, args, fresh(samples), CPPOConfig(pruning_rate=0.0, eps=1e-9))
    vanilla, hooked = _by_uid(vanilla_out), _by_uid(hooked_out)
    assert sorted(hooked) == sorted(vanilla) == list(range(len(samples)))
    penalised = sum(abs(vanilla[u]["reward"] - float(REWARDS[u])) > 1e-6 for u in vanilla)
    assert penalised > 0  # the penalties changed some rewards, and both paths applied them once
    for uid in vanilla:
        torch.testing.assert_close(hooked[uid]["adv"], vanilla[uid]["adv"], rtol=1e-5, atol=1e-6)
        assert hooked[uid]["reward"] == pytest.approx(vanilla[uid]["reward"])
        assert hooked[uid]["info_reward"] == pytest.approx(vanilla[uid]["info_reward"])
    # OpenRLHF's args are restored after the advantage step
    assert args.algo.advantage.estimator == "group_norm" and args.rollout.n_samples_per_prompt == 8
    assert args.reward.overlong_buffer_len == 4


def test_keeps_more_when_openrlhf_needs_more_and_says_so(orl, make_args, make_maker, make_rollout, fresh):
    # 4 actors x micro-batch 2, train batch 16: OpenRLHF needs a multiple of 16 samples
    args = make_args(
        "--rollout.n_samples_per_prompt", "8", "--actor.num_gpus_per_node", "4",
        "--rollout.micro_batch_size", "2", "--train.batch_size", "16",
    )  # fmt: skip
    assert hook.minimum_keep_multiple(args) == 16
    samples = make_rollout(GROUPS)
    cfg = CPPOConfig(pruning_rate=0.875, eps=1e-9)
    maker, out = _run(orl, make_maker, args, fresh(samples), cfg)
    core = prune(REWARDS, GROUP_IDS, cfg, step=0)
    kept = sorted(_by_uid(out))
    m = maker._cppo_last_metrics
    assert core.selection.num_kept == 6 and len(kept) == 16
    assert m["cppo/num_kept_selected"] == 6 and m["cppo/topped_up"] == 10 and m["cppo/num_kept"] == 16
    # the extra ones are the next in the core's own order; the core's survivors are all there
    order = keep_order(core.advantages, cfg, step=0)
    extra = [i for i in order.tolist() if i not in set(core.selection.kept.tolist())][:10]
    assert kept == sorted(core.selection.kept.tolist() + extra)
    # every actor gets 2 micro-batches of 2 samples, balanced by workload
    assert m["cppo/rebalanced"] == 1.0
    assert m["cppo/actor_imbalance"] <= m["cppo/actor_imbalance_unbalanced"]
    assert len(out) == 8 and all(len(e.sequences) == 2 for e in out)


def test_rebalanced_order_gives_actors_equal_workload(orl, make_args, make_maker, make_rollout, fresh):
    # lengths sorted so that a contiguous split is badly unbalanced
    groups = [(f"q{i}", [1, 0, 1, 0, 0, 1, 0, 1]) for i in range(4)]
    lengths = sorted([2 + (7 * i) % 29 for i in range(32)])
    args = make_args(
        "--rollout.n_samples_per_prompt", "8", "--actor.num_gpus_per_node", "2",
        "--rollout.micro_batch_size", "1", "--train.batch_size", "8",
    )  # fmt: skip
    samples = make_rollout(groups, lengths=lengths)
    maker, out = _run(orl, make_maker, args, fresh(samples), CPPOConfig(pruning_rate=0.5))
    m = maker._cppo_last_metrics
    assert m["cppo/num_kept"] == 16
    assert m["cppo/actor_imbalance"] < m["cppo/actor_imbalance_unbalanced"]
    # the two consecutive halves OpenRLHF hands the two actors carry (nearly) equal token work
    lens = [int(e.total_length[0]) for e in out]
    w = [24576 * x + x * x for x in lens]
    halves = sum(w[:8]), sum(w[8:])
    assert max(halves) / (sum(halves) / 2) == pytest.approx(m["cppo/actor_imbalance"], rel=1e-6)
    # reordering moved rows, not their advantages: each is still its own full-group value
    rewards = torch.tensor([float(x) for _, r in groups for x in r])
    adv, _ = group_advantages(rewards, torch.arange(32) // 8, eps=CPPOConfig().eps)
    order = [int(u) for e in out for u in e.info["uid"].tolist()]
    assert order != sorted(order)
    for uid, row in _by_uid(out).items():
        assert row["adv"][-1].item() == pytest.approx(adv[uid].item() - 0.01 * 1e-3 * uid, abs=1e-5)


def test_dynamic_batching_uses_openrlhf_balancing(orl, make_args, make_maker, make_rollout, fresh):
    args = make_args(
        "--rollout.n_samples_per_prompt", "8", "--actor.num_gpus_per_node", "2",
        "--train.dynamic_batch_enable", "--rollout.max_tokens_per_gpu", "64", "--train.batch_size", "4",
    )  # fmt: skip
    samples = make_rollout(GROUPS)
    maker, out = _run(orl, make_maker, args, fresh(samples), CPPOConfig(pruning_rate=0.75, eps=1e-9))
    m = maker._cppo_last_metrics
    assert m["cppo/rebalanced"] == 0.0 and m["cppo/num_kept"] % 4 == 0
    balanced = orl.experience.balance_experiences(out, args)
    assert len(balanced) == 2  # one experience per actor
    uids = sorted(int(u) for e in balanced for u in e.info["uid"])  # a list of 0-d tensors after balancing
    assert uids == sorted(_by_uid(out)) and len(uids) == m["cppo/num_kept"]


def test_refuses_what_it_cannot_prune(orl, make_args, make_maker, make_rollout, fresh):
    samples = make_rollout(GROUPS[:2])
    args = make_args("--rollout.n_samples_per_prompt", "8", "--algo.advantage.estimator", "rloo")
    with pytest.raises(ValueError, match="estimator must be one of"):
        _run(orl, make_maker, args, fresh(samples), CPPOConfig())
    args = make_args("--rollout.n_samples_per_prompt", "8")
    no_reward = fresh(samples)
    no_reward[3].rewards = None
    with pytest.raises(ValueError, match="rollout sample 3 has no reward"):
        _run(orl, make_maker, args, no_reward, CPPOConfig())


def test_importance_is_refused_with_a_reason(orl):
    with pytest.raises(ValueError, match="metric=importance is not supported under OpenRLHF"):
        hook.install(CPPOConfig(metric="importance"), orl.Maker)
    assert not hook.is_installed(orl.Maker)


def test_install_is_reversible_and_reaches_new_instances(orl, make_args, make_maker):
    original = orl.Maker.make_experience_batch
    hook.install(CPPOConfig(pruning_rate=0.5), orl.Maker)
    try:
        assert orl.Maker.make_experience_batch is not original
        assert hook.is_installed(orl.Maker) and wrap.original(orl.Maker.make_experience_batch) is original
        top = orl.Maker.make_experience_batch
        hook.install(CPPOConfig(pruning_rate=0.5), orl.Maker)  # a second install changes nothing
        assert orl.Maker.make_experience_batch is top
    finally:
        hook.uninstall(orl.Maker)
    assert orl.Maker.make_experience_batch is original


def test_keep_multiple_covers_every_model_group(make_args):
    flags = ["--actor.num_gpus_per_node", "2", "--ref.num_gpus_per_node", "3", "--rollout.micro_batch_size", "1",
             "--train.batch_size", "2"]  # fmt: skip
    assert hook.minimum_keep_multiple(make_args(*flags, "--algo.kl.init_coef", "0.01")) == 6
    assert hook.minimum_keep_multiple(make_args(*flags, "--algo.kl.init_coef", "0")) == 2  # no reference model
    dynamic = make_args(*flags, "--algo.kl.init_coef", "0.01", "--train.dynamic_batch_enable", "--train.batch_size", "4")
    assert hook.minimum_keep_multiple(dynamic) == 12


def test_a_resumed_run_continues_the_step_seeds(orl, make_args, make_maker, make_rollout, fresh, tmp_path):
    """The hook's seed step is OpenRLHF's global step: a run resumed from the checkpoint of step 5
    decides its first step with step 5 (the same seed as the 6th step of a run never stopped),
    not step 0 again; it then counts on."""
    ckpt = tmp_path / "ckpt"
    flags = ("--rollout.n_samples_per_prompt", "8", "--rollout.micro_batch_size", "1", "--train.batch_size", "1",
             "--ckpt.path", str(ckpt), "--ckpt.load_enable")
    cfg = CPPOConfig(pruning_rate=0.75, eps=1e-9)
    samples = make_rollout(GROUPS)
    at = {s: sorted(prune(REWARDS, GROUP_IDS, cfg, step=s).selection.kept.tolist()) for s in (0, 5, 6)}
    assert at[0] != at[5] != at[6]  # ties among equal |A| are broken by the step's seed

    fresh_run, out = _run(orl, make_maker, make_args(*flags), fresh(samples), cfg)  # nothing saved yet: step 0
    assert sorted(_by_uid(out)) == at[0] and fresh_run._cppo_step == 1

    (ckpt / "_actor").mkdir(parents=True)
    (ckpt / "_actor" / "latest").write_text("global_step5")  # what OpenRLHF's save_checkpoint leaves
    args = make_args(*flags)
    maker = make_maker(args)
    hook.install(cfg, orl.Maker)
    try:
        first = maker.make_experience_batch(fresh(samples))
        second = maker.make_experience_batch(fresh(samples))
    finally:
        hook.uninstall(orl.Maker)
    assert sorted(_by_uid(first)) == at[5] and sorted(_by_uid(second)) == at[6] and maker._cppo_step == 7
    # without --ckpt.load_enable OpenRLHF starts over, and so does the count
    _, out = _run(orl, make_maker, make_args(*flags[:-1]), fresh(samples), cfg)
    assert sorted(_by_uid(out)) == at[0]
