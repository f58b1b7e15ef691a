"""The one metric namespace of a trainer step, shared by both policy backends.

Every ``kind: step`` record in metrics.jsonl has the same keys whichever backend wrote it
(a test compares them): ``time/<phase>`` for each of ``PHASES``, ``reward/*``, ``cppo/*``,
``alloc/*``, ``rollout/*``, ``signal/*`` (``core.signal``: the keys the veRL and OpenRLHF hooks
log too), ``train/*``, ``rank/*`` (one entry per process), ``data/epoch``, ``sys/peak_rss_mb``.
The report, ``bench speedup`` and ``study`` read ``PHASES`` from here.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

__all__ = ["GEN_PHASES", "PASS_PHASES", "PHASES", "logprob_diff", "logprob_diff_sums", "rollout_metrics",
           "update_metrics"]

# in step order; time/<phase> seconds each
PHASES = ("rollout", "reward", "cppo", "old_logprob", "ref_logprob", "update", "sync")
GEN_PHASES = ("rollout", "reward")  # T_gen of the speedup bound
PASS_PHASES = ("old_logprob", "ref_logprob", "update")  # T_rest: what pruning shrinks

# per optimizer step, from either backend's update
UPDATE_KEYS = ("loss", "pg_loss", "kl", "clipfrac", "ratio_max", "grad_norm")


def update_metrics(iterations: Sequence[dict], *, lr: float, tokens: float, sequences: float,
                   micro_batches: float) -> dict[str, float]:
    """``train/*`` of one RL step from the mu optimizer steps' metrics: loss, pg_loss, kl and
    clipfrac averaged over the steps, ratio_max their maximum, grad_norm (before clipping)
    and lr those of the last step; tokens / sequences of the kept set (all ranks)."""
    if not iterations:
        raise ValueError("update_metrics: no optimizer steps")
    for i, it in enumerate(iterations):
        missing = [k for k in UPDATE_KEYS if k not in it]
        if missing:
            raise ValueError(f"update_metrics: optimizer step {i} lacks {missing}")
    mu = len(iterations)
    out = {f"train/{k}": sum(float(it[k]) for it in iterations) / mu for k in ("loss", "pg_loss", "kl", "clipfrac")}
    out["train/ratio_max"] = max(float(it["ratio_max"]) for it in iterations)
    out["train/grad_norm"] = float(iterations[-1]["grad_norm"])
    out["train/lr"] = float(lr)
    out["train/tokens"] = float(tokens)
    out["train/sequences"] = float(sequences)
    out["train/micro_batches"] = float(micro_batches)
    return out


def rollout_metrics(completion_lengths: torch.Tensor, truncated: torch.Tensor, seconds: float) -> dict[str, float]:
    """``rollout/*`` over every completion of the step (all rounds, all ranks).

    completion_lengths: [N] int64 tokens; truncated: [N] bool (hit max_new_tokens);
    seconds: generation wall time (the slowest generating rank's)."""
    n = int(completion_lengths.numel())
    tokens = float(completion_lengths.sum()) if n else 0.0
    return {
        "rollout/completions": float(n),
        "rollout/tokens": tokens,
        "rollout/mean_length": tokens / max(n, 1),
        "rollout/max_length": float(completion_lengths.max()) if n else 0.0,
        "rollout/truncated_ratio": float(truncated.float().mean()) if n else 0.0,
        "rollout/tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
    }


def logprob_diff_sums(sampler: Sequence[torch.Tensor], trainer: Sequence[torch.Tensor]) -> torch.Tensor:
    """[3] float64: sum |sampler - trainer| log-prob, token count, largest |diff|, over the
    completion tokens of this rank's rows (``sampler[i]``, ``trainer[i]``: [len_i] each)."""
    if len(sampler) != len(trainer):
        raise ValueError(f"logprob_diff: {len(sampler)} rows of sampler log-probs for {len(trainer)} trainer rows")
    out = torch.zeros(3, dtype=torch.float64)
    for i, (s, t) in enumerate(zip(sampler, trainer, strict=True)):
        if s.numel() != t.numel():
            raise ValueError(f"logprob_diff: {s.numel()} sampler log-probs for completion {i} of {t.numel()} tokens")
        d = (s.double() - t.double()).abs()
        out[0] += float(d.sum())
        out[1] += d.numel()
        if d.numel():
            out[2] = max(float(out[2]), float(d.max()))
    return out


def logprob_diff(sums: torch.Tensor, warn_threshold: float | None = None) -> dict[str, float]:
    """``rollout/logprob_diff`` (mean |engine - trainer| log-prob over the kept tokens, with the
    weights the completions were sampled with) and ``_max`` from ``logprob_diff_sums``
    (summed over ranks; the third entry maxed). Warns above ``warn_threshold``."""
    diff = float(sums[0] / sums[1]) if float(sums[1]) > 0 else 0.0
    if warn_threshold is not None and diff > warn_threshold:
        warnings.warn(f"rollout/logprob_diff={diff:.4f} exceeds {warn_threshold}: "
                      "the rollout engine and the trainer disagree", stacklevel=2)
    return {"rollout/logprob_diff": diff, "rollout/logprob_diff_max": float(sums[2])}
