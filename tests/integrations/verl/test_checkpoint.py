"""What a stopped veRL run tells its user about resuming (cppo_megatron.integrations.verl.checkpoint)."""

from __future__ import annotations

from omegaconf import OmegaConf

from cppo_megatron.integrations.verl import checkpoint


def _config(tmp_path, **trainer):
    return OmegaConf.create({"trainer": {"default_local_dir": str(tmp_path / "ckpt"), **trainer}})


def test_latest_step_reads_veRLs_tracker(tmp_path):
    assert checkpoint.latest_step(tmp_path) is None
    (tmp_path / checkpoint.LATEST_FILE).write_text("12")
    assert checkpoint.latest_step(tmp_path) == 12
    (tmp_path / checkpoint.LATEST_FILE).write_text("")  # a tracker cut short: no step
    assert checkpoint.latest_step(tmp_path) is None


def test_resume_hint_says_what_a_rerun_does(tmp_path, monkeypatch):
    assert "saves no checkpoint (trainer.save_freq=-1)" in checkpoint.resume_hint(_config(tmp_path, save_freq=-1))
    cfg = _config(tmp_path, save_freq=5, resume_mode="auto")
    assert "No checkpoint was written yet (every 5 steps" in checkpoint.resume_hint(cfg)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / checkpoint.LATEST_FILE).write_text("10")
    assert checkpoint.resume_hint(cfg) == (
        f"Rerun the same command to resume from step 10 ({tmp_path / 'ckpt' / 'global_step_10'}; "
        "trainer.resume_mode=auto).")
    off = checkpoint.resume_hint(_config(tmp_path, save_freq=5, resume_mode="disable"))
    assert off.startswith("To resume from step 10, rerun with trainer.resume_mode=auto") and "disable starts over" in off
    # a relative folder is veRL's: from the working directory
    monkeypatch.chdir(tmp_path)
    rel = OmegaConf.create({"trainer": {"default_local_dir": "ckpt", "save_freq": 5}})
    assert checkpoint.checkpoint_dir(rel) == tmp_path / "ckpt" and "from step 10" in checkpoint.resume_hint(rel)
