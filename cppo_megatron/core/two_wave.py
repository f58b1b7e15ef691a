"""Adaptive group size in two waves (``cppo.two_wave``; a cheap baseline beside early stopping).

A step generates k = ``first_wave`` completions for each of its n prompts, scores them, and
generates the other G - k only for the groups whose first wave shows reward variance. Pure
functions over tensors:

    finish_groups(first)           [n] bool: which groups get their second wave (spread > min_spread)
    wave_rows(finish, G, k)        where each wave's completions sit in the step's batch
                                   (group g = rows g*G .. g*G+G-1; an unfinished group's last
                                   G - k rows are ``absent``: never generated)
    two_wave_accounting(...)       what was generated, finished and left at k, and the tokens
    two_wave_advantages(r, k, cfg) the estimator on full groups whose first k are wave one
                                   (``bench gradient``): GRPO advantages where the group would
                                   have been finished, 0 (and dropped) where not

The estimator: a finished group has all G completions and its ordinary full-group advantages
(then CPPO prunes as usual); an unfinished group is not trained on (at size k every advantage
would be 0). Its bias: a prompt of success rate p whose first k completions agree (probability
p^k + (1 - p)^k) loses the signal its full G would have had (docs/early_stopping.md, "Two waves").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._checks import check_float, check_int
from .advantage import group_advantages
from .settings import CPPOConfig, check_config

__all__ = ["TwoWaveAccounting", "finish_groups", "two_wave_accounting", "two_wave_advantages", "wave_rows"]


def _rewards_2d(name: str, x: torch.Tensor) -> torch.Tensor:
    """``x`` as a finite [n, k] float64 tensor on the CPU; ValueError naming ``name`` otherwise."""
    t = torch.as_tensor(x)
    if t.dim() != 2 or not (t.dtype.is_floating_point or t.dtype in (torch.int64, torch.int32, torch.bool)):
        raise ValueError(f"{name} must be an [n, k] tensor of rewards (one row per group), got shape "
                         f"{tuple(t.shape)} of {t.dtype}")
    t = t.detach().to("cpu", torch.float64)
    if not bool(torch.isfinite(t).all()):
        bad = (~torch.isfinite(t)).any(1).nonzero().squeeze(1).tolist()
        raise ValueError(f"{name} has non-finite rewards (rows {bad}); score every completion of the first wave")
    return t


def finish_groups(first_wave: torch.Tensor, *, min_spread: float = 0.0) -> torch.Tensor:
    """Which groups get their second wave.

    Args:
        first_wave: [n, k] float rewards of each group's first-wave completions (k >= 2).
        min_spread: a group is finished when max - min of its k rewards is larger than this
            (>= 0; 0: any difference).

    Returns:
        [n] bool, True for the groups to finish.

    Example::

        >>> finish_groups(torch.tensor([[1., 1.], [0., 1.], [0., 0.]]))
        tensor([False,  True, False])
    """
    r = _rewards_2d("first_wave", first_wave)
    if r.shape[1] < 2:
        raise ValueError(f"first_wave has k={r.shape[1]} completions per group: one completion never shows reward "
                         "variance; generate at least 2 in the first wave")
    spread = check_float("min_spread", min_spread, minimum=0.0)
    if r.shape[0] == 0:
        return torch.zeros(0, dtype=torch.bool)
    return (r.max(dim=1).values - r.min(dim=1).values) > spread


def wave_rows(finish: torch.Tensor, group_size: int,
              first_wave: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each wave's completions sit in the step's batch of n groups of G rows.

    Args:
        finish: [n] bool, the groups that get their second wave (``finish_groups``).
        group_size: G. first_wave: k, 1 <= k < G.

    Returns:
        (first [n*k] int64, second [f*(G-k)] int64, absent [n*G] bool): the batch row of the j-th
        first-wave completion (prompt-major, k per group: group g's at g*G .. g*G+k-1), of the j-th
        second-wave completion (the f finished groups in order, G - k each: g*G+k .. g*G+G-1), and
        the rows never generated (an unfinished group's last G - k).

    Example::

        >>> wave_rows(torch.tensor([True, False]), 4, 2)
        (tensor([0, 1, 4, 5]), tensor([2, 3]), tensor([False, False, False, False, False, False,  True,  True]))
    """
    G = check_int("group_size", group_size, minimum=2)
    k = check_int("first_wave", first_wave, minimum=1)
    if k >= G:
        raise ValueError(f"first_wave={k} must be smaller than group_size={G}: the second wave generates G - k")
    f = torch.as_tensor(finish)
    if f.dim() != 1 or f.dtype != torch.bool:
        raise ValueError(f"finish must be an [n] bool tensor, got shape {tuple(f.shape)} of {f.dtype}")
    n = f.numel()
    base = torch.arange(n, dtype=torch.int64).unsqueeze(1) * G
    first = (base + torch.arange(k)).reshape(-1)
    second = (base[f] + torch.arange(k, G)).reshape(-1)
    absent = torch.zeros(n, G, dtype=torch.bool)
    absent[~f, k:] = True
    return first, second, absent.reshape(-1)


