"""Plugin discovery in a fresh interpreter, as veRL's own processes see it, and the entry
point command (dry run) on the real composed config."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = """
import json, sys
import verl
from verl.trainer.ppo import core_algos
hook = sys.modules.get("cppo_megatron.integrations.verl.hook")
importhook = sys.modules.get("cppo_megatron.integrations.importhook")
print(json.dumps({
    "loaded": "cppo_megatron.integrations.verl" in sys.modules,
    "estimator": getattr(core_algos.ADV_ESTIMATOR_REGISTRY.get("cppo"), "__module__", None),
    "finder": hook is not None and importhook._FINDER in sys.meta_path
              and "verl.trainer.ppo.v1.trainer_base" in importhook.pending(hook._patch_module),
    "trainer_imported": "verl.trainer.ppo.v1.trainer_base" in sys.modules,
}))
"""


def probe(env_update: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_USE_EXTERNAL")}
    env.update(env_update)
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_entry_point_and_external_modules_in_fresh_interpreters():
    # 1) `import verl` finds the `verl.plugins` entry point from pyproject.toml
    got = probe({})
    assert got == {
        "loaded": True,
        "estimator": "cppo_megatron.integrations.verl.estimator",
        "finder": True,
        "trainer_imported": False,  # the hook waits for the trainer module: workers pay nothing
    }
    # 2) entry points off: VERL_USE_EXTERNAL_MODULES alone (older setups, Ray runtime env)
    got = probe({"VERL_USE_EXTERNAL_PLUGINS": "none", "VERL_USE_EXTERNAL_MODULES": "cppo_megatron.integrations.verl"})
    assert got["loaded"] and got["estimator"] and got["finder"]


def test_main_dry_run_applies_allocation(plugin, tmp_path, monkeypatch, capsys):
    from omegaconf import OmegaConf

    from cppo_megatron import cli

    monkeypatch.chdir(tmp_path)  # hydra writes its outputs/ folder here
    argv = [
        "verl", "--cppo-dry-run",
        "actor_rollout_ref.rollout.n=16", "data.train_batch_size=16",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8", "cppo.pruning_rate=0.875",
    ]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "data.train_batch_size 16 -> 128 prompts" in out
    cfg = OmegaConf.create(out.split("\n", 1)[1])  # line 1: the plan; then the config as YAML
    assert cfg.data.train_batch_size == 128 and cfg.algorithm.adv_estimator == "cppo"
    assert cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 8
    assert cfg.ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES == "cppo_megatron.integrations.verl"


def test_dry_run_without_a_recipe_warns_that_g1_prunes_nothing(plugin, tmp_path, monkeypatch, capsys):
    """The bare entry point has veRL's default rollout.n = 1: P = 0.875 would prune nothing."""
    from cppo_megatron import cli

    monkeypatch.chdir(tmp_path)
    assert cli.main(["verl", "--cppo-dry-run"]) == 0
    plan, warning = capsys.readouterr().out.splitlines()[:2]
    assert "keep 1 of G=1" in plan
    assert warning.startswith("warning: cppo P=0.875 with G=1") and "actor_rollout_ref.rollout.n" in warning


def test_dry_run_of_a_recipe_re_derives_allocation_from_an_overridden_rate(plugin, tmp_path, monkeypatch, capsys):
    """The recipe declares 16 prompts (the GRPO batch) and P = 0.875 (x8); P = 0.75 on the
    command line keeps 4 of 16, so 16 x 16/4 = 64 prompts and still 256 kept."""
    from pathlib import Path

    from cppo_megatron import cli

    monkeypatch.chdir(tmp_path)
    recipes = Path(__file__).resolve().parents[3] / "recipes" / "verl"
    assert cli.main(["verl", "--cppo-dry-run", f"--config-path={recipes}", "--config-name=qwen2.5-1.5b-gsm8k-cppo",
                     "cppo.pruning_rate=0.75"]) == 0
    plan = capsys.readouterr().out.splitlines()[0]
    assert plan == ("CPPO allocation=True: keep 4 of G=16; data.train_batch_size 16 -> 64 prompts; "
                    "actor.ppo_mini_batch_size 16 -> 16; 256 completions kept per step")
