"""The unmodified veRL 0.9.1 loop on CPU with the plugin: complete training steps (rollout
through our `hf` replica, reward from our scorer, pruning, old-policy pass, advantages,
update, weight sync), checked against the core through the audit records.

Each run is a real `cppo-megatron verl` process (Ray, TaskRunner, one FSDP2 worker on gloo,
the rollout server actor): ~1.5-2 min on 2 cores. The start model is the main job's
architecture, random-init and exported as an HF directory (no warm-up: the checks are about
which rows reach which pass, not about learning).
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections import defaultdict

import numpy as np
import pytest
import torch

from .conftest import ROOT

pytestmark = pytest.mark.verl

G, PROMPTS, P = 8, 4, 0.75  # 4 prompts x G=8; CPPO keeps 2 of 8 and allocates 16 prompts
STEPS = 2
EPS = 1e-6  # veRL's GRPO epsilon, the core's default
# a checkpoint every step, and the same command resumes from the newest: veRL's own settings
CHECKPOINTS = ("trainer.save_freq=1", "trainer.resume_mode=auto")


def export_tiny_model(out):
    """A random-init export (seed 0) of the main job's model to ``out``: the CI runs' start model."""
    from cppo_megatron.tasks import build_task
    from cppo_megatron.trainer.config import load_recipe
    from cppo_megatron.trainer.export import export_hf
    from cppo_megatron.trainer.models import build_model

    r = load_recipe(ROOT / "recipes" / "tiny_cpu.yaml")
    model, tok = build_model(r.model, build_task(r.task).alphabet, seed=0)
    export_hf(model, tok, out)
    return out


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return export_tiny_model(tmp_path_factory.mktemp("model"))


def verl_command(recipe: str, tmp, model_dir, *overrides: str) -> list[str]:
    """The `cppo-megatron verl` command of a CI run: the recipe at test size, run dir ``tmp/run``."""
    run_dir = tmp / "run"
    return [
        sys.executable, "-m", "cppo_megatron.integrations.verl.main", str(ROOT / "recipes" / "verl" / recipe),
        f"cppo_cpu.model_dir={model_dir}", f"cppo_cpu.data_dir={tmp / 'data'}", f"cppo_cpu.run_dir={run_dir}",
        "cppo_cpu.eval_problems=16",
        f"trainer.total_training_steps={STEPS}", "trainer.val_before_train=false", "trainer.test_freq=-1",
        f"actor_rollout_ref.rollout.n={G}", f"data.train_batch_size={PROMPTS}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={PROMPTS}", f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={G}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={G}",
        "actor_rollout_ref.actor.optim.lr_warmup_steps=0",  # veRL's warm-up starts at lr 0: step 1 would not move
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={G}",
        *overrides,
    ]


def run_verl(recipe: str, tmp, model_dir, *overrides: str, attempt: str = "", when=None,
             expect_ok: bool = True) -> dict:
    """One run; ``attempt`` names its audit folder (``audit{attempt}``) so that the runs of one
    resume chain, which share ``tmp/run``, keep apart records; ``when``: see interrupt.run."""
    from cppo_megatron.integrations.verl import audit

    from .. import interrupt

    audit_dir, run_dir = tmp / f"audit{attempt}", tmp / "run"
    env = {**os.environ, "CPPO_VERL_AUDIT": str(audit_dir), "PYTHONHASHSEED": "0"}
    out = interrupt.run(verl_command(recipe, tmp, model_dir, *overrides), env=env, cwd=tmp,
                        log_path=tmp / f"log{attempt}.txt", when=when(audit_dir, run_dir) if when else None)
    if expect_ok:
        assert out.returncode == 0, out.log[-6000:]
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    metrics = [json.loads(line) for line in lines if line.strip()]
    # the metrics file is shared by a chain's runs: a step logged twice keeps its last value
    return {"metrics": {m["step"]: m["data"] for m in metrics}, "audit": audit.read(audit_dir) if audit_dir.is_dir()
            else [], "log": out.log, "run": out, "run_dir": run_dir}


def by_step(records, kind):
    out = defaultdict(list)
    for r in records:
        if r["kind"] == kind:
            out[r["step"]].append(r)
    return out


def full_group_advantages(uids, rewards):
    """Independent of the core: (r - mean) / (std + eps) over each whole group, unbiased std."""
    rewards = np.asarray(rewards, dtype=np.float64)
    adv = np.zeros_like(rewards)
    groups = defaultdict(list)
    for i, u in enumerate(uids):
        groups[u].append(i)
    for idx in groups.values():
        r = rewards[idx]
        std = r.std(ddof=1) if len(idx) > 1 else 1.0
        mean = r.mean() if len(idx) > 1 else 0.0
        adv[idx] = (r - mean) / (std + EPS)
    return adv


def core_survivors(uids, rewards, step, pruning_rate):
    from cppo_megatron import CPPOConfig
    from cppo_megatron.core import prune

    first = {}
    gids = torch.tensor([first.setdefault(u, len(first)) for u in uids], dtype=torch.int64)
    res = prune(torch.tensor(rewards, dtype=torch.float32), gids, CPPOConfig(pruning_rate=pruning_rate, seed=0),
                step=step)
    return res.selection.kept.tolist()


def check_run(run, *, pruning_rate, loop, syncs=None):
    """The audit checks of a run; ``syncs`` checks its weight syncs (default: the ``hf`` adapter's)."""
    records = run["audit"]
    prunes, olds, updates = by_step(records, "prune"), by_step(records, "old_log_prob"), by_step(records, "update")
    assert sorted(updates) == list(range(1, STEPS + 1)), sorted(updates)
    keep = int(G * (1 - pruning_rate))
    prompts = int(PROMPTS * G / keep)  # allocation
    for step in range(1, STEPS + 1):
        (pr,), (old,), (up,) = prunes[step], olds[step], updates[step]
        assert pr["loop"] == old["loop"] == up["loop"] == loop
        assert len(pr["rows"]) == prompts * G and len(set(pr["uids"])) == prompts
        # the core's survivors, recomputed here from the recorded rewards, are the rows that enter
        # the old-policy pass and the update: each exactly once, nothing else but loss-free padding
        kept = core_survivors(pr["uids"], pr["rewards"], step, pruning_rate)
        assert kept == pr["kept"]
        want = sorted(pr["rows"][i] for i in kept)
        entered = [r for r, pad in zip(old["rows"], old["padding"]) if not pad]
        assert sorted(entered) == want
        assert sorted(up["rows"]) == want
        assert len(want) == PROMPTS * G  # allocation: the kept rows fill GRPO's batch
        # each trained row carries its FULL-group advantage (not one recomputed on survivors)
        full = full_group_advantages(pr["uids"], pr["rewards"])
        row_adv = dict(zip(pr["rows"], full))
        row_reward = dict(zip(pr["rows"], pr["rewards"]))
        for row, adv, reward in zip(up["rows"], up["advantages"], up["rewards"]):
            assert reward == pytest.approx(row_reward[row], abs=1e-6)
            assert adv == pytest.approx(row_adv[row], abs=1e-4), (step, row)
        m = run["metrics"][step]
        assert m["cppo/num_completions"] == prompts * G and m["cppo/num_kept"] == len(want)
        assert m["cppo/num_pruned"] == prompts * G - len(want)
        assert math.isfinite(m["actor/pg_loss"]) and m["actor/grad_norm"] > 0
        assert m["timing_s/gen"] > 0 and m["timing_s/update_actor"] > 0 and m["timing_s/old_log_prob"] > 0
    (syncs or check_syncs)(records)


def check_syncs(records):
    syncs = [r for r in records if r["kind"] == "sync"]
    # one sync at start (on_init_end) and one after each step's update (on_step_end); the
    # server then holds exactly the actor's tensors
    assert len(syncs) == STEPS + 1, syncs
    assert [s["global_steps"] for s in syncs][1:] == list(range(1, STEPS + 1)), syncs
    for s in syncs:
        assert s["missing"] == [] and s["max_abs_diff"] == 0.0, s
    prints = [s["fingerprint"] for s in syncs]
    assert all(a != b for a, b in zip(prints[-STEPS - 1:], prints[-STEPS:])), prints  # each update moved the weights


V1_CPPO = ("tiny_cpu_cppo.yaml", f"cppo.pruning_rate={P}", "trainer.use_v1=true", *CHECKPOINTS)


@pytest.fixture(scope="module")
def v1_cppo(tiny_model, tmp_path_factory):
    recipe, *overrides = V1_CPPO
    return run_verl(recipe, tmp_path_factory.mktemp("v1_cppo"), tiny_model, *overrides)


def test_v1_cppo_trains_the_core_survivors_with_full_group_advantages(v1_cppo):
    check_run(v1_cppo, pruning_rate=P, loop="v1")


@pytest.fixture(scope="module")
def v1_resumed(tiny_model, tmp_path_factory):
    """The run of ``v1_cppo`` three times in one run dir: its worker (rank 0, this recipe's one
    FSDP rank) SIGKILLed during step 2, after step 1's checkpoint; the same command, its driver
    SIGKILLed during step 2 again; the same command, to the end."""
    from . import resume

    recipe, *overrides = V1_CPPO
    tmp = tmp_path_factory.mktemp("v1_resume")
    dead = run_verl(recipe, tmp, tiny_model, *overrides, attempt="1", when=resume.strike_during(2, "worker", rank=0),
                    expect_ok=False)
    killed = run_verl(recipe, tmp, tiny_model, *overrides, attempt="2", when=resume.strike_during(2),
                      expect_ok=False)
    assert killed["run"].struck == "driver" and killed["run"].returncode == -9, killed["log"][-3000:]
    return [dead, killed, run_verl(recipe, tmp, tiny_model, *overrides, attempt="3")]


def test_v1_a_dead_worker_rank_ends_the_run_with_a_message_naming_it(v1_resumed):
    from . import resume

    resume.check_dead_worker(v1_resumed[0], rank=0, resume_from=1)


def test_v1_resume_after_a_dead_worker_and_a_sigkill_of_the_driver_continues_the_run(v1_cppo, v1_resumed):
    from . import resume

    resume.check_chain(v1_cppo, v1_resumed, kills=[1, 1], steps=STEPS, pruning_rate=P, prompts_per_step=PROMPTS)
    resumed = v1_resumed[-1]
    # veRL logged the resumed run's step as step 2, and continued its LR schedule
    assert resumed["metrics"][2]["training/global_step"] == 2
    assert resumed["metrics"][2]["actor/lr"] == v1_cppo["metrics"][2]["actor/lr"]


@pytest.mark.skipif(os.environ.get("E2E_TESTS", "") != "all",
                    reason="the V1 GRPO (P = 0) run runs with E2E_TESTS=all (CI time; CI runs CPPO on V1 and legacy)")
def test_v1_grpo_through_the_same_path_keeps_every_row(tiny_model, tmp_path_factory):
    run = run_verl("tiny_cpu_cppo.yaml", tmp_path_factory.mktemp("v1_p0"), tiny_model, "cppo.pruning_rate=0.0",
                   "trainer.use_v1=true")
    check_run(run, pruning_rate=0.0, loop="v1")


def test_legacy_loop_cppo(tiny_model, tmp_path_factory):
    run = run_verl("tiny_cpu_cppo.yaml", tmp_path_factory.mktemp("legacy"), tiny_model, f"cppo.pruning_rate={P}")
    check_run(run, pruning_rate=P, loop="legacy")
