"""Refusal tests must not be able to launch anything: ``forbid`` replaces one of our own launch
boundaries (the function a launcher calls once its checks have passed) by a stub that fails the test
instead of acting. A check that lets a bad config through then fails the test at that boundary,
instead of building environments, starting Ray or torchrun, or replacing the test process.

The boundaries: ``cppo_megatron.integrations.verl.main.launch`` (the vLLM re-exec, the CPU mode's
start model, veRL's main_ppo), ``cppo_megatron.commands.train.start`` (torchrun or the in-process
Trainer), ``cppo_megatron.trainer.launch.run_torchrun`` (torchrun's processes),
``cppo_megatron.integrations.openrlhf.train.launch`` (OpenRLHF's train_ppo_ray) and
``cppo_megatron.integrations.openrlhf.cpu.prepare.prepare`` (the CPU recipe's start model and data).
"""

from __future__ import annotations

import importlib

import pytest

BOUNDARIES = {
    "verl": [("cppo_megatron.integrations.verl.main", "launch")],
    "train": [("cppo_megatron.commands.train", "start"), ("cppo_megatron.trainer.launch", "run_torchrun")],
    "openrlhf": [("cppo_megatron.integrations.openrlhf.train", "launch"),
                 ("cppo_megatron.integrations.openrlhf.cpu.prepare", "prepare")],
}


def forbid(monkeypatch: pytest.MonkeyPatch, host: str) -> list[str]:
    """Stub ``host``'s launch boundaries for this test; returns the list the stubs append their names
    to (before failing), for a test that wants to say which boundary was reached."""
    reached: list[str] = []
    for module_name, attr in BOUNDARIES[host]:
        module = importlib.import_module(module_name)
        getattr(module, attr)  # the boundary exists (a rename must not make the guard a no-op)

        def stub(*args, _where=f"{module_name}.{attr}", **kwargs):
            reached.append(_where)
            pytest.fail(f"a refusal test reached the launch boundary {_where}: a check let the config through",
                        pytrace=False)

        monkeypatch.setattr(module, attr, stub)
    return reached
