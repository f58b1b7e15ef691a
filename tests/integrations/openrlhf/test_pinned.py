"""Drift guard and recipe flags against the installed OpenRLHF source (no GPU imports needed)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

from cppo_megatron.integrations.openrlhf import pinned
from cppo_megatron.integrations.openrlhf.recipe import launcher_argv, load_recipe, openrlhf_flags
from cppo_megatron.integrations.openrlhf.train import allocate, parse_openrlhf_args, plan, split_argv
from cppo_megatron import CPPOConfig

pytestmark = pytest.mark.openrlhf

# the cluster recipes (the CPU ones, tiny_cpu_*.yaml and the cpu_toy.yaml override, are dry-run in test_cpu_mode.py)
RECIPES = sorted((Path(__file__).resolve().parents[3] / "recipes" / "openrlhf").glob("qwen*.yaml"))


def test_installed_version_is_the_pinned_one():
    assert pinned.installed_version() == pinned.PINNED_VERSION


def test_hooked_functions_match_the_pinned_source():
    assert pinned.check_drift() == []


def test_drift_guard_notices_a_changed_seam(tmp_path):
    # a copy of the installed package with one line of the advantage step changed
    src = pinned.openrlhf_dir()
    for relpath, _ in pinned.SEAMS:
        dst = tmp_path / relpath
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text((src / relpath).read_text())
    maker = tmp_path / "trainer/ppo_utils/experience_maker.py"
    maker.write_text(maker.read_text().replace("rewards.std(-1, keepdim=True) + 1e-9", "rewards.std(-1, keepdim=True) + 1e-6"))
    problems = pinned.check_drift(tmp_path)
    assert len(problems) == 1 and "compute_advantages_and_returns" in problems[0]
    (tmp_path / "trainer/ppo_trainer.py").write_text("class BasePPOTrainer:\n    pass\n")
    assert any("BasePPOTrainer.train_step not found" in p for p in pinned.check_drift(tmp_path))


def test_both_trainers_reach_the_hooked_method():
    """The sync PPOTrainer and the async TrainingActor both inherit BasePPOTrainer.train_step,
    which calls experience_maker.make_experience_batch: the one seam the hook wraps."""
    root = pinned.openrlhf_dir() / "trainer"
    for relpath, name in (("ppo_trainer.py", "PPOTrainer"), ("ppo_trainer_async.py", "TrainingActor")):
        tree = ast.parse((root / relpath).read_text())
        cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
        assert [b.id for b in cls.bases if isinstance(b, ast.Name)] == ["BasePPOTrainer"]
        assert "train_step" not in {f.name for f in cls.body if isinstance(f, ast.FunctionDef)}
    assert "self.experience_maker.make_experience_batch(rollout_samples)" in pinned.source_of(
        "trainer/ppo_trainer.py", "BasePPOTrainer.train_step"
    )


def test_pinned_parser_is_openrlhfs_own():
    parser = pinned.pinned_parser()
    flags = pinned.known_flags(parser)
    assert {"--rollout.n_samples_per_prompt", "--algo.advantage.estimator", "--train.batch_size"} <= flags
    estimator = next(a for a in parser._actions if "--algo.advantage.estimator" in a.option_strings)
    assert {"group_norm", "dr_grpo"} <= set(estimator.choices)


@pytest.mark.parametrize("recipe_path", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_flag_exists_in_the_pinned_parser(recipe_path):
    recipe = load_recipe(recipe_path)
    flags = pinned.known_flags()
    missing = [f"--{k}" for k in recipe["openrlhf"] if f"--{k}" not in flags]
    assert missing == [], f"{recipe_path.name}: not OpenRLHF {pinned.PINNED_VERSION} flags: {missing}"
    # and the values parse with OpenRLHF's own types and choices
    values, dry_run, forwarded = split_argv(launcher_argv(recipe))
    args = parse_openrlhf_args(forwarded)
    assert forwarded == openrlhf_flags(recipe) and not dry_run
    assert args.rollout.n_samples_per_prompt == 16
    assert Path(args.reward.remote_url).name == "reward_math.py" and Path(args.reward.remote_url).is_file()
    if values is not None:
        cfg = CPPOConfig.from_dict(values)
        forwarded, before, after = allocate(cfg, forwarded, args)
        counts = plan(cfg, parse_openrlhf_args(forwarded))
        # allocation: the survivors fill the update batch exactly, nothing topped up
        assert after == before * 8
        assert counts["kept_per_step"] == counts["selected_per_step"] == args.train.batch_size


def test_recipes_pair_grpo_and_cppo_with_the_same_update_batch():
    by_stem = {p.stem: load_recipe(p) for p in RECIPES}
    for stem in by_stem:
        if stem.endswith("-cppo"):
            grpo = by_stem[stem[: -len("cppo")] + "grpo"]
            cppo = by_stem[stem]
            assert grpo["cppo"] is None and cppo["cppo"]["pruning_rate"] == 0.875
            g, c = grpo["openrlhf"], cppo["openrlhf"]
            # the same GRPO prompt count: the launcher's allocation draws 1 / (1 - P) times more;
            # own output folders, and checkpoints about equally often in time (CPPO's steps are longer)
            same = {k for k in g if k not in ("ckpt.output_dir", "ckpt.path", "ckpt.save_steps")}
            assert {k: g[k] for k in same} == {k: c[k] for k in same}
            assert g["ckpt.load_enable"] is True and c["ckpt.save_steps"] < g["ckpt.save_steps"]


def test_bad_flags_and_recipes_are_named(tmp_path):
    with pytest.raises(ValueError, match="rejects"):
        parse_openrlhf_args(["--rollout.n_samples_per_prompts", "8"])
    bad = tmp_path / "r.yaml"
    bad.write_text(yaml.safe_dump({"cppo": {"pruning_rat": 0.5}, "openrlhf": {"x": 1}}))
    with pytest.raises(ValueError, match="pruning_rat"):
        load_recipe(bad)
    bad.write_text(yaml.safe_dump({"cppo": {"selective": {"enabeld": True}}, "openrlhf": {"x": 1}}))
    with pytest.raises(ValueError, match=r"cppo.selective.enabeld is not a CPPO setting"):
        load_recipe(bad)


def test_a_recipes_cppo_section_reaches_the_launcher_as_dotted_flags(tmp_path):
    """Nested (selective:), dotted and deprecated flat keys all become one --cppo.KEY=VALUE per key."""
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"cppo": {"pruning_rate": 0.5, "selective": {"enabled": True},
                                             "selective.p_hard": 0.2}, "openrlhf": {"x": 1}}))
    argv = launcher_argv(load_recipe(path))
    assert argv[:3] == ["--cppo.pruning_rate=0.5", "--cppo.selective.enabled=true", "--cppo.selective.p_hard=0.2"]
    values, _, _ = split_argv(argv)
    assert CPPOConfig.from_dict(values) == CPPOConfig.from_dict({"pruning_rate": 0.5, "selective": {
        "enabled": True, "p_hard": 0.2}})
    path.write_text(yaml.safe_dump({"cppo": {"selective_rollout": True}, "openrlhf": {"x": 1}}))
    with pytest.warns(FutureWarning, match="cppo.selective_rollout is deprecated: write cppo.selective.enabled"):
        recipe = load_recipe(path)
    assert launcher_argv(recipe)[0] == "--cppo.selective.enabled=true"
