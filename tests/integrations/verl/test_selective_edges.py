"""veRL's selective rollout where test_selective.py did not reach (scripts/coverage_floor.py): the run
state's refusals, a fetch's prompt index checks, a record in a step that drew nothing through the
hook, and the install against a veRL whose seams moved. The fetch that runs out of candidates is
issue 43 item 2's (another branch), not pinned here."""

from __future__ import annotations

import types

import pytest
import torch

from cppo_megatron import CPPOConfig
from cppo_megatron.integrations.verl import selective
from cppo_megatron.integrations.verl.selective import VerlSelective

CFG = CPPOConfig(pruning_rate=0.75, selective={"enabled": True})


@pytest.mark.parametrize("num_prompts,group_size,message", [
    (0, 8, r"num_prompts \(the training set's prompts\) must be an integer >= 1, got 0"),
    (4, 0, r"group_size must be an integer >= 1, got 0"),
])
def test_the_run_state_refuses_an_empty_dataset_or_group(num_prompts, group_size, message):
    with pytest.raises(ValueError, match=message):
        VerlSelective(CFG, num_prompts=num_prompts, group_size=group_size)


class Row(dict):
    """A one-row batch as veRL's dataloader hands it (TensorDict-like: len, keys, items)."""

    def __len__(self):
        return len(next(iter(self.values())))


def _fetch(row):
    state = VerlSelective(CFG, num_prompts=4, group_size=8)
    trainer = types.SimpleNamespace(global_steps=1)
    return state.fetch(trainer, lambda _trainer: row)


@pytest.mark.parametrize("row,message", [
    (Row(uid=["a", "b"], index=[0, 1]), "the dataloader handed 2 prompts in one fetch; the hook replaces skipped "
                                        "prompts one at a time, set data.gen_batch_size=1"),
    (Row(uid=["a"]), "the dataloader's batch has no 'index' field"),
    (Row(uid=["a"], index=["row-7"]), "prompt index 'row-7' is not an int; give every row of data.train_files an int"),
])
def test_a_fetch_needs_one_prompt_with_an_int_index(row, message):
    with pytest.raises(ValueError, match=message):
        _fetch(row)


def test_a_fetch_keeps_a_new_prompt_and_remembers_its_uid():
    state = VerlSelective(CFG, num_prompts=4, group_size=8)
    row = Row(uid=["u7"], index=[3])
    assert state.fetch(types.SimpleNamespace(global_steps=2), lambda _trainer: row) is row
    assert state.generated == {"u7": 3} and state.drawn_this_step == [3] and state.step == 2


def test_response_lengths_must_match_the_rows():
    state = VerlSelective(CFG, num_prompts=4, group_size=8)
    with pytest.raises(ValueError, match="selective rollout: 1 response lengths for 2 rows at the CPPO seam"):
        state.record(1, ["a", "a"], torch.zeros(2), torch.ones(1, dtype=torch.int64))


def test_a_step_that_drew_nothing_through_the_hook_records_nothing():
    state = VerlSelective(CFG, num_prompts=4, group_size=8)
    out = state.record(5, ["x", "x"], torch.tensor([1.0, 0.0]), torch.tensor([3, 4]))
    assert state.step == 5 and state.history.num_prompts == 0
    assert out["selective/groups_recorded"] == 0.0 and out["selective/groups_unknown"] == 1.0
    assert out["selective/prompts_drawn"] == 0.0


def test_install_refuses_a_verl_whose_seams_moved():
    module = types.ModuleType(selective.TARGET[0])
    with pytest.raises(RuntimeError, match=r"cppo: verl.trainer.ppo.v1.trainer_base.PPOTrainer._fetch_one_gen_batch "
                                           r"is gone; veRL changed \(pinned 0.9.1\)"):
        selective._patch(module)


def test_uninstall_takes_the_seams_off_and_install_puts_them_back(plugin):
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    from cppo_megatron.integrations import wrap

    try:
        selective.uninstall()
        assert not any(wrap.is_wrapped(PPOTrainer.__dict__[name], selective.WRAP_TAG) for name in selective.SEAMS)
    finally:
        selective.install()
    assert all(wrap.is_wrapped(PPOTrainer.__dict__[name], selective.WRAP_TAG) for name in selective.SEAMS)


def test_uninstall_before_verls_trainer_is_imported_drops_the_pending_seams(plugin, monkeypatch):
    """``uninstall`` in a process that has not imported veRL's V1 trainer: the seams wait on its import
    (``after_import``); uninstall drops that wait and touches no class."""
    import sys

    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    from cppo_megatron.integrations import importhook, wrap

    try:
        with monkeypatch.context() as mp:
            mp.delitem(sys.modules, selective.TARGET[0])
            selective.install()
            assert importhook.pending(selective._patch) == [selective.TARGET[0]]
            selective.uninstall()
            assert importhook.pending(selective._patch) == [] and selective.TARGET[0] not in sys.modules
        assert all(wrap.is_wrapped(PPOTrainer.__dict__[name], selective.WRAP_TAG) for name in selective.SEAMS)
    finally:
        selective.install()
    assert importhook.pending(selective._patch) == [selective.TARGET[0]]
