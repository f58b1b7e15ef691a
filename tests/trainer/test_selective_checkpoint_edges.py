"""The embedded trainer's selective rollout and checkpoints where their tests did not reach
(scripts/coverage_floor.py): calls out of order, a round that skips every candidate, counts that
do not add up, the ranks' fingerprint, the warning's default stream; a checkpoint written without
the trainer state, one file missing, an older checkpoint pruned, and a resume with nothing readable."""

from __future__ import annotations

import pytest
import torch

from cppo_megatron import CPPOConfig
from cppo_megatron.core import PromptSampler
from cppo_megatron.trainer.checkpoint import (
    KEEP_LAST,
    CorruptCheckpoint,
    checkpoints,
    filesystem_peers,
    find_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from cppo_megatron.trainer.selective import SelectiveRollout

FLOOR = dict(p_easy=0.05, p_hard=0.05, p_min=0.05)


def _at_the_floor(**kw) -> SelectiveRollout:
    """Both prompts of a 2-prompt set easy 10 times in a row: each kept with probability 0.01."""
    sel = SelectiveRollout(CPPOConfig(pruning_rate=0.5, selective={"enabled": True, **FLOOR}, seed=0), group_size=2,
                           num_prompts=2, **kw)
    for step in range(10):
        sel.history.update(torch.tensor([0, 1]), torch.tensor([True, True]), torch.tensor([True, True]), step=step)
    return sel


def test_groups_that_were_not_drawn_through_the_state_are_refused():
    sel = SelectiveRollout(CPPOConfig(selective={"enabled": True}), group_size=2, num_prompts=4)
    sampler = PromptSampler(4, shuffle=False)
    sel.begin_step(0, sampler)
    assert sel.draw(sampler, 2) == [0, 1]  # an empty history keeps every candidate
    with pytest.raises(ValueError, match=r"^selective rollout, step 0: 3 groups were generated but the draws kept 2 prompts \(2 drawn = 0 "
                                         r"skipped \+ 2 kept\): every kept prompt"):
        sel.end_step(torch.tensor([0, 1, 2]), torch.zeros(6), torch.zeros(6), torch.ones(6, dtype=torch.int64))


def test_ranks_that_decided_alike_have_one_fingerprint():
    a, b = (SelectiveRollout(CPPOConfig(selective={"enabled": True}), group_size=2, num_prompts=4) for _ in range(2))
    assert a.fingerprint() == b.fingerprint() and len(a.fingerprint()) == 16
    a.history.update(torch.tensor([3]), torch.tensor([True]), torch.tensor([False]), step=0)
    assert a.fingerprint() != b.fingerprint()


def test_the_short_round_warning_goes_to_stderr_by_default(capfd):
    sel = SelectiveRollout(CPPOConfig(pruning_rate=0.5, selective={"enabled": True, **FLOOR}, seed=0), group_size=2,
                           num_prompts=3)
    for step in range(10):  # prompts 0 and 1 at the floor, prompt 2 new
        sel.history.update(torch.tensor([0, 1]), torch.tensor([True, True]), torch.tensor([True, True]), step=step)
    sampler = PromptSampler(3, shuffle=False)
    sel.begin_step(10, sampler)
    # at most 2 + 3 candidates: 0, 1 skipped, 2 kept, 0, 1 skipped (a prompt's draw is fixed within a step)
    assert sel.draw(sampler, 2) == [2] and sel.short_rounds == 1
    assert capfd.readouterr().err.startswith("warning: selective rollout generated 1 of the 2 prompts asked in step "
                                             "10: it skipped 4 of 5 candidates")


def test_the_filesystem_probe_of_one_process_sees_itself(tmp_path):
    assert filesystem_peers(tmp_path) == [0]  # the default gather of one process


def test_a_leader_must_be_given_the_trainer_state(tmp_path):
    with pytest.raises(ValueError, match="^save_checkpoint: rank 0 writes trainer.pt on its filesystem but got no "):
        save_checkpoint(tmp_path, 1, None, {"w": torch.ones(1)})


def test_only_the_last_checkpoints_are_kept(tmp_path):
    for step in range(1, KEEP_LAST + 3):
        save_checkpoint(tmp_path, step, {"s": step}, {"w": torch.full((1,), float(step))})
    assert [p.name for p in checkpoints(tmp_path)] == [f"step_{s:06d}" for s in range(KEEP_LAST + 2, 2, -1)]


def test_a_missing_shard_is_named_and_resume_falls_back_then_gives_up(tmp_path):
    save_checkpoint(tmp_path, 1, {"s": 1}, {"w": torch.ones(1)})
    save_checkpoint(tmp_path, 2, {"s": 2}, {"w": torch.ones(1)})
    (tmp_path / "checkpoints" / "step_000002" / "policy_rank00000.pt").unlink()
    with pytest.raises(CorruptCheckpoint, match="policy_rank00000.pt is missing$"):
        load_checkpoint(tmp_path / "checkpoints" / "step_000002", 0)
    path, state, _ = find_checkpoint(tmp_path, 0)  # no log: the skip is silent
    assert path.name == "step_000001" and state["s"] == 1
    (tmp_path / "checkpoints" / "step_000001" / "trainer.pt").write_bytes(b"truncated")
    with pytest.raises(FileNotFoundError, match="^--resume: no readable checkpoint under "):
        find_checkpoint(tmp_path, 0)
    with pytest.raises(FileNotFoundError, match="^--resume: no checkpoint under "):
        find_checkpoint(tmp_path / "empty", 0)
