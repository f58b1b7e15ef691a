"""Shared fixtures: the pinned veRL's real config, composed by hydra (once per session)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("verl", reason="veRL is not installed (extra: verl)")

ROOT = Path(__file__).resolve().parents[3]
RECIPES = ROOT / "recipes" / "verl"
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def compose(config_dir: str | Path, name: str, overrides: list[str] | None = None):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return hydra_compose(config_name=name, overrides=list(overrides or []))


@pytest.fixture(scope="session")
def plugin():
    import cppo_megatron.integrations.verl as plugin

    plugin.load()
    return plugin


@pytest.fixture(scope="session")
def base_config(plugin):
    """cppo_trainer (veRL's ppo_trainer + cppo group), G=8, P=0.75, tiny mini-batches."""
    from cppo_megatron.integrations.verl.main import CONFIG_DIR

    return compose(
        CONFIG_DIR,
        "cppo_trainer",
        [
            "actor_rollout_ref.rollout.n=8",
            "cppo.pruning_rate=0.75",
            "data.train_batch_size=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=1",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        ],
    )


@pytest.fixture
def config(base_config):
    import copy

    return copy.deepcopy(base_config)


@pytest.fixture(scope="module")
def shm_registry(tmp_path_factory):
    """A module's CPU runs record in one registry what vLLM and veRL's sync make in /dev/shm and /tmp
    (integrations/vllm_shm.py; every run's launcher removes its own at its end); at the module's end
    nothing recorded may be left (``ls /dev/shm`` of our runs: empty). Other jobs' segments on a shared
    machine are not ours and are not looked at."""
    from cppo_megatron.integrations import vllm_shm

    registry = tmp_path_factory.mktemp("shm") / "registry.txt"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(vllm_shm.REGISTRY_ENV, str(registry))
        yield registry
    left = vllm_shm.left(registry)
    print(f"shm registry: {len(vllm_shm.recorded(registry))} names recorded by this module's runs, left {left}")
    assert left == [], f"our runs left {left} (recorded in {registry})"


@pytest.fixture
def host_audit(plugin):
    """This host's observers and audit, for ``audit_on`` (tests/integrations/conftest.py), after
    ``load()`` as in a veRL process."""
    from cppo_megatron.integrations.verl import observers
    from cppo_megatron.integrations.verl.diagnostics import audit

    return observers, audit
