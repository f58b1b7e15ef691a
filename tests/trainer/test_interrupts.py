"""`cppo-megatron train` (backend hf) as a user runs it: SIGTERM during an update exits 130
with a checkpoint; a truncated latest checkpoint is named on --resume and the one before
is used; the resumed run repeats the uninterrupted run's per-step metrics. Ctrl-C outside
the RL loop (the warm-up, a bench command) exits 130 too."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

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


def test_resume_without_a_checkpoint_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    """In-process with the launch stubbed (tests/launch_guard.py): a check that let the resume through
    fails the test instead of starting a fresh run."""
    from cppo_megatron import cli

    from ..launch_guard import forbid

    forbid(monkeypatch, "train")
    out = tmp_path / "empty"
    code = cli.main(["train", recipe_path("tiny_cpu"), *RUN, "log.checkpoint_every=1", f"out_dir={out}", "--resume"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.splitlines() == [f"cppo-megatron train: error: --resume: no checkpoint under {out / 'checkpoints'}; check "
                                "out_dir, or drop --resume to start a new run (--debug shows the traceback)"]
    assert not out.exists()


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


def _interrupt_when_started(cmd: list, started, cwd, timeout: float = 240.0) -> tuple[int, str, str, float]:
    """Run ``cmd`` as a user does, send it SIGINT (a Ctrl-C) once ``started(stdout_so_far)`` is
    true, and return (exit status, stdout, stderr, seconds from the signal to the exit)."""
    env = {k: v for k, v in os.environ.items() if k != "CPPO_MEGATRON_FAULT"}
    env.update(PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1",
               OMP_NUM_THREADS="1")
    out_path, err_path = cwd / "stdout.txt", cwd / "stderr.txt"
    with out_path.open("w") as out, err_path.open("w") as err:
        # as from a terminal: SIGINT at its default, even when this test runs in a background job
        # (a non-interactive shell starts those with SIGINT ignored, and children inherit that)
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=err,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            deadline = time.monotonic() + timeout
            while not started(out_path.read_text()):
                assert proc.poll() is None, f"exited {proc.returncode} before it started: {err_path.read_text()[-2000:]}"
                assert time.monotonic() < deadline, f"did not start within {timeout:.0f} s"
                time.sleep(0.2)
            assert proc.poll() is None, "finished before the signal: make the command longer"
            sent = time.monotonic()
            proc.send_signal(signal.SIGINT)
            code = proc.wait(timeout=120)
            waited = time.monotonic() - sent
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return code, out_path.read_text(), err_path.read_text(), waited


def _warmup_logged(out):
    def started(_stdout: str) -> bool:
        metrics = out / "metrics.jsonl"
        return metrics.exists() and any(json.loads(line).get("kind") == "warmup"
                                        for line in metrics.read_text().splitlines() if line.strip())
    return started


@pytest.mark.parametrize("where", ["warm-up", "bench"])
def test_ctrl_c_outside_the_rl_loop_exits_130(tmp_path, where):
    """SIGINT to a real `cppo-megatron` process during the supervised warm-up (before any RL
    step, so the loop's own stop handling is not installed yet) and during `bench balance`:
    the CLI says `interrupted` and exits 130, not 0, and the run does not go on."""
    if where == "warm-up":
        out = tmp_path / "run"
        cmd = [sys.executable, "-m", "cppo_megatron.cli", "train", recipe_path("tiny_cpu"), *MICRO,
               f"out_dir={out}", "warmup.enabled=true", "warmup.max_steps=100000", "warmup.eval_every=100000",
               "warmup.target_accuracy=1.0", "warmup.eval_problems=5"]
        started = _warmup_logged(out)
    else:
        out = tmp_path / "bench"
        cmd = [sys.executable, "-m", "cppo_megatron.cli", "bench", "balance", "--distributions", "uniform",
               "--ranks", "2,256", "--items-per-rank", "20000", "--equal-size", "off", "--repeats", "50", "--no-verl",
               "--no-plot", "--out", str(out)]

        def started(stdout: str) -> bool:
            return "balance: uniform   k=2 " in stdout  # the first row is done; k=256 takes minutes

    code, stdout, stderr, waited = _interrupt_when_started(cmd, started, tmp_path)
    assert (code, stderr.strip().splitlines()[-1]) == (130, "interrupted"), stderr[-2000:]
    assert "Traceback" not in stderr and "done:" not in stdout
    assert waited < 60  # it stopped at the signal, not at the end of the work
    if where == "warm-up":
        steps = [r for r in read_metrics(out / "metrics.jsonl") if r.get("kind") == "step"]
        assert steps == [] and not (out / "warmup.pt").exists() and not (out / "final.pt").exists()
    else:
        assert not (out / "balance.json").exists()  # the report of an unfinished benchmark is not written
