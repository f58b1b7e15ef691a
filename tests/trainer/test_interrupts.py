"""`cppo-megatron train` (backend hf) as a user runs it: SIGTERM during an update exits 130
with a checkpoint; a truncated latest checkpoint is named on --resume and the one before
is used; the resumed run repeats the uninterrupted run's per-step metrics."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from cppo_megatron.trainer import Trainer
from cppo_megatron.trainer.config import load_recipe
from cppo_megatron.trainer.logger import read_metrics
from tests.recipes import MICRO, REPO, recipe_path

RUN = [o for o in MICRO if not o.startswith(("train.capacity", "train.steps"))] + ["train.capacity=7", "train.steps=3"]
KEYS = ("reward/mean", "alloc/prompts_drawn", "alloc/total_prompts_drawn", "cppo/num_kept", "train/loss",
        "train/grad_norm", "data/epoch")


def _steps(out):
    return [r for r in read_metrics(out / "metrics.jsonl") if r.get("kind") == "step"]


def _cli(out, *extra, fault=None):
    env = {k: v for k, v in os.environ.items() if k != "CPPO_MEGATRON_FAULT"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    if fault:
        env["CPPO_MEGATRON_FAULT"] = fault
    cmd = [sys.executable, "-m", "cppo_megatron.cli", "train", recipe_path("tiny_cpu"), *RUN,
           "log.checkpoint_every=1", f"out_dir={out}", *extra]
    return subprocess.run(cmd, cwd=out.parent, env=env, capture_output=True, text=True, timeout=300)


def test_sigterm_mid_update_exits_130_and_resume_skips_a_truncated_checkpoint(tmp_path):
    full = tmp_path / "full"
    Trainer(load_recipe(recipe_path("tiny_cpu"), RUN + [f"out_dir={full}"])).run()
    part = tmp_path / "part"
    first = _cli(part, fault="update:2:0:sigterm")
    assert first.returncode == 130, first.stderr[-2000:]
    assert "finishing the current step" in first.stderr
    ckpts = sorted(p.name for p in (part / "checkpoints").iterdir())
    assert ckpts == ["step_000001", "step_000002"]  # step 2 finished before stopping
    assert (part / "interrupted.json").exists() and (part / "report.md").exists()
    latest = part / "checkpoints" / "step_000002" / "policy_rank00000.pt"
    latest.write_bytes(latest.read_bytes()[: latest.stat().st_size // 2])  # a crash mid-copy
    second = _cli(part, "--resume")
    assert second.returncode == 0, second.stderr[-2000:]
    assert "checkpoint step_000002 is truncated or corrupt" in second.stderr
    assert "falling back to step_000001" in second.stderr
    a, b = _steps(full), _steps(part)
    assert [s["step"] for s in b] == [1, 2, 3]
    for ra, rb in zip(a, b):
        for key in KEYS:
            assert ra[key] == pytest.approx(rb[key], rel=1e-5, abs=1e-6), (ra["step"], key)


def test_resume_without_a_checkpoint_is_one_line_exit_2(tmp_path):
    proc = _cli(tmp_path / "empty", "--resume")
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("cppo-megatron train: --resume: no checkpoint under")
    assert "Traceback" not in proc.stderr


def _in_process(out, *extra):
    return Trainer(load_recipe(recipe_path("tiny_cpu"), RUN + [f"out_dir={out}", *extra]))


@pytest.mark.parametrize("where", ["rollout", "update"])
def test_abandoned_step_is_repeated_on_resume(tmp_path, where):
    """A forced stop inside step 2 (a second Ctrl-C): during the rollout the step's drawn
    prompts go back (the checkpoint says step 1, as if step 2 never drew); during the update
    the weights have moved, so no checkpoint is written and the last one (step 1) stays.
    Either way the resumed run repeats the uninterrupted one."""
    full = tmp_path / "full"
    _in_process(full).run()
    part = tmp_path / "part"
    t = _in_process(part, "log.checkpoint_every=1")
    target = t.engine if where == "rollout" else t.policy.hf
    name = "generate" if where == "rollout" else "update"
    real = getattr(target, name)

    def forced(*a, **kw):
        if t.step == 1:
            if where == "update":
                real(*a, **kw)  # the optimizer moved the weights, then the interrupt
            raise KeyboardInterrupt
        return real(*a, **kw)

    setattr(target, name, forced)
    res = t.run()
    assert res["interrupted"] and res["step"] == 1
    assert (res["checkpoint"] is None) == (where == "update")
    assert sorted(p.name for p in (part / "checkpoints").iterdir()) == ["step_000001"]
    Trainer(load_recipe(recipe_path("tiny_cpu"), RUN + [f"out_dir={part}", "log.checkpoint_every=1"]),
            resume=True).run()
    a, b = _steps(full), _steps(part)
    assert [s["step"] for s in b] == [1, 2, 3]
    for ra, rb in zip(a, b):
        for key in KEYS:
            assert ra[key] == pytest.approx(rb[key], rel=1e-5, abs=1e-6), (ra["step"], key)
