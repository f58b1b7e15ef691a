"""Wall-clock mode (integrations/verl/diagnostics/clock.py) without Ray: the hf rollout server keeps the
policy in force at each wall-clock mark, the sync log dates every policy, and the legacy
trainer's budget stop makes the right step veRL's last one."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
import torch

from .test_cpu_mode import hf_dir, make_server  # noqa: F401 - the fixture and the server factory


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def shifted(state: dict, by: float) -> dict:
    return {k: v + by for k, v in state.items()}


def test_settings_are_validated(tmp_path):
    from cppo_megatron.integrations.verl.diagnostics import clock

    s = clock.write_settings(tmp_path / "c", 40, [10, 20, 40])
    assert json.loads((tmp_path / "c" / "clock.json").read_text()) == {"budget_s": 40.0, "marks": [10.0, 20.0, 40.0]}
    assert s.marks == (10.0, 20.0, 40.0)
    with pytest.raises(ValueError, match="marks must be increasing"):
        clock.write_settings(tmp_path / "d", 40, [20, 10])
    with pytest.raises(ValueError, match="marks must be increasing"):
        clock.write_settings(tmp_path / "d", 40, [10, 50])
    with pytest.raises(ValueError, match="budget_s must be > 0"):
        clock.write_settings(tmp_path / "d", 0, [10])


def test_policy_at_marks_is_the_last_sync_before_each_mark():
    from cppo_megatron.integrations.verl.diagnostics.clock import policy_at_marks

    syncs = [(0, 0.0), (1, 12.0), (2, 25.0), (3, 41.0)]
    assert policy_at_marks([10, 20, 25, 30, 40, 50], syncs) == {10: 0, 20: 1, 25: 2, 30: 2, 40: 2, 50: 3}
    assert policy_at_marks([5], []) == {5: None}


def test_server_saves_the_policy_in_force_at_each_mark(hf_dir, tmp_path, monkeypatch):  # noqa: F811
    """Syncs at 0 (start), 12, 25, 41 s; marks 10, 20, 30, 40: the snapshots hold the start
    weights, step 1's, step 2's and step 2's again (step 3 arrived after 40 s)."""
    from cppo_megatron.integrations.verl.diagnostics import clock

    clock.write_settings(tmp_path / "clk", 40, [10, 20, 30, 40])
    monkeypatch.setenv(clock.ENV, str(tmp_path / "clk"))
    server = make_server(hf_dir)
    fake = FakeClock()
    server.snapshots.clock = fake
    start = server.state_dict()
    weights = {g: shifted(start, 0.01 * g) for g in range(4)}
    for g, t in [(0, 0.0), (1, 12.0), (2, 25.0), (3, 41.0)]:
        fake.now = 1000.0 + t
        server.update_weights(weights[g], global_steps=g)
    run = clock.read_run(tmp_path / "clk")
    assert run["syncs"] == [(0, 0.0), (1, 12.0), (2, 25.0), (3, 41.0)]
    assert {m: p["step"] for m, p in run["policies"].items()} == {10.0: 0, 20.0: 1, 30.0: 2, 40.0: 2}
    for m, p in run["policies"].items():
        saved = torch.load(p["file"])
        assert all(torch.equal(saved[k], weights[p["step"]][k]) for k in weights[0]), m
    assert run["latest"]["step"] == 3
    assert all(torch.equal(torch.load(run["latest"]["file"])[k], weights[3][k]) for k in weights[0])
    # the server's generate time is logged with every sync (the model's share of timing_s/gen)
    assert all("generate_s" in r for r in run["sync_rows"])


def test_run_that_ends_before_a_mark_uses_its_last_policy(tmp_path):
    from cppo_megatron.integrations.verl.diagnostics import clock

    cfg = clock.write_settings(tmp_path / "clk", 30, [10, 20, 30])
    snaps = clock.Snapshots(cfg, clock=(fake := FakeClock()))
    w = {g: {"w": torch.full((2,), float(g))} for g in range(3)}
    loaded = {"state": w[0]}
    for g, t in [(0, 0.0), (1, 8.0), (2, 19.0)]:  # the trainer stopped after step 2 (at 19 s)
        fake.now = 1000.0 + t
        snaps.before_update(lambda: loaded["state"], g)
        loaded["state"] = w[g]
        snaps.after_update(lambda: loaded["state"], g)
    run = clock.read_run(tmp_path / "clk")
    assert {m: p["step"] for m, p in run["policies"].items()} == {10.0: 1, 20.0: 2, 30.0: 2}
    assert run["policies"][30.0]["file"].name == "latest.pt"
    assert torch.equal(torch.load(run["policies"][10.0]["file"])["w"], w[1]["w"])


def test_read_run_refuses_a_run_without_the_policy_for_a_mark(tmp_path):
    from cppo_megatron.integrations.verl.diagnostics import clock

    cfg = clock.write_settings(tmp_path / "clk", 30, [10, 30])
    snaps = clock.Snapshots(cfg, clock=(fake := FakeClock()))
    snaps.after_update(lambda: {"w": torch.zeros(1)}, 0)
    fake.now += 12.0
    snaps.before_update(lambda: {"w": torch.zeros(1)}, 1)
    snaps.after_update(lambda: {"w": torch.ones(1)}, 1)
    (tmp_path / "clk" / "latest.json").unlink()  # as if the run died before its last sync was kept
    with pytest.raises(RuntimeError, match="no policy for mark 30"):
        clock.read_run(tmp_path / "clk")


