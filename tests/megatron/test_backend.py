"""backend=megatron end to end: `cppo-megatron train ... --nproc 4` (torchrun, 4 gloo
processes, TP 2 x DP 2) on a micro recipe, then the metrics it logged."""

from __future__ import annotations

import argparse
import math

import pytest

pytest.importorskip("megatron.core")

from cppo_megatron.trainer.launch import launch  # noqa: E402
from cppo_megatron.trainer.config import load_recipe  # noqa: E402

from tests.launch_guard import forbid  # noqa: E402
from tests.recipes import MICRO as COMMON  # noqa: E402

from ._common import REPO, train_nproc  # noqa: E402

RECIPE = str(REPO / "recipes" / "tiny_cpu_megatron.yaml")
# the shared micro recipe on TP 2 x DP 2, with
MICRO = [o for o in COMMON if not o.startswith(("train.capacity", "model.max_position", "log.checkpoint_every"))] + [
    # 1.5 prompts per step: step 1 draws one prompt, so DP rank 0 generates nothing and
    # trains only what the exchange sends it; step 2 draws two
    "train.capacity=3",
    # batch scope: survivors per rank differ, so the exchange has rows to move
    "cppo.scope=batch",
]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """3 steps: SIGINT on rank 0 while it generates step 2 stops the job after that step
    (exit 130, checkpoint), then `--resume` runs step 3 and finishes."""
    out = tmp_path_factory.mktemp("mbackend") / "run"
    stopped, _ = train_nproc(RECIPE, MICRO + ["train.steps=3"], out, timeout=240, fault="rollout:2:0:sigint",
                             expect=130)
    proc, records = train_nproc(RECIPE, MICRO + ["train.steps=3"], out, "--resume", timeout=240)
    return out, records, proc, stopped