@dataclass(frozen=True)
class TwoWaveAccounting:
    """One step's two-wave accounting (plain ints / floats).

    groups = finished + unfinished; completions_generated = wave1 + wave2 = k * groups +
    (G - k) * finished; completions_full = G * groups (what one wave of G would have generated);
    completions_unfinished = k * unfinished (generated, never trained). ``tokens_saved_estimate``:
    the second waves not generated, at the mean length of their group's first wave.
    """

    group_size: int
    first_wave: int
    groups: int
    finished: int
    completions_wave1: int
    completions_wave2: int
    tokens_wave1: int
    tokens_wave2: int
    tokens_saved_estimate: float

    @property
    def unfinished(self) -> int:
        return self.groups - self.finished

    @property
    def completions_generated(self) -> int:
        return self.completions_wave1 + self.completions_wave2

    @property
    def completions_full(self) -> int:
        return self.group_size * self.groups

    @property
    def completions_unfinished(self) -> int:
        return self.first_wave * self.unfinished

    @property
    def tokens_generated(self) -> int:
        return self.tokens_wave1 + self.tokens_wave2

    def check(self) -> TwoWaveAccounting:
        """RuntimeError unless every completion is counted: 0 <= finished <= groups, k per group in
        the first wave and G - k per finished group in the second (so generated + the (G - k) never
        generated per unfinished group = G x groups)."""
        k, G = self.first_wave, self.group_size
        if not 0 <= self.finished <= self.groups or self.completions_wave1 != k * self.groups \
                or self.completions_wave2 != (G - k) * self.finished:
            raise RuntimeError(f"two-wave accounting: {self.completions_wave1} first-wave and {self.completions_wave2} "
                               f"second-wave completions for {self.groups} groups ({self.finished} finished), k={k}, "
                               f"G={G}")
        return self

    def metrics(self, prefix: str = "two_wave/") -> dict[str, float]:
        """The step's ``two_wave/*`` metrics, plain floats."""
        est_full = self.tokens_generated + self.tokens_saved_estimate
        out = {
            "groups": self.groups, "groups_finished": self.finished, "groups_unfinished": self.unfinished,
            "finished_share": self.finished / self.groups if self.groups else 0.0,
            "first_wave": self.first_wave,
            "completions_wave1": self.completions_wave1, "completions_wave2": self.completions_wave2,
            "completions_generated": self.completions_generated, "completions_full": self.completions_full,
            "completions_unfinished": self.completions_unfinished,
            "completions_share": self.completions_generated / self.completions_full if self.groups else 0.0,
            "tokens_wave1": self.tokens_wave1, "tokens_wave2": self.tokens_wave2,
            "tokens_generated": self.tokens_generated, "tokens_saved_estimate": self.tokens_saved_estimate,
            "tokens_share_estimate": self.tokens_generated / est_full if est_full > 0 else 1.0,
        }
        return {prefix + key: float(v) for key, v in out.items()}


