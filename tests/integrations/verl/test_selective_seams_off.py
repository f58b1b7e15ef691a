"""veRL's selective-rollout seams on a run without selective rollout (each hands the call to veRL
untouched, writes and reads no state), and where a resumed run's state is looked for under
``trainer.resume_mode=resume_path``: branches test_selective.py does not reach."""

from __future__ import annotations

import os
from omegaconf import OmegaConf

from cppo_megatron.integrations.verl import checkpoint, selective


class _Trainer:  # the run settings are cached per trainer (a weak key): a plain object, as veRL's is
    def __init__(self, config, global_steps):
        self.config, self.global_steps = config, global_steps


def trainer_of(config, global_steps=3):
    return _Trainer(config, global_steps)


def test_without_selective_rollout_the_seams_call_verl_and_keep_no_state(config, tmp_path):
    OmegaConf.update(config, "trainer.default_local_dir", str(tmp_path / "ckpt"), force_add=True)
    assert not selective.enabled(config)
    trainer, calls = trainer_of(config), []
    saved = selective._saving(lambda self, *a, **k: calls.append(("save", a, k)) or "saved")(trainer, 1, x=2)
    loaded = selective._loading(lambda self, *a, **k: calls.append(("load", a, k)) or "loaded")(trainer)
    metrics = {"a": 1.0}
    selective.record(trainer, ["p0"], torch_zeros(1), torch_zeros(1), metrics)
    assert (saved, loaded, metrics) == ("saved", "loaded", {"a": 1.0})
    assert calls == [("save", (1,), {"x": 2}), ("load", (), {})]
    assert not (tmp_path / "ckpt").exists() and not selective.has_state(trainer)


def test_a_fresh_run_loads_no_selective_state(config, tmp_path):
    OmegaConf.update(config, "cppo.selective.enabled", True, force_add=True)
    OmegaConf.update(config, "trainer.default_local_dir", str(tmp_path / "ckpt"), force_add=True)
    trainer = trainer_of(config, global_steps=0)  # veRL found no checkpoint: step 0
    assert selective._loading(lambda self: "fresh")(trainer) == "fresh" and not selective.has_state(trainer)


def test_the_state_of_a_resume_path_run_is_read_from_that_path(config, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    OmegaConf.update(config, "trainer.resume_mode", "resume_path", force_add=True)
    OmegaConf.update(config, "trainer.resume_from_path", "old/global_step_7", force_add=True)
    OmegaConf.update(config, "trainer.default_local_dir", "ckpt", force_add=True)
    trainer = trainer_of(config, global_steps=9)
    assert checkpoint.step_folder(trainer, resuming=True) == os.path.join(str(tmp_path), "old/global_step_7")
    assert checkpoint.step_folder(trainer, resuming=False) == os.path.join(str(tmp_path), "ckpt", "global_step_9")
    OmegaConf.update(config, "trainer.resume_from_path", "/abs/global_step_7")
    assert checkpoint.step_folder(trainer, resuming=True) == "/abs/global_step_7"


def torch_zeros(n):
    import torch

    return torch.zeros(n)
