"""DAPO's dynamic sampling (OpenRLHF's own filter loop) before CPPO: the ledger, the per-step
account and the guards, on OpenRLHF 0.11.2's real ``SamplesGenerator._generate_vllm``.

Only vLLM and Ray are stood in for: each request's G responses are fixed per prompt, and
``ray.wait`` / ``ray.get`` hand them back in dispatch order.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from cppo_megatron import CPPOConfig
from cppo_megatron.integrations.openrlhf import filtering, hook
from cppo_megatron.integrations.openrlhf.diagnostics import audit

pytestmark = pytest.mark.openrlhf

G = 4
# prompt -> its G rewards (0/1, the filter's default range 0 1); "z*" have zero variance
REWARDS = {
    "a": [1, 0, 0, 1], "z0": [0, 0, 0, 0], "b": [0, 1, 1, 1], "z1": [1, 1, 1, 1],
    "c": [1, 0, 0, 0], "z2": [0, 0, 0, 0], "d": [0, 0, 1, 0], "e": [1, 1, 0, 1],
}  # fmt: skip
ORDER = ["a", "z0", "b", "z1", "z2", "c", "d", "e"]  # the dataloader's draw order
# prompts whose scores (the filter's metric) are not their rewards: "q" all rewards 0.5 but scores that vary
# (passes with no reward signal), "h" rewards 0.5 with scores 0.5 (mean 0.5 is inside (0, 1): passes too)
REWARDS.update({"q": [0.5] * 4, "h": [0.5] * 4})
SCORES = {"q": [1, 0, 0, 1]}


class _Ref:
    def __init__(self, responses):
        self.responses = responses


def _fake_ray():
    return types.SimpleNamespace(wait=lambda refs, num_returns=1, timeout=None: (refs[:1], refs[1:]),
                                 get=lambda ref: ref.responses)


def _responses(prompt: str, start_uid: int) -> list[dict]:
    out = []
    for j, r in enumerate(REWARDS[prompt]):
        tokens = [10, 11, 12] + [100 + start_uid + j] * (2 + j)
        score = SCORES.get(prompt, REWARDS[prompt])[j]
        out.append({"observation_tokens": tokens, "action_ranges": [(3, len(tokens))], "reward": float(r),
                    "scores": float(score), "rollout_log_probs": None, "prompt": prompt, "label": f"label-{prompt}",
                    "extra_logs": {"uid": start_uid + j}, "truncated": False})
    return out


@pytest.fixture
def generator(orl, make_args, monkeypatch):
    """OpenRLHF's SamplesGenerator with the filter ledger installed, drawing ORDER one prompt at a
    time (OpenRLHF's prompt dataloader has batch size 1)."""
    import openrlhf.trainer.ppo_utils.samples_generator as sg

    monkeypatch.setattr(sg, "ray", _fake_ray())
    filtering.install_generator(sg)

    def build(batch_size: int, *flags: str, order=ORDER):
        args = make_args("--rollout.n_samples_per_prompt", str(G), "--rollout.batch_size", str(batch_size),
                         "--algo.dynamic_filtering_enable", *flags)
        gen = orl.SamplesGenerator.__new__(orl.SamplesGenerator)
        gen.strategy, gen.args, gen.vllm_engines = types.SimpleNamespace(args=args), args, []
        gen.prompts_dataloader = [(i, [p], [f"label-{p}"], [None]) for i, p in enumerate(order)]
        uids = iter(range(0, 1000, G))

        def dispatch(prompts, labels, images=None, **kw):
            return [_Ref(_responses(p, next(uids))) for p in prompts]

        gen._dispatch_prompts_to_vllm = dispatch
        return gen, args

    yield build
    filtering.uninstall_generator(sg)


def test_the_ledger_accounts_for_every_prompt_the_filter_drew(generator):
    gen, args = generator(4)
    samples, pass_rate, consumed, exhausted = gen.generate_samples(max_len=64)
    # OpenRLHF drew 4, dropped z0 and z1 (mean 0 and 1: outside (0, 1)) and refilled 2 (z2, c), dropped z2, drew d
    assert consumed == 7 and not exhausted
    (ledger,) = filtering.ledgers_of(samples)
    assert [(g.prompt, g.passed) for g in ledger.groups] == [
        ("a", True), ("z0", False), ("b", True), ("z1", False), ("z2", False), ("c", True), ("d", True)]
    assert ledger.drawn == consumed == ledger.num_filtered + ledger.num_passed
    assert [g.rewards for g in ledger.groups] == [tuple(float(r) for r in REWARDS[g.prompt]) for g in ledger.groups]
    assert [s.prompts[0] for s in samples] == [p for p in "abcd" for _ in range(G)]
    # OpenRLHF's pass rate: 16 samples / 7 prompts x 100 = G times the share of groups that passed
    assert pass_rate == pytest.approx(16 / 7 * 100)
    account = filtering.account_step([ledger], num_samples=len(samples), kept=8, target=args.rollout.batch_size)
    assert account.metrics()["cppo/filter_pass_rate"] == pytest.approx(4 / 7) == pass_rate / 100 / G


def test_evaluation_and_unfiltered_runs_pass_through(generator):
    gen, _ = generator(4)
    experiences, consumed, _ = gen._generate_vllm(iter(gen.prompts_dataloader), 3, dynamic_filtering=False,
                                                  max_len=64)
    assert consumed == 3 and len(experiences) == 3 * G
    assert not filtering.ledgers_of(experiences) and "_cppo_produced" not in gen.__dict__


def test_dapo_then_cppo_through_the_hook_accounts_for_every_completion(generator, orl, make_maker, tmp_path,
                                                                       audit_on):
    """The hook after OpenRLHF's filter: survivors only from nonzero-variance groups, the kept
    count the recipe asks (k per group x the allocated groups), drawn = filtered + passed and
    generated = filtered x G + kept + pruned, in the metrics and the audit records."""
    audit_on(tmp_path)
    gen, args = generator(4, "--train.batch_size", "8", "--rollout.micro_batch_size", "1",
                          "--algo.kl.init_coef", "0")
    samples, _, consumed, _ = gen.generate_samples(max_len=64)
    cfg = CPPOConfig(pruning_rate=0.5, eps=1e-9)  # k = 2 of G = 4
    maker = make_maker(args)
    survivors = hook.prune_rollout_samples(maker, samples, cfg)
    assert len(survivors) == 4 * 2
    assert {s.prompts[0] for s in survivors} <= {"a", "b", "c", "d"}
    m = maker._cppo_last_metrics
    assert m["cppo/filter_prompts_drawn"] == consumed == 7 and m["cppo/filter_groups_filtered"] == 3
    assert m["cppo/filter_completions_generated"] == 7 * G == 3 * G + m["cppo/num_kept"] + m["cppo/num_pruned"]
    (pr,) = audit.read(tmp_path, "prune")
    (fr,) = audit.read(tmp_path, "filter")
    assert sorted(f.name.split("-")[0] for f in tmp_path.glob("*.jsonl")) == ["generator", "trainer"]
    assert pr["ledgers"] == [fr["serial"]] and pr["account"]["drawn"] == fr["drawn"] == 7
    assert pr["account"] == {**pr["account"], "filtered": 3, "passed": 4, "kept": 8, "pruned": 8,
                                  "generated": 28, "short": False}
    # the filtered groups, by identity: exactly the zero-variance ones
    assert [g["prompt"] for g in fr["groups"] if not g["passed"]] == ["z0", "z1", "z2"]
    assert all(len(set(g["rewards"])) == 1 for g in fr["groups"] if not g["passed"])
    assert all(len(set(g["rewards"])) > 1 for g in fr["groups"] if g["passed"])


def test_a_short_step_when_the_prompts_run_out_is_accounted_as_short(generator, make_maker):
    gen, args = generator(4, "--train.batch_size", "2", "--rollout.micro_batch_size", "1", "--algo.kl.init_coef",
                          "0", order=["a", "z0", "b", "z1"])
    samples, _, consumed, exhausted = gen.generate_samples(max_len=64)
    assert exhausted and consumed == 4 and len(samples) == 2 * G
    maker = make_maker(args)
    survivors = hook.prune_rollout_samples(maker, samples, CPPOConfig(pruning_rate=0.5, eps=1e-9))
    assert len(survivors) == 2 * 2
    m = maker._cppo_last_metrics
    assert m["cppo/filter_short"] == 1.0 and m["cppo/filter_groups_passed"] == 2


def test_the_account_identities_name_the_numbers():
    filtering.StepAccount(drawn=7, filtered=3, passed=4, group_size=4, kept=8, pruned=8, target=4, exhausted=False)
    with pytest.raises(ValueError, match="7 prompts drawn != 2 filtered \\+ 4 passed"):
        filtering.StepAccount(drawn=7, filtered=2, passed=4, group_size=4, kept=8, pruned=8, target=4,
                              exhausted=False)
    with pytest.raises(ValueError, match="28 completions generated != 3 filtered x G=4 \\+ 8 kept \\+ 9 pruned"):
        filtering.StepAccount(drawn=7, filtered=3, passed=4, group_size=4, kept=8, pruned=9, target=4,
                              exhausted=False)
    with pytest.raises(ValueError, match="kept must be an integer >= 0, got -1"):
        filtering.StepAccount(drawn=7, filtered=3, passed=4, group_size=4, kept=-1, pruned=8, target=4,
                              exhausted=False)


def test_a_ledger_that_does_not_add_up_is_refused(make_rollout):
    samples = make_rollout([("a", [1, 0]), ("z", [0, 0])])
    with pytest.raises(ValueError, match="3 prompts drawn x G=2 should give 6 completions, 4 were produced"):
        filtering.build_ledger(samples, samples[:2], drawn=3, group_size=2, exhausted=False, filter_range=(0, 1))
    with pytest.raises(ValueError, match="completions 0-1 are not one request's group"):
        filtering.build_ledger(samples, samples[:1], drawn=2, group_size=2, exhausted=False, filter_range=(0, 1))
    ledger = filtering.build_ledger(samples, samples[:2], drawn=2, group_size=2, exhausted=False, filter_range=(0, 1))
    with pytest.raises(ValueError, match="the filter passed 1 groups x G=2 = 2 completions but the step's rollout "
                                         "holds 4"):
        filtering.account_step([ledger], num_samples=4, kept=2, target=1)


def test_groups_that_pass_with_equal_rewards_are_counted_not_refused(generator, make_maker, tmp_path, audit_on):
    """OpenRLHF filters on scores: "q" (scores vary, rewards all 0.5) and "h" (mean 0.5 inside (0, 1)) pass
    with no reward signal. The step runs; the account, the metric and the audit record count them."""
    audit_on(tmp_path)
    gen, args = generator(4, "--train.batch_size", "8", "--rollout.micro_batch_size", "1", "--algo.kl.init_coef",
                          "0", order=["a", "q", "z0", "h", "b"])
    samples, _, consumed, _ = gen.generate_samples(max_len=64)
    (ledger,) = filtering.ledgers_of(samples)
    assert [(g.prompt, g.passed, filtering.zero_variance(g)) for g in ledger.groups] == [
        ("a", True, False), ("q", True, True), ("z0", False, True), ("h", True, True), ("b", True, False)]
    maker = make_maker(args)
    survivors = hook.prune_rollout_samples(maker, samples, CPPOConfig(pruning_rate=0.5, eps=1e-9))
    assert len(survivors) == 4 * 2  # scope=group: k = 2 of each passed group, q and h (advantage 0) too
    assert maker._cppo_last_metrics["cppo/filter_passed_zero_variance"] == 2.0
    assert maker._cppo_last_metrics["cppo/zero_variance_groups"] == 2.0  # the core's count of the same groups
    (pr,) = audit.read(tmp_path, "prune")
    assert pr["account"]["passed_zero_variance"] == 2 and pr["account"]["passed"] == 4


def test_the_account_checks_its_zero_variance_count():
    ok = filtering.StepAccount(drawn=5, filtered=1, passed=4, group_size=4, kept=8, pruned=8, target=4,
                               exhausted=False, passed_zero_variance=2)
    assert ok.metrics()["cppo/filter_passed_zero_variance"] == 2.0
    with pytest.raises(ValueError, match="5 zero-variance groups passed of only 4 passed"):
        filtering.StepAccount(drawn=5, filtered=1, passed=4, group_size=4, kept=8, pruned=8, target=4,
                              exhausted=False, passed_zero_variance=5)
    with pytest.raises(ValueError, match="passed_zero_variance must be an integer >= 0, got -1"):
        filtering.StepAccount(drawn=5, filtered=1, passed=4, group_size=4, kept=8, pruned=8, target=4,
                              exhausted=False, passed_zero_variance=-1)
    group = filtering.FilteredGroup(prompt="p", label=None, scores=(None, None, None), rewards=(None, 1.0, 1.0),
                                    passed=True)
    assert filtering.zero_variance(group)  # the known rewards are equal
    assert not filtering.zero_variance(dataclasses.replace(group, rewards=(None, None, 1.0)))  # one known: no group


def test_launcher_refuses_over_sampling_and_explains_the_filter(capsys):
    from cppo_megatron.integrations.openrlhf.train import main

    recipe = ["--actor.model_name_or_path", "m", "--algo.advantage.estimator", "group_norm",
              "--rollout.n_samples_per_prompt", "8", "--rollout.batch_size", "4", "--reward.remote_url", "r.py",
              "--algo.dynamic_filtering_enable", "--cppo.pruning_rate", "0.75"]  # fmt: skip
    assert main(["--dry-run", *recipe]) == 0
    out = capsys.readouterr().out
    assert ("note: dynamic filtering: OpenRLHF draws 16 prompts per step, drops each group whose mean score is not "
            "strictly inside (0, 1) and draws one new prompt for it until 16 groups pass; then CPPO prunes them. A "
            "group that passes with all rewards equal") in out
    assert "counted as cppo/filter_passed_zero_variance" in out
    assert main(["--dry-run", *recipe, "--rollout.vllm_generate_batch_size", "4", "--train.async_enable"]) == 2
    err = capsys.readouterr().err
    assert "--rollout.vllm_generate_batch_size 4 with --algo.dynamic_filtering_enable under CPPO" in err
    assert "leave --rollout.vllm_generate_batch_size unset" in err
