"""What a stopped veRL run tells its user about resuming (cppo_megatron.integrations.verl.checkpoint)."""

from __future__ import annotations

import pytest
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


class _State:  # what state_file_seams reads of a feature's state
    def __init__(self, value=0):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


class _Trainer:  # what the wrappers read of veRL's V1 PPOTrainer: its config and step
    def __init__(self, config, step):
        self.config, self.global_steps = config, step


def _seams(states, log, on=True):
    return checkpoint.state_file_seams(
        "cppo_thing.pt", "thing", lambda config: on, lambda t: states.setdefault(t, _State()),
        missing=lambda t: log.append(("missing", t.global_steps)) or "starting afresh",
        loaded=lambda t, state, step: log.append(("loaded", step, state.value)))


def test_a_features_state_rides_in_the_step_folder_before_veRLs_save_and_comes_back(tmp_path):
    cfg = _config(tmp_path, resume_mode="auto")
    states, log, calls = {}, [], []
    saving, loading = _seams(states, log)
    trainer = _Trainer(cfg, 4)
    states[trainer] = _State(41)

    def save(self):  # veRL's own save: the feature's file is already there
        calls.append((tmp_path / "ckpt" / "global_step_4" / "cppo_thing.pt").is_file())

    saving(save)(trainer)
    assert calls == [True]
    fresh = _Trainer(cfg, 4)
    assert loading(lambda self: "veRL's return")(fresh) == "veRL's return"
    assert states[fresh].value == 41 and log == [("loaded", 4, 41)]
    # nothing resumed (step 0): no read, no warning
    assert loading(lambda self: None)(_Trainer(cfg, 0)) is None and log == [("loaded", 4, 41)]


def test_a_checkpoint_without_the_file_warns_naming_folder_feature_and_consequence(tmp_path):
    folder = tmp_path / "elsewhere"
    cfg = _config(tmp_path, resume_mode="resume_path", resume_from_path=str(folder))
    states, log = {}, []
    _, loading = _seams(states, log)
    with pytest.warns(UserWarning) as seen:
        loading(lambda self: None)(_Trainer(cfg, 9))
    assert str(seen[0].message) == (f"cppo: checkpoint {folder} has no thing state (cppo_thing.pt); starting afresh")
    assert log == [("missing", 9)]
    saving, _ = _seams(states, log)
    saving(lambda self: None)(_Trainer(cfg, 9))  # a resumed run saves into its own folder, not the one it came from
    assert (tmp_path / "ckpt" / "global_step_9" / "cppo_thing.pt").is_file() and not folder.exists()


def test_the_seams_are_inert_when_the_feature_is_off_and_refuse_a_path_for_a_file(tmp_path):
    cfg = _config(tmp_path)
    states, log = {}, []
    saving, loading = _seams(states, log, on=False)
    saving(lambda self: None)(_Trainer(cfg, 2))
    loading(lambda self: None)(_Trainer(cfg, 2))
    assert not (tmp_path / "ckpt").exists() and states == {} and log == []
    with pytest.raises(ValueError, match=r"file='a/b.pt'; pass a bare file name"):
        checkpoint.state_file_seams("a/b.pt", "thing", bool, id, missing=str)
