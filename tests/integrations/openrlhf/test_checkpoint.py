"""Which step an OpenRLHF run resumes at, what a stopped run tells its user, and the settings
under which OpenRLHF's own resume would lose prompts (cppo_megatron.integrations.openrlhf.checkpoint)."""

from __future__ import annotations

import pytest

from cppo_megatron.integrations.openrlhf import checkpoint

pytestmark = pytest.mark.openrlhf


def _save(ckpt, tag):
    (ckpt / "_actor").mkdir(parents=True, exist_ok=True)
    (ckpt / "_actor" / "latest").write_text(tag + "\n")


def test_resumed_step_is_the_step_openrlhf_loads(make_args, tmp_path):
    ckpt = tmp_path / "ckpt"
    on = make_args("--ckpt.path", str(ckpt), "--ckpt.load_enable")
    off = make_args("--ckpt.path", str(ckpt))
    assert checkpoint.resumed_step(on) == 0  # nothing saved: a fresh start
    (ckpt / "_actor").mkdir(parents=True)
    assert checkpoint.resumed_step(on) == 0  # a folder without 'latest': DeepSpeed loads nothing
    _save(ckpt, "global_step12")
    assert checkpoint.resumed_step(on) == 12 and checkpoint.resumed_step(off) == 0
    _save(ckpt, "best_global_step7")  # a best-metric save moves 'latest' too (save_latest=True)
    assert checkpoint.resumed_step(on) == 7
    _save(ckpt, "my_tag")
    with pytest.raises(ValueError, match="'my_tag'.*global_step<N>"):
        checkpoint.resumed_step(on)


def test_resume_hint_says_what_a_rerun_does(make_args, tmp_path):
    ckpt = tmp_path / "ckpt"
    assert "saves no checkpoint" in checkpoint.resume_hint(make_args("--ckpt.path", str(ckpt)))
    saving = make_args("--ckpt.path", str(ckpt), "--ckpt.save_steps", "10", "--ckpt.load_enable")
    assert "No checkpoint was written yet (every 10 steps" in checkpoint.resume_hint(saving)
    _save(ckpt, "global_step20")
    assert checkpoint.resume_hint(saving) == (
        f"Rerun the same command to resume from step 20 ({ckpt / '_actor' / 'global_step20'}; --ckpt.load_enable).")
    no_load = make_args("--ckpt.path", str(ckpt), "--ckpt.save_steps", "10")
    assert "rerun with --ckpt.load_enable" in checkpoint.resume_hint(no_load)


def test_buffered_generation_with_checkpoints_is_warned_about(make_args):
    assert checkpoint.checkpoint_warnings(make_args("--ckpt.save_steps", "5")) == []
    assert checkpoint.checkpoint_warnings(make_args("--rollout.vllm_generate_batch_size", "8")) == []  # no saves
    (line,) = checkpoint.checkpoint_warnings(
        make_args("--ckpt.save_steps", "5", "--rollout.batch_size", "2", "--rollout.vllm_generate_batch_size", "8"))
    assert "vllm_generate_batch_size 8 > --rollout.batch_size 2" in line and "never trains those prompts" in line


def test_the_audit_names_a_loaded_checkpoint_by_its_tag():
    from cppo_megatron.integrations.openrlhf.diagnostics.audit import _tag_of

    # load_ckpt returns DeepSpeed's load_path, the model-states file (deepspeed engine.py:4369-4379)
    assert _tag_of("/r/ckpt/checkpoints/_actor/global_step1/mp_rank_00_model_states.pt") == "global_step1"
    assert _tag_of("global_step2") == "global_step2"  # save_ckpt's tag
    assert _tag_of(None) is None
