"""The per-step signal of a generated batch, the same ``signal/*`` keys in every host.

Which groups carry a learning signal (a group whose rewards are all equal has advantage 0 for
every member: all correct, or all wrong), how long the completions were and how many tokens
the step generated, and what share of the step generation took. The embedded trainer, the
veRL hook and the OpenRLHF hook compute them over every completion the step generated (before
CPPO prunes any), so a plot of ``signal/zero_variance_share`` shows the regime a run is in:
the share of groups that teach nothing, rising as prompts become solved (docs/trainer.md,
"Signal metrics").
"""

from __future__ import annotations

import torch

from ._checks import as_1d_float

__all__ = ["SIGNAL_KEYS", "gen_share", "signal_metrics"]

SIGNAL_KEYS = ("groups", "zero_variance_share", "all_correct_share", "all_wrong_share", "completions",
               "mean_length", "generated_tokens")


def signal_metrics(rewards: torch.Tensor, group_ids: torch.Tensor, *, correct: torch.Tensor | None = None,
                   lengths: torch.Tensor | None = None, easy_threshold: float = 1.0,
                   prefix: str = "signal/") -> dict[str, float]:
    """The ``signal/*`` metrics of one step's generated completions, plain floats.

    Args:
        rewards: [N] float finite scalar reward of every completion generated this step.
        group_ids: [N] int64 group (prompt) of each completion; any values, any order.
        correct: [N] float or bool, 1 where the completion is correct; None: a zero-variance
            group counts as all correct when its reward is ``>= easy_threshold``.
        lengths: [N] int64 tokens generated per completion; None leaves the length keys out.
        easy_threshold: see ``correct``.
        prefix: key prefix.

    Returns:
        ``groups`` (M), ``zero_variance_share`` (groups of two or more whose rewards are all
        equal, / M), ``all_correct_share`` and ``all_wrong_share`` (the zero-variance groups
        whose members are all correct / not all correct, / M; they add up to
        ``zero_variance_share``), ``completions`` (N); with ``lengths``: ``mean_length`` and
        ``generated_tokens`` (their sum). All 0 for an empty batch.

    Example::

        >>> signal_metrics(torch.tensor([1., 1., 0., 0., 1., 0.]), torch.tensor([0, 0, 1, 1, 2, 2]))
        {'signal/groups': 3.0, 'signal/zero_variance_share': 0.6666666666666666, \
'signal/all_correct_share': 0.3333333333333333, 'signal/all_wrong_share': 0.3333333333333333, \
'signal/completions': 6.0}
    """
    r = as_1d_float("rewards", rewards, allow_empty=True).detach().to("cpu", torch.float64)
    g = torch.as_tensor(group_ids)
    if g.dim() != 1 or g.numel() != r.numel() or g.dtype.is_floating_point:
        raise ValueError(f"group_ids must be [N] integers, one per reward (N={r.numel()}), got shape "
                         f"{tuple(g.shape)} of {g.dtype}")
    ok = _per_row("correct", correct, r.numel())
    n_tok = _per_row("lengths", lengths, r.numel())
    if n_tok is not None and bool((n_tok < 0).any()):
        raise ValueError(f"lengths must be >= 0 tokens, got {n_tok.min():g}")
    if not isinstance(prefix, str):
        raise ValueError(f"prefix must be a str such as 'signal/', got {type(prefix).__name__}")
    n = r.numel()
    if n:
        _, inv, size = torch.unique(g.to("cpu", torch.int64), return_inverse=True, return_counts=True)
        m = size.numel()
        hi = torch.full((m,), -torch.inf, dtype=torch.float64).scatter_reduce(0, inv, r, "amax")
        lo = torch.full((m,), torch.inf, dtype=torch.float64).scatter_reduce(0, inv, r, "amin")
        zv = (size > 1) & (hi == lo)
        if ok is None:
            easy = zv & (lo >= float(easy_threshold))
        else:
            worst = torch.full((m,), torch.inf, dtype=torch.float64).scatter_reduce(0, inv, ok, "amin")
            easy = zv & (worst >= 1.0)
        n_zv, n_easy = int(zv.sum()), int(easy.sum())
    else:
        m = n_zv = n_easy = 0
    out = {
        f"{prefix}groups": float(m),
        f"{prefix}zero_variance_share": n_zv / m if m else 0.0,
        f"{prefix}all_correct_share": n_easy / m if m else 0.0,
        f"{prefix}all_wrong_share": (n_zv - n_easy) / m if m else 0.0,
        f"{prefix}completions": float(n),
    }
    if n_tok is not None:
        total = float(n_tok.sum())
        out[f"{prefix}mean_length"] = total / n if n else 0.0
        out[f"{prefix}generated_tokens"] = total
    return out


def _per_row(name: str, x: torch.Tensor | None, n: int) -> torch.Tensor | None:
    if x is None:
        return None
    t = torch.as_tensor(x)
    if t.dim() != 1 or t.numel() != n:
        raise ValueError(f"{name} must be [N] with one entry per reward (N={n}), got shape {tuple(t.shape)}")
    return t.detach().to("cpu", torch.float64)


def gen_share(t_gen: float, t_step: float, prefix: str = "signal/") -> dict[str, float]:
    """``{prefix}gen_share``: the share of a step's wall time spent generating (rollout and
    reward; t_gen / t_step, 0 when t_step is 0). Both in seconds, >= 0."""
    for name, v in (("t_gen", t_gen), ("t_step", t_step)):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not v >= 0:
            raise ValueError(f"{name} must be seconds >= 0, got {v!r}")
    return {f"{prefix}gen_share": float(t_gen) / float(t_step) if t_step > 0 else 0.0}
