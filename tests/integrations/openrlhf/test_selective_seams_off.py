"""OpenRLHF's selective-rollout seams where test_selective.py does not reach: off (the process did
not select it), and on, for a generator without a train dataloader and a dataloader that is not the
trainer's (evaluation): each hands the call through and files nothing."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest

from cppo_megatron import CPPOConfig
from cppo_megatron.integrations.openrlhf import selective


class Loader:
    pass


def seams():
    seen = []
    init = selective._wrap_generator_init(lambda self, *a, **k: seen.append(("init", a, k)))
    state = selective._wrap_loader_state(lambda self: {"epoch": 1})
    load = selective._wrap_loader_load(lambda self, sd: seen.append(("load", sd)) or "loaded")
    return seen, init, state, load


def test_off_the_seams_register_nothing_and_pass_the_state_through(monkeypatch):
    monkeypatch.setattr(selective, "_CONFIG", None)
    seen, init, state, load = seams()
    loader = Loader()
    generator = SimpleNamespace(prompts_dataloader=loader)
    init(generator, 1, k=2)
    assert loader not in selective._TRAIN_LOADERS and state(loader) == {"epoch": 1}
    # a checkpoint written with selective rollout, resumed without it: the entry is dropped, silently
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load(loader, {"epoch": 1, selective.STATE_KEY: {"x": 1}}) == "loaded"
    assert seen == [("init", (1,), {"k": 2}), ("load", {"epoch": 1})]


def test_on_a_generator_without_a_dataloader_and_an_unknown_loader_are_left_alone(monkeypatch):
    monkeypatch.setattr(selective, "_CONFIG", CPPOConfig(pruning_rate=0.75, selective={"enabled": True}))
    seen, init, state, load = seams()
    init(SimpleNamespace())  # no prompts_dataloader: nothing to key the train prompts by
    loader_without_dataset = Loader()
    init(SimpleNamespace(prompts_dataloader=loader_without_dataset))
    assert selective._TRAIN_LOADERS.get(loader_without_dataset) is not None
    other = Loader()  # an evaluation loader: not the trainer's
    assert other not in selective._TRAIN_LOADERS and state(other) == {"epoch": 1}
    assert load(other, {"epoch": 2}) == "loaded" and seen[-1] == ("load", {"epoch": 2})


@pytest.fixture(autouse=True)
def _forget_loaders():
    yield
    for loader in list(selective._TRAIN_LOADERS):
        if isinstance(loader, Loader):
            del selective._TRAIN_LOADERS[loader]
