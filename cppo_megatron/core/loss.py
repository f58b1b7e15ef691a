"""Per-token policy-gradient pieces and the one place losses are aggregated.

After pruning, the batch is a ragged subset spread unevenly over ranks and micro-batches.
A per-rank (or per-micro-batch) mean would weight ranks unequally, so ``aggregate_loss``
takes the denominators of the whole kept set (summed across data-parallel ranks) when
given: each micro-batch then contributes sum / global_denominator, and summing the
contributions (gradient accumulation, an all-reduce SUM) yields the global mean.
"""

from __future__ import annotations

import torch

__all__ = [
    "LOSS_AGG_MODES",
    "KL_KINDS",
    "aggregate_loss",
    "clipped_surrogate",
    "kl_penalty",
    "token_logprobs",
]

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "k2", "k3", "low_var_kl")


def _check_pair(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    for name, t in ((name_a, a), (name_b, b)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if a.shape != b.shape:
        raise ValueError(f"{name_a} {tuple(a.shape)} and {name_b} {tuple(b.shape)} must have the same shape")


def _as_weights(weights: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """[N] finite non-negative per-sequence weights in ``loss``'s dtype and device, or a ValueError."""
    if not isinstance(weights, torch.Tensor) or weights.shape != loss.shape[:1]:
        raise ValueError(
            f"weights must be a [N] tensor for {loss.shape[0]} sequences, got "
            f"{tuple(weights.shape) if isinstance(weights, torch.Tensor) else type(weights).__name__}"
        )
    if not bool(torch.isfinite(weights).all()) or bool((weights < 0).any()):
        raise ValueError("weights must be finite and >= 0 (Selection.weights are 1 / pi_i)")
    return weights.to(device=loss.device, dtype=loss.dtype)


def aggregate_loss(
    loss: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    global_num_tokens: float | None = None,
    global_num_seqs: float | None = None,
    norm_constant: float | None = None,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar.

    Args:
        loss: [N, T] float per-token loss (N kept completions, T response positions).
        mask: [N, T] bool/int/float, 1 for response tokens that count, 0 for prompt/padding.
        mode: ``token-mean`` (TRL fork: sum / tokens), ``seq-mean-token-mean`` (veRL port:
            mean over sequences of each sequence's token mean), ``seq-mean-token-sum``, or
            ``seq-mean-token-sum-norm`` (Dr. GRPO: token sums / (sequences * norm_constant)).
        global_num_tokens: token denominator over the kept set on all ranks (token-mean).
        global_num_seqs: sequence denominator over the kept set on all ranks (seq-* modes).
        norm_constant: Dr. GRPO's constant (default T, the generation budget).
        weights: [N] optional per-sequence weights (``Selection.weights``: 1 / pi_i for
            ``metric=importance``), multiplying every token of their sequence.

    Returns:
        [] scalar in the dtype of ``loss``, differentiable.

    Without the global denominators the local batch's own are used. Sequences with no
    counted token do not count as sequences.

    With ``weights`` each mode's numerator becomes a Horvitz-Thompson estimate of the
    full (unpruned) batch's numerator: ``token-mean`` sums w_i l_it, the ``seq-*`` modes
    sum w_i times each sequence's token mean / token sum. The denominators are constants
    of the full-batch loss, so for an unbiased estimate pass the FULL batch's counts
    (every generated completion, kept or pruned, on all ranks) as ``global_num_tokens`` /
    ``global_num_seqs``; the three ``seq-*`` modes are then exactly unbiased. Without them
    the local defaults become the HT estimates sum_i w_i T_i (tokens) and sum_i w_i
    (sequences): a ratio estimator, consistent but not unbiased. ``token-mean`` with
    weights means "weighted tokens over the full batch's tokens": the estimate of the mean
    per-token loss over every generated token. All-ones weights give the unweighted result.
    """
    _check_pair("loss", loss, "mask", mask)
    if loss.dim() != 2:
        raise ValueError(f"loss must be [N, T], got shape {tuple(loss.shape)}")
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"mode must be one of {list(LOSS_AGG_MODES)}, got {mode!r}")
    for name, v in (("global_num_tokens", global_num_tokens), ("global_num_seqs", global_num_seqs),
                    ("norm_constant", norm_constant)):
        if v is not None and not (float(v) > 0):
            raise ValueError(f"{name} must be > 0, got {v!r}")
    m = mask.to(loss.dtype)
    w = None if weights is None else _as_weights(weights, loss)
    masked = loss * m
    if mode == "token-mean":
        if w is None:
            denom = float(global_num_tokens) if global_num_tokens is not None else m.sum().clamp_min(1.0)
            return masked.sum() / denom
        denom = float(global_num_tokens) if global_num_tokens is not None else (m.sum(1) * w).sum().clamp_min(1e-12)
        return (masked.sum(1) * w).sum() / denom
    tokens_per_seq = m.sum(dim=1)
    seq_sum = masked.sum(dim=1)
    counted = (tokens_per_seq > 0).to(loss.dtype)
    if w is not None:
        seq_sum = seq_sum * w
        counted = counted * w
    num_seqs = float(global_num_seqs) if global_num_seqs is not None else counted.sum().clamp_min(
        1.0 if w is None else 1e-12)
    if mode == "seq-mean-token-mean":
        return (seq_sum / tokens_per_seq.clamp_min(1.0)).sum() / num_seqs
    if mode == "seq-mean-token-sum":
        return seq_sum.sum() / num_seqs
    const = float(norm_constant) if norm_constant is not None else float(loss.shape[1])
    return seq_sum.sum() / (num_seqs * const)


def clipped_surrogate(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate, per token.

    Args:
        logprobs, old_logprobs: [N, T] float log-probs of the sampled tokens under the
            current and the behaviour (old) policy.
        advantages: [N] float (one per completion, broadcast over tokens) or [N, T].
        clip_low, clip_high: ratio clipped to [1 - clip_low, 1 + clip_high] (clip_high
            defaults to clip_low; DAPO's clip-higher uses a larger one).

    Returns:
        loss: [N, T] float = max(-A r, -A clip(r)), r = exp(logprobs - old_logprobs).
        clipped: [N, T] bool, where the clipped branch was taken.
    """
    _check_pair("logprobs", logprobs, "old_logprobs", old_logprobs)
    if advantages.dim() == 1:
        if advantages.shape[0] != logprobs.shape[0]:
            raise ValueError(
                f"advantages has {advantages.shape[0]} entries for {logprobs.shape[0]} sequences"
            )
        advantages = advantages.unsqueeze(1)
    elif advantages.shape != logprobs.shape:
        raise ValueError(f"advantages {tuple(advantages.shape)} must be [N] or {tuple(logprobs.shape)}")
    hi = clip_low if clip_high is None else clip_high
    if not (0 <= clip_low < 1 and hi >= 0):
        raise ValueError(f"clip range must satisfy 0 <= clip_low < 1, clip_high >= 0; got {clip_low}, {hi}")
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + hi)
    return torch.maximum(unclipped, clipped_loss), clipped_loss > unclipped


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token KL estimate to the reference policy.

    ``k1``: log p - log q. ``k2``: (log p - log q)^2 / 2. ``k3`` (Schulman's unbiased,
    low-variance estimator, used by the TRL fork): exp(q - p) - (q - p) - 1.
    ``low_var_kl``: veRL's k3 with the log-ratio clamped to [-20, 20] and the result to
    [-10, 10] for numerical safety.

    Args:
        logprobs: [N, T] float log p of the sampled tokens under the policy.
        ref_logprobs: [N, T] float log q under the reference.
        kind: one of ``KL_KINDS``.

    Returns:
        [N, T] float per-token KL estimate (mask it with ``aggregate_loss``).
    """
    _check_pair("logprobs", logprobs, "ref_logprobs", ref_logprobs)
    if kind not in KL_KINDS:
        raise ValueError(f"kind must be one of {list(KL_KINDS)}, got {kind!r}")
    diff = logprobs - ref_logprobs
    if kind == "k1":
        return diff
    if kind == "k2":
        return 0.5 * diff.square()
    log_ratio = -diff  # log(q / p)
    if kind == "low_var_kl":
        log_ratio = torch.clamp(log_ratio, -20.0, 20.0)
        return torch.clamp(torch.exp(log_ratio) - log_ratio - 1.0, -10.0, 10.0)
    return torch.exp(log_ratio) - log_ratio - 1.0


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Log-probs of the next tokens.

    Args:
        logits: [B, T, V] float, position t predicting ``targets[:, t]``.
        targets: [B, T] int64 token ids in [0, V).

    Returns:
        [B, T] float32 log-softmax of ``logits`` gathered at ``targets``.
    """
    if logits.dim() != 3 or targets.dim() != 2 or logits.shape[:2] != targets.shape:
        raise ValueError(
            f"logits must be [B, T, V] and targets [B, T] with matching B, T; got "
            f"{tuple(logits.shape)} and {tuple(targets.shape)}"
        )
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
