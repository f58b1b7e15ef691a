"""Drift guard: the veRL methods the plugin hooks or relies on are the ones it was built on."""

from __future__ import annotations

import pytest


def test_installed_verl_is_the_pinned_version(plugin):
    import verl

    assert verl.__version__ == plugin.SUPPORTED_VERL


def test_megatron_versions_are_the_pinned_ones():
    from importlib.metadata import version

    from cppo_megatron.integrations.verl.diagnostics import drift

    if not drift.megatron_installed():
        pytest.skip("megatron-core / mbridge not installed")
    # the versions the Megatron CPU seams were written against (their sources: MEGATRON_PINNED,
    # checked with the rest by test_hooked_methods_unchanged)
    assert {name: version(name) for name in drift.MEGATRON_VERSIONS} == drift.MEGATRON_VERSIONS


def test_bridge_versions_are_the_pinned_ones():
    from importlib.metadata import version

    from cppo_megatron.integrations.verl.diagnostics import drift

    if not drift.bridge_installed():
        pytest.skip("Megatron-Bridge not installed (.venv-bridge)")
    # the versions the Megatron-Bridge route's CPU seams were run on (sources: BRIDGE_PINNED)
    assert {name: version(name) for name in drift.BRIDGE_VERSIONS} == drift.BRIDGE_VERSIONS


def test_hooked_methods_unchanged(plugin):
    from cppo_megatron.integrations.verl.diagnostics import drift

    changed = drift.changed()
    assert not changed, (
        "veRL changed under the CPPO plugin; re-read these methods, adapt the hook, then update "
        "drift.PINNED:\n  " + "\n  ".join(changed)
    )


def test_drift_names_the_changed_method(plugin):
    from cppo_megatron.integrations.verl.diagnostics import drift

    name = "verl.trainer.ppo.v1.trainer_base:PPOTrainer._balance_batch"
    pinned = dict(drift.PINNED, **{name: "0" * 16})
    pinned["verl.trainer.ppo.ray_trainer:RayPPOTrainer._no_such_method"] = "0" * 16
    out = drift.changed(pinned)
    assert len(out) == 2
    assert out[0].startswith(name + " (source hash ")
    assert "_no_such_method (gone" in out[1]


def test_hash_is_of_verl_source_not_our_wrapper(plugin):
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    from cppo_megatron.integrations.verl.diagnostics import drift

    assert plugin.is_installed("verl.trainer.ppo.v1.trainer_base")
    from cppo_megatron.integrations import wrap

    assert wrap.is_wrapped(PPOTrainer._balance_batch)  # the hash must see through our layer
    assert drift._resolve("verl.trainer.ppo.v1.trainer_base:PPOTrainer._balance_batch") is (
        wrap.original(PPOTrainer._balance_batch)
    ) is not PPOTrainer._balance_batch
    with pytest.raises(ValueError):
        drift.source_hash("no-colon-here")


def test_report_keeps_the_gpu_path_apart_from_the_cpu_mode(plugin, monkeypatch):
    from cppo_megatron.integrations.verl.diagnostics import drift

    gpu = "verl.trainer.ppo.v1.trainer_base:PPOTrainer._balance_batch"
    cpu = "verl.utils.distributed:initialize_global_process_group_ray"
    assert gpu in drift.PINNED and cpu in drift.CPU_PINNED and not set(drift.PINNED) & set(drift.CPU_PINNED)
    out = drift.report(cpu_pinned=dict(drift.CPU_PINNED, **{cpu: "0" * 16}), megatron_pinned={})
    assert out.gpu_path == [] and [c.split(" (")[0] for c in out.cpu_mode] == [cpu]
    assert "only the CPU mode (VERL_PLATFORM=cpu) uses them, the GPU path is unaffected" in out.warning()
    assert cpu in out.warning()
    out = drift.report(pinned=dict(drift.PINNED, **{gpu: "0" * 16}), megatron_pinned={})
    assert [c.split(" (")[0] for c in out.gpu_path] == [gpu] and out.cpu_mode == [] and out.warning() == ""
    # the defaults: each set's drift lands in its own list
    monkeypatch.setitem(drift.CPU_PINNED, cpu, "0" * 16)
    out = drift.report()
    assert out.gpu_path == [] and [c.split(" (")[0] for c in out.cpu_mode] == [cpu]
    monkeypatch.setitem(drift.CPU_PINNED, cpu, drift.source_hash(cpu))
    monkeypatch.setitem(drift.PINNED, gpu, "0" * 16)
    out = drift.report()
    assert [c.split(" (")[0] for c in out.gpu_path] == [gpu] and out.cpu_mode == []
    monkeypatch.setitem(drift.PINNED, gpu, drift.source_hash(gpu))
    if drift.megatron_installed():  # another megatron-core than the CPU seams' is a CPU-mode warning
        monkeypatch.setitem(drift.MEGATRON_VERSIONS, "megatron-core", "0.18.2")
        out = drift.report()
        assert out.versions == ["megatron-core 0.16.1, the CPU seams' 0.18.2"] and out.gpu_path == []
        assert drift.report(megatron_pinned={}).versions == []  # an explicit set: its functions only


def test_check_fails_on_gpu_path_drift_and_warns_on_cpu_mode_drift(plugin):
    from cppo_megatron.commands.verl import verdict

    ok = {"verl": "0.9.1", "plugin_loaded": True, "estimator": True, "drift": [], "cpu_mode_drift": [],
          "cpu_mode_versions": []}
    assert verdict(dict(ok)) == (0, [])
    code, lines = verdict(dict(ok, drift=["verl.trainer.ppo.ray_trainer:RayPPOTrainer.fit (source hash 1, pinned 2)"]))
    assert code == 1 and lines[0].startswith("error: 1 veRL function(s) the plugin's GPU path") and "RayPPOTrainer.fit" in lines[0]
    code, lines = verdict(dict(ok, cpu_mode_drift=["mbridge.core.llm_bridge:LLMBridge._model_provider (gone: ...)"],
                               cpu_mode_versions=["mbridge 0.16.0, the CPU seams' 0.15.1"]))
    assert code == 0 and len(lines) == 1 and lines[0].startswith("warning: 1 function(s) the CPU mode patches")
    assert "mbridge 0.16.0" in lines[0] and "LLMBridge._model_provider" in lines[0]
    code, lines = verdict(dict(ok, verl="0.9.2"))  # the drift guard judges a newer 0.9.x
    assert code == 0 and lines == ["warning: veRL 0.9.2 is not the release the plugin was built on (0.9.1); "
                                   "the functions it hooks are unchanged"]
    assert verdict(dict(ok, plugin_loaded=False))[0] == 1
