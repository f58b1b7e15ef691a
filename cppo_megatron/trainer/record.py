"""The per-step metrics record of the embedded trainer (one ``metrics.jsonl`` line per RL
step; docs/trainer.md lists every key)."""

from __future__ import annotations

import resource
import time

import torch

from ..core.signal import gen_share, signal_metrics
from ..distributed import wait_stats
from .metrics import GEN_PHASES, logprob_diff, logprob_diff_sums, rollout_metrics, update_metrics

__all__ = ["step_record"]


def step_record(recipe, rollout, planner, sampler, batch, surv, rows, old, ref, upd, seconds: dict,
                t_step: float) -> dict:
    """The metrics record of one RL step (``metrics.jsonl``): phase times, rewards, the CPPO
    decision and its placement, rollout and update figures, and the per-rank lists (every
    rank's pass times, waits, rows), gathered over the ranks of ``rollout``.

    batch / surv / rows: the step's ``RolloutBatch``, ``Survivors`` and this rank's
    ``TrainRows``; old / ref / upd: the passes' results (None when a pass did not run);
    seconds: the ``PhaseTimer``'s per-phase seconds; t_step: ``perf_counter`` at the step's start.
    """
    r = recipe
    passes = seconds["old_logprob"] + seconds["ref_logprob"] + seconds["update"]
    forwarded = upd.forwarded + sum(p.forwarded for p in (old, ref) if p is not None)
    padded = upd.padded_tokens + sum(p.padded_tokens for p in (old, ref) if p is not None)
    mine = {"pass_seconds": passes, "old_logprob_seconds": seconds["old_logprob"],
            "forwarded_sequences": float(forwarded), "received": float(len(rows)), "owned": float(rows.owned),
            "padded_tokens": float(padded), "dp_rank": float(rollout.dp_rank),
            "generate_seconds": batch.seconds}
    ranks = rollout.gather(mine)
    diff = {}
    if batch.sampler_logprobs is not None:  # the same on every rank (rollout.engine)
        behaviour = old.values if old is not None else upd.behaviour
        sums = logprob_diff_sums(rows.sampler_logprobs, behaviour)
        sums = torch.cat([rollout.reduce_dp(sums[:2]), rollout.reduce_dp(sums[2:], op="max")])
        diff = logprob_diff(sums, r.rollout.logprob_warn_threshold if rollout.is_main else None)

    rec: dict = {f"time/{k}": v for k, v in seconds.items()}
    rec["time/step"] = time.perf_counter() - t_step
    # over the completions that finished (all of them unless cppo.early_stop stopped some: a stopped
    # completion has no reward; early_stop/reward_mean_estimate imputes them; cppo.two_wave's absent
    # rows were never generated)
    fin = batch.finished
    rec["reward/mean"] = float(batch.rewards[fin].double().mean())  # float64: a float32 sum drifts at 1e-9
    rec["reward/correct_rate"] = float(batch.correct[fin].double().mean())
    rec["reward/format_rate"] = float(batch.formatted[fin].double().mean())
    rec["reward/mean_kept"] = float(batch.rewards[surv.kept].mean())
    rec.update(surv.prune.metrics())
    rec.update(surv.alloc)
    rec.update(planner.metrics())
    rec.update(rows.placement)
    imb = rows.placement["cppo/exchange_imbalance"]
    rec["cppo/exchange_mean_load"] = rows.placement["cppo/exchange_max_load"] / imb if imb > 0 else 0.0
    gen = batch.generated  # cppo.two_wave: an unfinished group's absent rows were never generated
    rec.update(rollout_metrics(batch.completion_lengths[gen], batch.truncated[gen],
                               max(x["generate_seconds"] for x in ranks)))
    rec.update(diff)
    # signal/*: every group generated this step (dropped and pruned ones too), as in the hosts; the
    # completions that finished (cppo.early_stop: a stopped one has no reward)
    rec.update(signal_metrics(batch.rewards[fin], batch.group_ids[fin], correct=batch.correct[fin],
                              lengths=batch.completion_lengths[fin]))
    rec.update(gen_share(sum(seconds[p] for p in GEN_PHASES), rec["time/step"]))
    rec.update(update_metrics(upd.iterations, lr=upd.lr, tokens=upd.tokens, sequences=upd.sequences,
                              micro_batches=upd.micro_batches))
    for key in ("pass_seconds", "old_logprob_seconds", "forwarded_sequences", "received", "owned",
                "padded_tokens", "dp_rank"):
        rec[f"rank/{key}"] = [x[key] for x in ranks]
    # The update ends in the DP gradient all-reduce, where a lighter rank idles until the
    # heaviest arrives: that hides imbalance in pass_seconds. The old-policy pass has no
    # DP collective, so its spread is the measured cost of unequal workloads.
    pass_seconds = [x["pass_seconds"] for x in ranks]
    rec.update(wait_stats(pass_seconds))
    rec["rank/wait_seconds"] = [max(pass_seconds) - t for t in pass_seconds]
    old_s = [x["old_logprob_seconds"] for x in ranks]
    rec["rank/old_logprob_imbalance"] = max(old_s) / (sum(old_s) / len(old_s)) if sum(old_s) > 0 else 1.0
    rec["rank/old_logprob_wait_mean"] = sum(max(old_s) - t for t in old_s) / len(old_s)
    rec["data/epoch"] = sampler.epochs_float
    rec["sys/peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return rec
