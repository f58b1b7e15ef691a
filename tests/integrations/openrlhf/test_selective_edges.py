"""OpenRLHF's selective rollout where test_selective.py did not reach (scripts/coverage_floor.py): the
run state's refusals and its checkpoint checks, the record's checks of what came back, the note for
DataLoader workers, and the draws' bookkeeping; each by message or value."""

from __future__ import annotations

import pickle
import warnings
from types import SimpleNamespace

import pytest
import torch

from cppo_megatron import CPPOConfig
from cppo_megatron.core import ExplorationRates, SelectiveHistory, fill_batch
from cppo_megatron.integrations.openrlhf import selective
from cppo_megatron.integrations.openrlhf.selective import OpenRLHFSelective

CFG = CPPOConfig(pruning_rate=0.5, selective={"enabled": True})


@pytest.mark.parametrize("args,message", [
    ((CFG.to_dict(), 4, 0), "cfg must be a CPPOConfig, got dict"),
    ((CFG, 0, 0), r"num_prompts \(the training set's prompts\) must be an integer >= 1, got 0"),
    ((CFG, True, 0), r"num_prompts \(the training set's prompts\) must be an integer >= 1, got True"),
    ((CFG, 4, -1), r"step \(OpenRLHF's global step\) must be an integer >= 0, got -1"),
])  # fmt: skip
def test_the_run_state_refuses_what_it_cannot_hold(args, message):
    cfg, num_prompts, step = args
    with pytest.raises(ValueError, match=message):
        OpenRLHFSelective(cfg, num_prompts=num_prompts, step=step)


def _one_kept_step(state: OpenRLHFSelective, row: int = 3):
    draw = state.begin_call()
    draw.rounds.append(fill_batch([row], 1, SelectiveHistory(), seed=0, step=draw.step, rates=ExplorationRates()))
    draw.kept.append((row, "q", "a"))
    return draw


def test_a_record_for_another_step_than_the_draws_is_refused():
    state = OpenRLHFSelective(CFG, num_prompts=4, step=2)
    _one_kept_step(state)
    with pytest.raises(RuntimeError, match=r"the prompts of hook step 3 were drawn for step\(s\) \[2\]; one generation"):
        state.record(3, [3], torch.tensor([False]), torch.tensor([False]), torch.ones(2), 2)


def test_an_indexed_source_keeps_its_row_through_pickling():
    src = selective.IndexedSource({"name": "gsm8k"}, 12)
    back = pickle.loads(pickle.dumps(src))
    assert isinstance(back, selective.IndexedSource) and back.row == 12 and back.original == {"name": "gsm8k"}
    assert back == "{'name': 'gsm8k'}"


def test_a_dataloader_batch_that_is_not_openrlhfs_is_refused():
    with pytest.raises(ValueError, match=r"the prompt dataloader yielded int, not OpenRLHF's \(datasources, prompts"):
        selective._row_of(7, 0)
    with pytest.raises(ValueError, match="the prompt dataloader yielded 2 prompts in one batch; OpenRLHF 0.11.2"):
        selective._row_of((["d", "d"], ["q0", "q1"], ["a", "b"], [None, None]), 0)


def test_dataloader_workers_get_a_note_that_they_must_be_forked():
    args = SimpleNamespace(train=SimpleNamespace(async_enable=False), algo=SimpleNamespace(),
                           rollout=SimpleNamespace(vllm_generate_batch_size=None, batch_size=4),
                           data=SimpleNamespace(dataloader_num_workers=2))
    notes = selective.check_args(args)
    assert notes[-1].startswith("selective rollout with --data.dataloader_num_workers 2: the workers must be forked")


def test_the_state_of_a_generator_needs_selective_rollout_installed(monkeypatch):
    monkeypatch.setattr(selective, "_CONFIG", None)
    with pytest.raises(RuntimeError, match=r"selective rollout is not installed in this process \(selective.install"):
        selective.state_of(SimpleNamespace())


