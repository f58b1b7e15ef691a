"""The source patch applies to the installed OpenRLHF and hooks the patched module."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
import torch

from cppo_megatron import CPPOConfig
from cppo_megatron.integrations.openrlhf import hook, patching, pinned

pytestmark = pytest.mark.openrlhf


@pytest.fixture
def checkout(tmp_path):
    """A copy of the installed experience_maker.py laid out as an OpenRLHF checkout."""
    dst = tmp_path / patching.PATCHED_FILE
    dst.parent.mkdir(parents=True)
    shutil.copy(pinned.openrlhf_dir() / "trainer/ppo_utils/experience_maker.py", dst)
    return tmp_path


def test_patch_applies_to_the_installed_source(checkout):
    pfile = patching.default_patch_file()
    assert patching.status(patching.default_target(), pfile) in ("applicable", "applied")
    assert patching.status(checkout, pfile) == "applicable"
    assert patching.apply(checkout, pfile) == "applied"
    assert patching.apply(checkout, pfile) == "applied"  # idempotent
    assert "install_from_env(RemoteExperienceMaker)" in (checkout / patching.PATCHED_FILE).read_text()
    assert patching.apply(checkout, pfile, reverse=True) == "applicable"
    original = (pinned.openrlhf_dir() / "trainer/ppo_utils/experience_maker.py").read_text()
    assert (checkout / patching.PATCHED_FILE).read_text() == original


def test_patch_reports_a_conflict(checkout):
    path = checkout / patching.PATCHED_FILE
    path.write_text(path.read_text().replace("        return returns\n", "        return returns * 1\n"))
    assert patching.status(checkout, patching.default_patch_file()) == "conflict"
    assert patching.run_patch("check", target=str(checkout)) == 1


def _load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_patched_module_prunes_only_when_configured(checkout, monkeypatch, orl, make_args, make_maker, make_rollout):
    patching.apply(checkout, patching.default_patch_file())
    monkeypatch.delenv(hook.ENV_CONFIG, raising=False)
    plain = _load(checkout / patching.PATCHED_FILE, "patched_experience_maker_plain")
    assert not hook.is_installed(plain.RemoteExperienceMaker)

    monkeypatch.setenv(hook.ENV_CONFIG, json.dumps(CPPOConfig(pruning_rate=0.5).to_dict()))
    patched = _load(checkout / patching.PATCHED_FILE, "patched_experience_maker_cppo")
    try:
        assert hook.is_installed(patched.RemoteExperienceMaker)
        args = make_args("--rollout.n_samples_per_prompt", "4")
        maker = make_maker(args, maker_class=patched.RemoteExperienceMaker)
        out = maker.make_experience_batch(make_rollout([("a", [1, 0, 0, 0]), ("b", [1, 1, 0, 1])]))
        assert sum(len(e.sequences) for e in out) == 4 and len(maker.forwarded_uids) == 4
        assert all(torch.isfinite(e.advantages).all() for e in out)
    finally:
        hook.uninstall(patched.RemoteExperienceMaker)
