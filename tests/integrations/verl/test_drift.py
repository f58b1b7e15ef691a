"""Drift guard: the veRL methods the plugin hooks or relies on are the ones it was built on."""

from __future__ import annotations

import pytest


def test_installed_verl_is_the_pinned_version(plugin):
    import verl

    assert verl.__version__ == plugin.SUPPORTED_VERL


def test_megatron_versions_are_the_pinned_ones():
    from importlib.metadata import version

    from cppo_megatron.integrations.verl import drift

    if not drift.megatron_installed():
        pytest.skip("megatron-core / mbridge not installed")
    # the versions the Megatron CPU seams were written against (their sources: MEGATRON_PINNED,
    # checked with the rest by test_hooked_methods_unchanged)
    assert {name: version(name) for name in drift.MEGATRON_VERSIONS} == drift.MEGATRON_VERSIONS


def test_bridge_versions_are_the_pinned_ones():
    from importlib.metadata import version

    from cppo_megatron.integrations.verl import drift

    if not drift.bridge_installed():
        pytest.skip("Megatron-Bridge not installed (.venv-bridge)")
    # the versions the Megatron-Bridge route's CPU seams were run on (sources: BRIDGE_PINNED)
    assert {name: version(name) for name in drift.BRIDGE_VERSIONS} == drift.BRIDGE_VERSIONS


def test_hooked_methods_unchanged(plugin):
    from cppo_megatron.integrations.verl import drift

    changed = drift.changed()
    assert not changed, (
        "veRL changed under the CPPO plugin; re-read these methods, adapt the hook, then update "
        "drift.PINNED:\n  " + "\n  ".join(changed)
    )


def test_drift_names_the_changed_method(plugin):
    from cppo_megatron.integrations.verl import drift

    name = "verl.trainer.ppo.v1.trainer_base:PPOTrainer._balance_batch"
    pinned = dict(drift.PINNED, **{name: "0" * 16})
    pinned["verl.trainer.ppo.ray_trainer:RayPPOTrainer._no_such_method"] = "0" * 16
    out = drift.changed(pinned)
    assert len(out) == 2
    assert out[0].startswith(name + " (source hash ")
    assert "_no_such_method (gone" in out[1]


def test_hash_is_of_verl_source_not_our_wrapper(plugin):
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    from cppo_megatron.integrations.verl import drift

    assert plugin.is_installed("verl.trainer.ppo.v1.trainer_base")
    assert drift._resolve("verl.trainer.ppo.v1.trainer_base:PPOTrainer._balance_batch") is (
        PPOTrainer._balance_batch.__cppo_original__
    )
    with pytest.raises(ValueError):
        drift.source_hash("no-colon-here")