def test_run_completes_with_evals_and_report(run):
    out, records, proc, stopped = run
    assert (out / "checkpoints" / "step_000002" / "policy_rank00003.pt").exists()  # one shard file per rank
    assert "finishing the current step" in stopped.stderr
    steps = [r for r in records if r["kind"] == "step"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert [r["step"] for r in evals] == [0, 3]  # before RL and at the end (rank 0 only)
    report = (out / "report.md").read_text()
    assert "tp=2 pp=1 dp=2" in report and "Rank balance" in report
    assert (out / "final.pt").exists()
    assert "done: accuracy" in proc.stdout


def test_balance_and_wait_metrics(run):
    _, records, _, _ = run
    for r in (x for x in records if x["kind"] == "step"):
        for key in ("cppo/exchange_imbalance", "cppo/exchange_imbalance_without", "cppo/exchange_max_load",
                    "cppo/exchange_max_load_without", "cppo/exchange_mean_load", "cppo/rank_wait_mean",
                    "cppo/rank_wait_max", "cppo/rank_time_imbalance"):
            assert math.isfinite(r[key]), key
        # redistribution never makes the largest rank heavier than keeping survivors in place
        assert r["cppo/exchange_max_load"] <= r["cppo/exchange_max_load_without"] + 1e-9
        assert r["cppo/exchange_imbalance"] >= 1.0
        waits, passes = r["rank/wait_seconds"], r["rank/pass_seconds"]
        assert len(waits) == len(passes) == 4
        assert min(waits) == 0.0 and all(w >= 0 for w in waits)
        for w, p in zip(waits, passes):
            assert w == pytest.approx(max(passes) - p)
        for phase in ("reward", "cppo", "old_logprob", "update", "sync"):
            assert r[f"time/{phase}"] > 0, phase
        # rank 0 (which logs) generates only when its DP slice has prompts
        assert (r["time/rollout"] > 0) == (r["rank/owned"][0] > 0)


def test_pruned_rows_never_enter_the_forward_passes(run):
    _, records, _, _ = run
    for r in (x for x in records if x["kind"] == "step"):
        kept, total = r["cppo/num_kept"], r["cppo/num_completions"]
        assert 0 < kept < total  # pruning happened
        assert r["alloc/completions_generated"] == total and r["alloc/completions_trained"] == kept
        dp_rank, received, owned = r["rank/dp_rank"], r["rank/received"], r["rank/owned"]
        forwarded = r["rank/forwarded_sequences"]
        assert dp_rank == [0, 0, 1, 1]  # TP peers hold the same rows
        assert received[0] == received[1] and received[2] == received[3]
        assert owned[0] == owned[1] and owned[2] == owned[3]
        assert owned[0] + owned[2] == total  # every completion generated once per DP rank
        assert received[0] + received[2] == kept  # the survivors, each on exactly one DP rank
        # old log-prob pass + one update (mu = 1, no reference): exactly the received rows each
        for f, n in zip(forwarded, received):
            assert f == 2 * n
    first = next(x for x in records if x["kind"] == "step")
    assert first["rank/owned"][0] == 0 and first["rank/received"][0] > 0  # a rank without rollouts still trains


def _args(*overrides, nproc=4, recipe=RECIPE, resume=False):
    return argparse.Namespace(recipe=recipe, overrides=list(overrides), nproc=nproc, resume=resume)


def test_launch_refuses_bad_layouts(capsys, tmp_path, monkeypatch):
    forbid(monkeypatch, "train")  # a check that lets a layout through fails here, before torchrun starts
    assert launch(_args(nproc=3)) == 2
    assert "not divisible by megatron.tp * megatron.pp" in capsys.readouterr().err
    assert launch(_args("backend=hf")) == 2
    assert "needs backend=megatron" in capsys.readouterr().err
    assert launch(_args(f"out_dir={tmp_path / 'none'}", resume=True)) == 2
    assert "--resume: no checkpoint under" in capsys.readouterr().err
    assert launch(_args("megatron.dp=2")) == 2
    assert "megatron.dp" in capsys.readouterr().err
    import torch

    if not torch.cuda.is_available():  # device is honoured: no silent fallback to the CPU
        assert launch(_args("device=cuda")) == 2
        assert "device=cuda but no CUDA device" in capsys.readouterr().err


def test_launch_without_vllm_says_how_to_install_before_starting_ranks(capsys, monkeypatch):
    forbid(monkeypatch, "train")
    from cppo_megatron.rollout.vllm import vllm_distribution

    if vllm_distribution() is not None:
        pytest.skip("vLLM is installed here; tests/rollout/test_vllm_megatron.py runs it")
    assert launch(_args("rollout.engine=vllm")) == 2
    err = capsys.readouterr().err
    assert "scripts/setup_vllm.sh" in err and "launching" not in err


def test_recipe_validates_vllm_tp():
    with pytest.raises(ValueError, match="rollout.vllm_tp=2 must divide megatron.tp=1"):
        load_recipe(RECIPE, ["rollout.engine=vllm", "megatron.tp=1", "rollout.vllm_tp=2"])
    with pytest.raises(ValueError, match="rollout.vllm_tp=2 needs backend=megatron and rollout.engine=vllm"):
        load_recipe(RECIPE, ["rollout.vllm_tp=2"])
    with pytest.raises(ValueError, match="rollout.vllm_tp must be > 0"):
        load_recipe(RECIPE, ["rollout.vllm_tp=0"])
    assert load_recipe(RECIPE, ["rollout.engine=vllm", "rollout.vllm_tp=2"]).rollout.vllm_tp == 2


def test_recipe_validates_megatron_keys():
    with pytest.raises(ValueError, match="megatron.tp=3 must divide model.num_kv_heads=4"):
        load_recipe(RECIPE, ["megatron.tp=3"])
    with pytest.raises(ValueError, match="megatron.pp=3 must divide model.num_layers=4"):
        load_recipe(RECIPE, ["megatron.pp=3"])
    with pytest.raises(ValueError, match="megatron.tp must be > 0"):
        load_recipe(RECIPE, ["megatron.tp=0"])
    pp2 = load_recipe(str(REPO / "recipes" / "tiny_cpu_megatron_pp2.yaml"))
    assert (pp2.megatron.tp, pp2.megatron.pp, pp2.backend) == (1, 2, "megatron")


def test_a_rank_killed_mid_step_ends_the_job_quickly_naming_it(tmp_path):
    """SIGKILL rank 3 of 4 as it enters the update of step 1: no hang on a collective; the
    job exits non-zero within 60 s of the death (the bound docs/trainer.md states; seconds
    in practice), torchrun names the dead rank and a surviving rank names its phase."""
    import os
    import subprocess
    import sys
    import time

    cmd = [sys.executable, "-m", "cppo_megatron.cli", "train", RECIPE, *MICRO, f"out_dir={tmp_path / 'run'}",
           "--nproc", "4"]
    log = tmp_path / "faults.log"
    env = {**os.environ, "CPPO_MEGATRON_FAULT": "update:1:3:kill", "CPPO_MEGATRON_FAULT_LOG": str(log)}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    ended = time.time()
    err = proc.stderr
    assert proc.returncode not in (0, 130), err[-3000:]
    fired = float(log.read_text().split()[-1])  # when rank 3 was killed
    assert ended - fired < 60, f"the job took {ended - fired:.0f} s to end after rank 3 died"
    assert "rank: 3" in err or "rank 3" in err, err[-3000:]  # torchrun's summary names the dead rank
    assert "phase update" in err, err[-3000:]  # its peers say where they were
    assert "the job failed" in err
