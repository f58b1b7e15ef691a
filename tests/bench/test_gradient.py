"""bench gradient: the gradient of a kept set is the recipe's loss on exactly those rows,
and the bench runs end to end at toy size."""

import json

import pytest
import torch

from cppo_megatron.bench.gradient import compare, kept_sets, policy_gradient
from cppo_megatron.cli import main
from cppo_megatron.trainer import Trainer
from cppo_megatron.trainer.policy import KeptBatch
from tests.bench.test_speedup_study import FAST
from tests.trainer.conftest import micro_recipe  # noqa: F401 - the fixture

TOY = FAST + ["rollout.group_size=8", "train.capacity=32"]


def test_compare_known_vectors():
    f = torch.tensor([3.0, 4.0])
    assert compare(f, f) == {"cosine": 1.0, "rel_error": 0.0, "norm_ratio": 1.0}
    r = compare(torch.tensor([0.0, 5.0]), f)
    assert r["cosine"] == pytest.approx(0.8) and r["norm_ratio"] == pytest.approx(1.0)
    assert r["rel_error"] == pytest.approx((9 + 1) ** 0.5 / 5)
    with pytest.raises(ValueError, match="full-batch gradient is zero"):
        compare(f, torch.zeros(2))


def test_kept_set_gradients_add_up_to_the_full_gradient(micro_recipe):
    """token-mean: T_full g_full = T_S g_S + T_rest g_rest for any split of the rows, and a
    census with unit weights and the full denominators is the full gradient itself."""
    t = Trainer(micro_recipe("train.loss_agg=token-mean"))
    gen = torch.Generator().manual_seed(0)
    prompts = [[1, 2, 3]] * 6 + [[4, 5]] * 6
    comps = [[int(x) + 1 for x in torch.randint(0, 8, (int(n),), generator=gen)]
             for n in torch.randint(1, 5, (12,), generator=gen)]
    adv = torch.randn(12, generator=gen)
    kw = dict(pad_id=t.tok.pad_id, device=t.device, norm_constant=4.0)
    full = KeptBatch(prompts, comps)
    g_full = policy_gradient(t.model, full, adv, t.r.train, **kw)
    s, rest = [0, 3, 4, 9], [1, 2, 5, 6, 7, 8, 10, 11]

    def sub(rows):
        b = KeptBatch([prompts[i] for i in rows], [comps[i] for i in rows])
        return b, float(b.completion_mask().sum())

    (bs, ts), (br, tr) = sub(s), sub(rest)
    g_s = policy_gradient(t.model, bs, adv[s], t.r.train, **kw)
    g_r = policy_gradient(t.model, br, adv[rest], t.r.train, **kw)
    t_full = float(full.completion_mask().sum())
    assert torch.allclose(t_full * g_full, ts * g_s + tr * g_r, atol=1e-5, rtol=1e-4)
    # weights multiply the rows' contributions; with the full denominators the pieces add up
    w = torch.full((4,), 2.0)
    g_w = policy_gradient(t.model, bs, adv[s], t.r.train, weights=w, num_tokens=t_full, **kw)
    assert torch.allclose(g_w, 2 * ts / t_full * g_s, atol=1e-6, rtol=1e-4)
    census = policy_gradient(t.model, full, adv, t.r.train, weights=torch.ones(12), num_tokens=t_full,
                             num_seqs=12.0, **kw)
    assert compare(census, g_full)["rel_error"] < 1e-5


def test_gradient_bench_end_to_end(tmp_path):
    out = tmp_path / "g"
    assert main(["bench", "gradient", "recipes/tiny_cpu.yaml", *TOY, "--points", "0,1", "--batches", "2",
                 "--prompts", "4", "--rates", "0.5,0.75", "--keep-mass", "0.9", "--out", str(out)]) == 0
    data = json.loads((out / "gradient.json").read_text())
    rows = data["rows"]
    labels = ["full"] + [k.label for k in kept_sets([0.5, 0.75], [0.9])]
    for point in (0, 1):
        got = [r["kept_set"] for r in rows if r["rl_step"] == point]
        assert got == labels[: len(got)] and len(got) == len(labels), "a batch without signal was skipped"
    by = {(r["rl_step"], r["kept_set"]): r for r in rows}
    assert by[(0, "full")]["cosine"] == 1.0 and by[(0, "full")]["rel_error"] == 0.0
    for p in (0.5, 0.75):  # fixed k per group of 8
        for m in ("smallest", "largest", "random", "importance"):
            r = by[(0, f"{m} P={p:g}")]
            assert r["kept_ratio"] == pytest.approx(1 - p)
            assert -1.0 <= r["cosine"] <= 1.0 and r["rel_error"] >= 0 and r["batches"] == 2
    assert (out / "gradient.md").exists() and (out / "gradient.png").exists()
    assert main(["bench", "gradient", "recipes/tiny_cpu.yaml", "--rates", "1.5", "--out", str(out)]) == 2