def two_wave_accounting(finish: torch.Tensor, lengths: torch.Tensor, absent: torch.Tensor, *, group_size: int,
                        first_wave: int) -> TwoWaveAccounting:
    """One step's ``TwoWaveAccounting``, checked.

    Args:
        finish: [n] bool, the groups that got their second wave.
        lengths: [n*G] int tokens generated per batch row (0 on the absent rows).
        absent: [n*G] bool rows never generated (``wave_rows``' third output).
        group_size: G. first_wave: k.

    A mismatch between ``absent`` and ``finish`` (a finished group missing a row, an unfinished one
    with a second-wave row) or a generated length on an absent row is a RuntimeError."""
    first, second, expected = wave_rows(finish, group_size, first_wave)
    G, k, n = group_size, first_wave, int(finish.numel())
    ln = torch.as_tensor(lengths)
    ab = torch.as_tensor(absent, dtype=torch.bool)
    if ln.shape != (n * G,) or ab.shape != (n * G,) or ln.dtype.is_floating_point:
        raise ValueError(f"two-wave accounting: lengths {tuple(ln.shape)} ({ln.dtype}) and absent {tuple(ab.shape)} "
                         f"must be [n*G] = [{n * G}] (int tokens, bool)")
    if not torch.equal(ab, expected):
        raise RuntimeError(f"two-wave accounting: absent rows {ab.nonzero().squeeze(1).tolist()} differ from the "
                           f"unfinished groups' second waves {expected.nonzero().squeeze(1).tolist()}")
    if bool((ln[ab] != 0).any()) or bool((ln < 0).any()):
        raise RuntimeError("two-wave accounting: a row never generated has tokens (or a length is negative)")
    ln = ln.to(torch.int64)
    per_group_wave1 = ln[first].reshape(n, k).to(torch.float64).mean(1) if n else torch.zeros(0)
    saved = float((per_group_wave1[~finish] * (G - k)).sum())
    return TwoWaveAccounting(group_size=G, first_wave=k, groups=n, finished=int(finish.sum()),
                             completions_wave1=int(first.numel()), completions_wave2=int(second.numel()),
                             tokens_wave1=int(ln[first].sum()), tokens_wave2=int(ln[second].sum()),
                             tokens_saved_estimate=saved).check()


def two_wave_advantages(rewards: torch.Tensor, first_wave: int, cfg: CPPOConfig, *,
                        min_spread: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The two-wave estimator on complete groups (``bench gradient``): what the trainer would train
    on had each group's first ``first_wave`` completions been its first wave.

    Args:
        rewards: [n, G] float rewards; columns 0 .. k-1 stand for the first wave.
        first_wave: k, 2 <= k < G. cfg: the ``CPPOConfig`` (adv_norm, eps).
        min_spread: as in ``finish_groups``.

    Returns:
        (advantages [n*G] float32, finished [n] bool): the ordinary full-group advantages of the
        finished groups' rows, 0 on the unfinished groups' rows (which are not trained on).
    """
    r = _rewards_2d("rewards", rewards)
    n, G = r.shape
    k = check_int("first_wave", first_wave, minimum=2)
    if k >= G:
        raise ValueError(f"first_wave={k} must be smaller than the group size G={G}")
    check_config(cfg)
    finish = finish_groups(r[:, :k], min_spread=min_spread)
    gids = torch.arange(n).repeat_interleave(G)
    adv, _ = group_advantages(r.reshape(-1).to(torch.float32), gids, adv_norm=cfg.adv_norm, eps=cfg.eps)
    adv = torch.where(finish.repeat_interleave(G), adv, torch.zeros_like(adv))
    return adv.to(torch.float32), finish