@pytest.mark.parametrize("elapsed,last,budget,want", [
    (10.0, None, 30.0, False), (30.0, None, 30.0, True),   # first step: only a spent budget stops
    (27.0, 4.0, 30.0, False),                              # 3 s left > half a 4 s step: it may finish in time
    (28.5, 4.0, 30.0, True),                               # 1.5 s left < half a step: this step is the last
    (31.0, 4.0, 30.0, True),
])
def test_stop_rule(elapsed, last, budget, want):
    from cppo_megatron.integrations.verl.diagnostics.clock import stop_now

    assert stop_now(elapsed, last, budget) is want


def test_legacy_trainer_stops_at_the_budget(tmp_path, monkeypatch):
    """The wrapped ``_get_gen_batch``: steps start at 0, 4, 8, ... s; budget 10 s: the step
    starting at 8 s (2 s left < half of 4 s) becomes veRL's last; a validation call at the
    same global step (``_validate`` calls it too) is not a step start."""
    from cppo_megatron.integrations.verl.diagnostics import clock

    clock.write_settings(tmp_path / "clk", 10, [5, 10])
    monkeypatch.setenv(clock.ENV, str(tmp_path / "clk"))
    now = {"t": 500.0}
    monkeypatch.setattr(clock.time, "time", lambda: now["t"])
    wrapped = clock._legacy_gen_batch(lambda self, batch: ("gen", batch))
    trainer = SimpleNamespace(global_steps=0, total_training_steps=1_000_000)
    assert wrapped(trainer, "val") == ("gen", "val")  # validation before training (step 0): ignored
    for step, t in [(1, 500.0), (2, 504.0)]:
        trainer.global_steps, now["t"] = step, t
        wrapped(trainer, "b")
        assert trainer.total_training_steps == 1_000_000
    now["t"] = 505.0
    wrapped(trainer, "val")  # a validation at step 2, later: same global step, not a step start
    assert trainer.total_training_steps == 1_000_000
    trainer.global_steps, now["t"] = 3, 508.0
    wrapped(trainer, "b")
    assert trainer.total_training_steps == 3
    rec = json.loads((tmp_path / "clk" / "trainer.jsonl").read_text())
    assert rec == {"last_step": 3, "elapsed": 8.0, "previous_step_s": 4.0, "budget_s": 10.0}


def test_v1_trainer_stops_at_the_budget_through_its_own_loop_condition(tmp_path, monkeypatch):
    """V1's wrapped ``on_step_begin``: steps start at 0, 4, 8 s; budget 10 s: the step starting at
    8 s becomes the last (``total_training_steps`` = 3), so V1's ``while global_steps <=
    total_training_steps`` ends the loop after it; steps before leave the limit alone."""
    from cppo_megatron.integrations.verl.diagnostics import clock

    clock.write_settings(tmp_path / "clk", 10, [5, 10])
    monkeypatch.setenv(clock.ENV, str(tmp_path / "clk"))
    now = {"t": 100.0}
    monkeypatch.setattr(clock.time, "time", lambda: now["t"])
    calls = []
    wrapped = clock._v1_step_begin(lambda self: calls.append(self.global_steps))
    trainer = SimpleNamespace(global_steps=1, total_training_steps=1_000_000)
    for step, t, limit in [(1, 100.0, 1_000_000), (2, 104.0, 1_000_000), (3, 108.0, 3)]:
        trainer.global_steps, now["t"] = step, t
        wrapped(trainer)
        assert trainer.total_training_steps == limit, step
    assert calls == [1, 2, 3]  # veRL's own on_step_begin still runs
    rec = json.loads((tmp_path / "clk" / "trainer.jsonl").read_text())
    assert rec == {"last_step": 3, "elapsed": 8.0, "previous_step_s": 4.0, "budget_s": 10.0}


def test_install_wraps_both_loops_step_starts(tmp_path, monkeypatch):
    from verl.trainer.ppo import ray_trainer
    from verl.trainer.ppo.v1 import trainer_base

    from cppo_megatron.integrations import wrap
    from cppo_megatron.integrations.verl.diagnostics import clock

    clock.write_settings(tmp_path / "clk", 10, [10])
    monkeypatch.setenv(clock.ENV, str(tmp_path / "clk"))
    try:
        assert clock.install() is True
        assert wrap.is_wrapped(trainer_base.PPOTrainer.__dict__["on_step_begin"], clock.WRAP_TAG)
        assert wrap.is_wrapped(ray_trainer.RayPPOTrainer.__dict__["_get_gen_batch"], clock.WRAP_TAG)
    finally:
        wrap.unwrap(trainer_base.PPOTrainer, "on_step_begin", tag=clock.WRAP_TAG)
        wrap.unwrap(ray_trainer.RayPPOTrainer, "_get_gen_batch", tag=clock.WRAP_TAG)


def test_clock_installs_only_when_asked(monkeypatch):
    from cppo_megatron.integrations.verl.diagnostics import clock

    monkeypatch.delenv(clock.ENV, raising=False)
    assert clock.install() is False
    assert clock.settings() is None


def test_real_clock_source_is_wall_time(tmp_path):
    from cppo_megatron.integrations.verl.diagnostics import clock

    snaps = clock.Snapshots(clock.write_settings(tmp_path / "c", 5, [5]))
    snaps.after_update(lambda: {"w": torch.zeros(1)}, 0)
    time.sleep(0.05)
    assert 0.04 < snaps.elapsed() < 5
