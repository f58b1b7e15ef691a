"""Interrupted veRL runs and the comparisons of a resume chain with a straight run.

A chain is a list of attempts of ONE recipe in ONE run directory (its checkpoints), each but the
last interrupted during step ``k + 1`` after step ``k``'s checkpoint; every later attempt is the
same command again (``trainer.resume_mode=auto``). What is compared is what veRL determines on
CPU; what it cannot (the rollout's random draws) is said in ``check_chain``.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict

import pytest

from .. import interrupt
from .test_cpu_e2e import G, core_survivors, full_group_advantages


def _records(audit_dir) -> list[dict]:
    from cppo_megatron.integrations.verl.diagnostics import audit

    return audit.read(audit_dir) if audit_dir.is_dir() else []


def strike_during(step: int, victim: str = "driver", rank: int = 0):
    """``when`` for ``run_verl``: strike once the checkpoint of ``step - 1`` is complete (veRL's
    tracker file says so) and step ``step`` has reached the pruning hook (its rollout is done,
    its old-policy pass and update are not). ``victim``: "driver" (SIGKILL of the command) or
    "worker" (SIGKILL of the Ray actor process of worker ``rank``, found by the pid it recorded)."""

    def when(audit_dir, run_dir):
        tracker = run_dir / "checkpoints" / "latest_checkpointed_iteration.txt"

        def check():
            if not (tracker.is_file() and tracker.read_text().strip() == str(step - 1)):
                return None
            recs = _records(audit_dir)
            if not any(r["kind"] == "prune" and r["step"] == step for r in recs):
                return None
            if victim == "driver":
                return interrupt.kill_driver
            (worker,) = [r for r in recs if r["kind"] == "worker" and r["rank"] == rank]
            return interrupt.kill_pid(worker["pid"], worker["actor_name"])

        return check

    return when


def by_step(records, kind):
    out = defaultdict(list)
    for r in records:
        if r["kind"] == kind:
            out[r.get("step", r.get("global_steps"))].append(r)
    return out


def prompts_of(prune_record) -> Counter:
    """Dataset rows drawn at a step, each with its number of completions."""
    prompts = prune_record["prompts"]
    assert all(isinstance(p, int) for p in prompts), prompts[:3]  # veRL's `index`, not an error note
    return Counter(prompts)


def check_chain(straight: dict, attempts: list[dict], kills: list[int], steps: int, *, pruning_rate: float,
                prompts_per_step: int):
    """``attempts[i]`` was struck during step ``kills[i] + 1`` (after the checkpoint of step
    ``kills[i]``); the last attempt ran to the end. Checks, step by step, what veRL determines:

    - no attempt repeats a step its predecessor checkpointed, and each resumes at the step after
      the newest checkpoint (the global step, and with it CPPO's seed ``(cppo.seed, step)``);
    - prompts: each step draws the straight run's dataset rows, G completions each, the
      allocated count (b x G / k prompts); the step an attempt was struck in is drawn again,
      identically, by the next (the dataloader state of the checkpoint, not of the kill);
    - survivors: the core's choice for that step's seed on the attempt's own rewards enters the
      old-policy pass and the update, each with its full-group advantage;
    - weights: the first weights the resumed run sends the rollout are bit-identical (per-tensor
      sha1) to the ones the interrupted attempt sent after the checkpointed step;
    - optimizer: every rank's optimizer after loading equals what it held when it saved (sum of
      |moments|, Adam step, learning rates);
    - the checkpoints on disk: one per step, the tracker at the last.

    Not compared with the straight run: the completions, so their rewards, which rows survive and
    the weights after a step trained on them. veRL's rollout samples from a generator seeded once
    per server (``hf``: rollout.seed + replica, cpu/rollout.py; vLLM: its engine seed) whose state
    no checkpoint holds, in whatever batches the requests arrive in, and V1 orders a step's rows by
    sets of uuid4 uids (trainer_base.py:1476, replay_buffer.py:341): two straight runs from the
    same seed already differ from step 1 on.
    """
    keep = int(round(G * (1 - pruning_rate)))
    drawn = prompts_per_step * G // keep
    straight_prunes = by_step(straight["audit"], "prune")
    seen_rows: set[int] = set()
    writer: dict[int, dict] = {}  # step -> the attempt that trained and checkpointed it
    first_step = 1
    for i, att in enumerate(attempts):
        prunes, updates = by_step(att["audit"], "prune"), by_step(att["audit"], "update")
        last = kills[i] + 1 if i < len(kills) else steps
        assert sorted(prunes) == list(range(first_step, last + 1)), (i, sorted(prunes))
        trained = list(range(first_step, kills[i] + 1 if i < len(kills) else steps + 1))
        struck = [last] if i < len(kills) else []
        # a SIGKILL lands anywhere in the struck step: the driver may already have called that
        # step's update (its record is written at the call) but not checkpointed it (the next
        # attempt's first step, checked below, says so), so only the resumed run's update counts
        assert sorted(updates) in (trained, trained + struck), (i, sorted(updates))
        for step in range(first_step, last + 1):
            (pr,) = prunes[step]
            assert pr["step"] == step
            got, want = prompts_of(pr), prompts_of(straight_prunes[step][0])
            assert got == want, (i, step)
            assert len(got) == drawn and set(got.values()) == {G}
            if step in updates:
                if step in trained:  # no prompt trained twice across the restart
                    assert not seen_rows & set(got), (i, step)
                    seen_rows |= set(got)
                (up,) = updates[step]
                kept = core_survivors(pr["uids"], pr["rewards"], step, pruning_rate)
                assert kept == pr["kept"] and sorted(up["rows"]) == sorted(pr["rows"][j] for j in kept)
                full = dict(zip(pr["rows"], full_group_advantages(pr["uids"], pr["rewards"])))
                for row, adv in zip(up["rows"], up["advantages"]):
                    assert adv == pytest.approx(full[row], abs=1e-4), (i, step, row)
        for step in trained:
            writer[step] = att
        if i > 0:
            check_restart(writer[kills[i - 1]], att, kills[i - 1])
        first_step = kills[i] + 1 if i < len(kills) else None
    # every step of the straight run was trained exactly once over the chain, no more
    assert seen_rows == {p for s in range(1, steps + 1) for p in prompts_of(straight_prunes[s][0])}
    run_dir = attempts[-1]["run_dir"] / "checkpoints"
    assert sorted(p.name for p in run_dir.glob("global_step_*")) == [f"global_step_{s}" for s in range(1, steps + 1)]
    assert (run_dir / "latest_checkpointed_iteration.txt").read_text().strip() == str(steps)


def check_restart(before: dict, after: dict, step: int):
    """The run ``after`` resumed from the checkpoint ``before`` (the attempt that trained ``step``)
    wrote at ``step``."""
    sent = {s["global_steps"]: s for s in before["audit"] if s["kind"] == "sync"}
    first = next(s for s in after["audit"] if s["kind"] == "sync")
    assert first["global_steps"] == step  # the restored step's weights go to the rollout first
    assert first["hashes"] == sent[step]["hashes"]  # bit for bit
    saved = {r["rank"]: r for r in before["audit"] if r["kind"] == "checkpoint" and r["op"] == "save"
             and r["path"].endswith(f"global_step_{step}/actor")}
    loaded = {r["rank"]: r for r in after["audit"] if r["kind"] == "checkpoint" and r["op"] == "load"}
    assert saved and sorted(loaded) == sorted(saved), (sorted(saved), sorted(loaded))
    for rank, rec in loaded.items():
        assert rec["path"].endswith(f"global_step_{step}/actor")
        assert rec["optimizer"]["tensors"] > 0
        assert json.dumps(rec["optimizer"], sort_keys=True) == json.dumps(saved[rank]["optimizer"], sort_keys=True)


# a dead worker rank ends the run by itself within seconds (measured: docs/records/verl_features.md);
# this bound is what "does not hang" means here
DEAD_WORKER_EXIT_S = 180


def check_dead_worker(attempt: dict, rank: int, resume_from: int):
    """The attempt whose worker ``rank`` was SIGKILLed ended by itself, non-zero, within
    ``DEAD_WORKER_EXIT_S``, with the launcher's line naming the killed pid, its Ray actor name and
    rank, and the step a rerun resumes from."""
    from cppo_megatron.integrations import watchdog

    dead = attempt["run"]
    assert dead.struck is not None and dead.struck.startswith("pid "), dead.log[-3000:]
    assert dead.returncode not in (0, -9) and dead.exit_after_strike_s < DEAD_WORKER_EXIT_S, dead.log[-3000:]
    print(f"dead worker: exit status {dead.returncode}, {dead.exit_after_strike_s:.1f} s after the kill")  # -rP
    pid, name = dead.struck.split()[1], dead.struck.split("(")[1].rstrip(")")
    lines = [ln for ln in dead.log.splitlines() if ln.startswith(watchdog.PREFIX)]
    assert lines and all(f"pid {pid}" in ln and repr(name) in ln for ln in lines), lines or dead.log[-3000:]
    assert any(f"rank {rank} of placement group 0" in ln
               and f"Rerun the same command to resume from step {resume_from}" in ln for ln in lines), lines