def test_gradient_bench_compares_early_stopping(tmp_path):
    """--early-stop adds CPPO + early stopping (each estimator, and the oracle bound) at each rate."""
    from cppo_megatron.bench.gradient import early_stop_sets

    out = tmp_path / "g"
    es = ["rollout.max_new_tokens=8", "cppo.early_stop.segment_tokens=2", "cppo.early_stop.success_threshold=0.05",
          "cppo.early_stop.min_confidence=0.5"]
    assert main(["bench", "gradient", "recipes/tiny_cpu.yaml", *TOY, *es, "--points", "0", "--batches", "2",
                 "--prompts", "4", "--rates", "0.75", "--keep-mass", "0.9", "--early-stop", "--out", str(out)]) == 0
    rows = json.loads((out / "gradient.json").read_text())["rows"]
    by = {r["kept_set"]: r for r in rows}
    for ks in early_stop_sets(0.75):
        r = by[ks.label]
        assert r["kept_ratio"] <= 0.25 + 1e-9  # k = 2 of 8 at most, among the finished
        assert 0 < r["tokens_share"] <= 1.0 and -1.0 <= r["cosine"] <= 1.0
    assert by["full"]["tokens_share"] == 1.0 and by["smallest P=0.75"]["tokens_share"] == 1.0


def test_two_wave_set_keeps_the_finished_groups_and_counts_their_tokens():
    """Planted rewards, G = 4, k = 2: group 0's first two agree (left out although its last two differ),
    group 1's differ (finished: all 4 at P = 0, CPPO's 2 largest |A| at P = 0.5), group 2 has none."""
    from cppo_megatron.bench.gradient import _two_wave_set, two_wave_sets
    from cppo_megatron.config import CPPOConfig

    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    completions = [[1] * n for n in (2, 2, 9, 9, 3, 3, 3, 3, 1, 1, 9, 9)]
    (grpo, cppo) = two_wave_sets([2], [0.5])
    assert (grpo.label, grpo.pruning_rate, cppo.label) == ("two_wave k=2 P=0", 0.0, "two_wave k=2 P=0.5")
    rows, adv, share, extra = _two_wave_set(grpo, CPPOConfig(pruning_rate=0.0), rewards, completions, 4, step=0)
    assert rows.tolist() == [4, 5, 6, 7] and adv.tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5], abs=1e-5)
    # tokens: every group's first wave (2+2, 3+3, 1+1) and group 1's second (3+3), of all 54
    assert share == pytest.approx(18 / 54) and extra == {"finished_share": pytest.approx(1 / 3)}
    rows, adv, _, _ = _two_wave_set(cppo, CPPOConfig(pruning_rate=0.5), rewards, completions, 4, step=0)
    assert rows.tolist()[0] == 4 and rows.numel() == 2 and adv[0] == pytest.approx(1.5, abs=1e-5)
    none, adv, share, extra = _two_wave_set(grpo, CPPOConfig(pruning_rate=0.0), torch.zeros(12), completions, 4, 0)
    assert none.numel() == 0 and adv.numel() == 0 and extra["finished_share"] == 0.0


def test_gradient_bench_compares_two_waves(tmp_path):
    """--two-wave K adds GRPO + two waves (P = 0) and CPPO + two waves at each rate, beside CPPO and
    random; a first wave outside [2, G) or not an integer exits 2."""
    out = tmp_path / "g"
    assert main(["bench", "gradient", "recipes/tiny_cpu.yaml", *TOY, "--points", "0", "--batches", "2",
                 "--prompts", "4", "--rates", "0.75", "--keep-mass", "0.9", "--two-wave", "2", "--out", str(out)]) == 0
    by = {r["kept_set"]: r for r in json.loads((out / "gradient.json").read_text())["rows"]}
    grpo, cppo = by["two_wave k=2 P=0"], by["two_wave k=2 P=0.75"]
    assert 0 < grpo["tokens_share"] <= 1.0 and grpo["tokens_share"] == cppo["tokens_share"]
    assert cppo["kept_ratio"] == pytest.approx(grpo["kept_ratio"] / 4)  # k = 2 of each finished group of 8
    assert -1.0 <= grpo["cosine"] <= 1.0 and "random P=0.75" in by
    for bad in ("8", "1", "2.5"):
        assert main(["bench", "gradient", "recipes/tiny_cpu.yaml", *TOY, "--two-wave", bad, "--out", str(out)]) == 2


def test_predictor_bench_scores_each_feature_set_on_held_out_steps(tmp_path):
    out = tmp_path / "pr"
    es = ["rollout.max_new_tokens=8", "cppo.early_stop.segment_tokens=2", "cppo.early_stop.success_threshold=0.05",
          "cppo.pruning_rate=0.75"]
    assert main(["bench", "predictor", "recipes/tiny_cpu.yaml", *TOY, *es, "--steps", "3", "--out", str(out)]) == 0
    data = json.loads((out / "predictor.json").read_text())
    assert [r["features"] for r in data["rows"]] == ["logprob", "entropy", "hidden"]  # no oracle: arithmetic task
    for r in data["rows"]:
        assert r["steps scored"] == 2 and 0.0 <= r["auc"] <= 1.0 and len(r["auc per step"]) == 2
    assert main(["bench", "predictor", "recipes/tiny_cpu.yaml", "--steps", "1", "--out", str(out)]) == 2