def test_returned_groups_must_match_the_kept_prompts():
    draw = selective.SelectiveDraw(step=0, serial=1, rounds=[], kept=[(5, "q5", "a5")])
    stranger = [SimpleNamespace(prompts=["q9"], labels=["a9"])] * 2
    with pytest.raises(RuntimeError, match="OpenRLHF returned a group for prompt 'q9' that was not kept by this call"):
        selective._match_groups(draw, stranger, 2)
    with pytest.raises(RuntimeError, match=r"kept prompts \[5\] came back without a group"):
        selective._match_groups(draw, [], 2)


def test_record_step_refuses_misaligned_rewards_and_mixed_groups(monkeypatch):
    monkeypatch.setattr(selective, "_CONFIG", CFG)

    class Generator:  # what the state is kept beside (weakly referenced)
        pass

    gen = Generator()
    state = OpenRLHFSelective(CFG, num_prompts=8)
    monkeypatch.setitem(selective._STATES, gen, state)
    draw = state.begin_call()

    def sample(row):
        s = SimpleNamespace(response_length=torch.tensor([3]))
        setattr(s, selective.DRAW_ATTR, draw)
        setattr(s, selective.INDEX_ATTR, row)
        return s

    samples = [sample(1), sample(1), sample(2), sample(2)]
    with pytest.raises(ValueError, match="record_step: 4 samples, 3 raw rewards, 4 rewards and 4 group ids must match"):
        selective.record_step(samples, torch.zeros(3), torch.zeros(4), torch.tensor([0, 0, 1, 1]), step=0)
    with pytest.raises(ValueError, match=r"step 0: group 0 mixes prompt indices \[1, 2\]"):
        selective.record_step(samples, torch.zeros(4), torch.zeros(4), torch.tensor([0, 0, 0, 1]), step=0)
    untagged = [SimpleNamespace(response_length=torch.tensor([3]))]
    with pytest.raises(ValueError, match="selective rollout is on but rollout sample 0 carries no prompt index"):
        selective.record_step(untagged, torch.zeros(1), torch.zeros(1), torch.tensor([0]), step=0)
    stray = selective.SelectiveDraw(step=0, serial=9, rounds=[], kept=[])
    orphan = SimpleNamespace(response_length=torch.tensor([3]))
    setattr(orphan, selective.DRAW_ATTR, stray)
    setattr(orphan, selective.INDEX_ATTR, 1)
    with pytest.raises(RuntimeError, match="the rollout's draws belong to 0 runs in this process; expected one"):
        selective.record_step([orphan], torch.zeros(1), torch.zeros(1), torch.tensor([0]), step=0)


def test_install_takes_a_cppo_config_only():
    with pytest.raises(ValueError, match="selective.install expects a CPPOConfig, got dict"):
        selective.install({"selective": {"enabled": True}})


def test_the_checkpoint_state_is_checked_against_the_run():
    saved = OpenRLHFSelective(CFG, num_prompts=4, step=3).state_dict()
    assert saved["step"] == 3 and saved["num_prompts"] == 4
    with pytest.raises(ValueError, match="^selective rollout checkpoint state must be a dict, got list$"):
        OpenRLHFSelective(CFG, num_prompts=4).load_state_dict([], step=3)
    with pytest.raises(ValueError, match="^selective rollout: the checkpoint of global step 2 holds the history of "
                                         "step 3; it was not saved by this run's hook$"):
        OpenRLHFSelective(CFG, num_prompts=4).load_state_dict(saved, step=2)
    other = OpenRLHFSelective(CFG, num_prompts=6)
    with pytest.warns(UserWarning, match="saved over a train data set of 4 prompts, this run has 6"):
        other.load_state_dict(saved, step=3)
    assert other.next_step == 3
    same = OpenRLHFSelective(CFG, num_prompts=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same data-set size: no warning
        same.load_state_dict(saved)
    assert same.next_step == 3  # the saved step when none is given
    with pytest.raises(ValueError, match="^selective rollout: the checkpoint state has no step; pass "):
        OpenRLHFSelective(CFG, num_prompts=4).load_state_dict({k: v for k, v in saved.items() if k != "step"})
