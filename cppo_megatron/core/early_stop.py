"""Early stopping inside the rollout engine ("prune as you generate"): the pure pieces every host uses.

CPPO keeps, per group, the completions with the largest |A|: for a binary outcome the minority
one (the rare successes of a hard prompt, the rare failures of an easy one). A completion on its
way to the majority outcome will be pruned after generation, with all its tokens paid for. Here
generation runs in segments; at each boundary every completion of a group is scored by an online
predictor, and the unfinished ones it expects in the majority are stopped.

    prefix_features      what the predictor sees of each completion at a boundary: [R, F]
    PrefixPredictor      online logistic regression P(success | prefix), fitted between steps on
                         the previous steps' finished completions (never the current step's)
    StopHistory          those completions: boundary features and outcomes, by step
    explore_groups       the groups of a round generated in full (unbiased labels, AUC)
    decide_stops         the rule: which unfinished completions of each group to stop
    decide_at_boundary   one boundary as a host runs it: features, scores, the rule, explore
                         groups' shadow decisions (the embedded trainer and veRL's coordinator)
    replay_early_stop    the decisions an engine would have made on completions generated in full
                         (bench gradient; the history of a run without stopping)
    imputed_moments      a stopped completion's expected reward and squared reward
    early_stop_prune     the estimator (group statistics with stopped completions) and CPPO's
                         selection over the finished completions
    estimate_full_lengths, StopAccounting   tokens and completions: kept / pruned / stopped
    roc_auc, calibration predictor quality

The estimator (``cppo.early_stop.estimator``). A stopped completion has no reward. With
``impute`` its expected reward mu_i = q_i r1 + (1 - q_i) r0 (q_i its last predicted success
probability, r1 / r0 the mean reward of successes / failures in the predictor's history) stands
in for it in the group mean, and the group's sum of squares is estimated by
SS = sum_fin r^2 + sum_stop E[r_i^2] - G mean^2 - sum_stop Var_i / G (its expectation when the
predictor is calibrated and outcomes are independent). Bias: the mean and the variance are
unbiased exactly when the predictor is calibrated (E[r | prefix] = mu_i); the std, a square root,
is biased low by Jensen's inequality; a miscalibrated predictor shifts every survivor's
advantage by (mean error) / std. Stopped completions are never trained on: the update is CPPO's
on the finished completions, so a stopped completion that would have been kept (a
misprediction) is a lost large-|A| term, the error ``bench gradient`` measures. With
``finished`` the statistics come from the finished completions alone (ARRoL's balanced
survivors): simpler, and biased toward the survivors' balance by construction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ._checks import as_1d_float, as_group_ids, check_float, check_int
from .advantage import GroupStats, group_advantages
from .selection import Selection, seeded_generator, select_completions
from .settings import check_config, keep_count

if TYPE_CHECKING:
    from .settings import CPPOConfig

__all__ = [
    "ENTROPY_FEATURES",
    "LOGPROB_FEATURES",
    "RUNNING",
    "RUN_TOTALS",
    "FINISHED",
    "STOPPED",
    "BoundaryOutcome",
    "EarlyStopPrune",
    "PrefixPredictor",
    "StopAccounting",
    "StopHistory",
    "StopDecision",
    "StopLearner",
    "calibration",
    "decide_at_boundary",
    "decide_stops",
    "early_stop_prune",
    "estimate_full_lengths",
    "explore_group",
    "explore_groups",
    "feature_names",
    "imputed_moments",
    "learner_state",
    "prefix_features",
    "quality_metrics",
    "replay_early_stop",
    "restore_learner_state",
    "shadow_wrong_stop_share",
    "step_accounting",
    "roc_auc",
]

# the run's running totals every host carries across steps and restarts
RUN_TOTALS = ("started", "stopped", "kept", "tokens_generated", "tokens_saved_estimate")

# a completion's status at a boundary
RUNNING, FINISHED, STOPPED = 0, 1, 2
LOGPROB_FEATURES = ("mean_logprob", "min_logprob", "last_mean_logprob", "last_min_logprob", "low_share",
                    "position", "finished", "group_mean_logprob", "centered_mean_logprob", "centered_low_share")
ENTROPY_FEATURES = ("mean_entropy", "max_entropy", "last_mean_entropy", "centered_mean_entropy")
LOW_LOGPROB = math.log(0.5)  # a token sampled with probability below one half is an uncertain one
# seeded_generator streams (0: selection's tie-breaks, 1: importance, 7: the prompt sampler)
EXPLORE_STREAM, STOP_STREAM = 11, 13
SHARE_TIE = 1e-6  # an expected share this close to 1/2 has no majority (float32 noise of a balanced group)


def feature_names(features: str, hidden_size: int = 0) -> tuple[str, ...]:
    """Column names of ``prefix_features`` for a feature set (``logprob``, ``entropy``, ``hidden``)."""
    names: tuple[str, ...] = LOGPROB_FEATURES
    if features in ("entropy", "hidden"):
        names += ENTROPY_FEATURES
    if features == "hidden":
        names += tuple(f"hidden_{i}" for i in range(hidden_size))
    return names


class Scorer(Protocol):
    """What a boundary decision scores with: a ``PrefixPredictor``, or scores known per row."""

    @property
    def fitted(self) -> bool: ...

    def predict(self, x: torch.Tensor) -> torch.Tensor: ...


# ---------------------------------------------------------------------------------- features
def _masked_stats(values: torch.Tensor, lengths: torch.Tensor, last: int) -> torch.Tensor:
    """[R, 4] mean, min, mean of the last ``last`` tokens, min of those, over each row's valid prefix."""
    R, T = values.shape
    pos = torch.arange(T).unsqueeze(0)
    valid = pos < lengths.unsqueeze(1)
    tail = valid & (pos >= (lengths - last).unsqueeze(1))
    n = valid.sum(1).clamp_min(1).to(values.dtype)
    nt = tail.sum(1).clamp_min(1).to(values.dtype)
    big = torch.finfo(values.dtype).max
    mean = torch.where(valid, values, 0).sum(1) / n
    low = torch.where(valid, values, big).amin(1) if T else torch.zeros(R, dtype=values.dtype)
    tmean = torch.where(tail, values, 0).sum(1) / nt
    tlow = torch.where(tail, values, big).amin(1) if T else torch.zeros(R, dtype=values.dtype)
    empty = lengths == 0
    return torch.stack([mean, torch.where(empty, 0, low), tmean, torch.where(empty, 0, tlow)], 1)


def _group_mean(x: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """[R] the mean of ``x`` over each row's group (rows given), row-aligned."""
    _, inv = torch.unique(group_ids, return_inverse=True)
    m = int(inv.max()) + 1 if inv.numel() else 0
    total = torch.zeros(m, dtype=x.dtype).index_add_(0, inv, x)
    count = torch.zeros(m, dtype=x.dtype).index_add_(0, inv, torch.ones_like(x))
    return (total / count)[inv]


def prefix_features(logprobs: torch.Tensor, lengths: torch.Tensor, group_ids: torch.Tensor,
                    finished: torch.Tensor, *, segment_tokens: int, max_new_tokens: int,
                    entropies: torch.Tensor | None = None, hidden: torch.Tensor | None = None) -> torch.Tensor:
    """What the predictor sees of each completion at a boundary (model-side signals only).

    Args:
        logprobs: [R, T] float, the sampled tokens' log-probs; row r is read in ``[:lengths[r]]``.
        lengths: [R] int64 tokens generated so far (its prefix; at most T).
        group_ids: [R] int64 prompt of each row; the group columns average over the rows of a
            group given here (pass every running and finished member of a group together).
        finished: [R] bool, the completion has ended (EOS or the length limit).
        segment_tokens: > 0, tokens of a segment (the "last" columns read the last segment).
        max_new_tokens: > 0, the length limit (``position`` = lengths / max_new_tokens).
        entropies: [R, T] float per-token entropies of the sampling distribution, or None.
        hidden: [R, D] float the policy's last hidden state at the boundary, or None.

    Returns:
        [R, F] float64, columns ``feature_names`` (``logprob`` set, then ``entropy``, then the D
        hidden columns, as given).
    """
    check_int("segment_tokens", segment_tokens, minimum=1)
    check_int("max_new_tokens", max_new_tokens, minimum=1)
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [R, T], got shape {tuple(logprobs.shape)}")
    R = logprobs.shape[0]
    n = lengths.to(torch.int64).cpu()
    g = as_group_ids("group_ids", group_ids, R).cpu()
    if n.shape != (R,) or finished.shape != (R,):
        raise ValueError(f"lengths {tuple(n.shape)} and finished {tuple(finished.shape)} must be [{R}]")
    if R and (bool((n < 0).any()) or int(n.max()) > logprobs.shape[1]):
        raise ValueError(f"lengths must be in [0, T={logprobs.shape[1]}], got {n.tolist()}")
    lp = logprobs.detach().to("cpu", torch.float64)
    stats = _masked_stats(lp, n, segment_tokens)
    valid = torch.arange(lp.shape[1]).unsqueeze(0) < n.unsqueeze(1)
    low = (valid & (lp < LOW_LOGPROB)).sum(1).to(torch.float64) / n.clamp_min(1).to(torch.float64)
    gmean = _group_mean(stats[:, 0], g)
    cols = [stats, low[:, None], (n.to(torch.float64) / max_new_tokens)[:, None],
            finished.to(torch.float64).cpu()[:, None], gmean[:, None], (stats[:, 0] - gmean)[:, None],
            (low - _group_mean(low, g))[:, None]]
    if entropies is not None:
        ent = _masked_stats(entropies.detach().to("cpu", torch.float64), n, segment_tokens)
        big = torch.where(valid, entropies.detach().to("cpu", torch.float64), 0).amax(1) if lp.shape[1] else ent[:, 0]
        cols += [ent[:, :1], big[:, None], ent[:, 2:3], (ent[:, 0] - _group_mean(ent[:, 0], g))[:, None]]
    if hidden is not None:
        if hidden.dim() != 2 or hidden.shape[0] != R:
            raise ValueError(f"hidden must be [R={R}, D], got shape {tuple(hidden.shape)}")
        cols.append(hidden.detach().to("cpu", torch.float64))
    return torch.cat(cols, 1)


# ---------------------------------------------------------------------------------- predictor
class PrefixPredictor:
    """Online logistic regression P(success | prefix features), ridge-penalised, fitted by Newton's
    method on standardised features (float64, CPU). Cheap: F is 10-14 columns (plus the hidden
    size with ``features=hidden``), the history a few thousand rows.

    ``fit`` replaces the model with one fitted on the examples given (the host passes the
    previous steps' finished completions); ``predict`` scores rows; ``class_means`` are the mean
    rewards of failures and successes in the last fit (the impute estimator's r0, r1).
    """

    def __init__(self, l2: float = 1.0, max_iter: int = 50) -> None:
        self.l2 = check_float("l2", l2, minimum=0.0)
        self.max_iter = check_int("max_iter", max_iter, minimum=1)
        self.weights: torch.Tensor | None = None  # [F + 1] intercept first, on standardised features
        self.mean: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None
        self.class_means = (0.0, 1.0)
        self.examples = (0, 0)  # (failures, successes) of the last fit
        self.version = 0  # fits so far (a fingerprint for audit records)

    @property
    def fitted(self) -> bool:
        return self.weights is not None

    def fit(self, x: torch.Tensor, y: torch.Tensor, rewards: torch.Tensor) -> PrefixPredictor:
        """Fit on ``x`` [E, F] float, ``y`` [E] 0/1 outcomes, ``rewards`` [E] float (class means)."""
        x = x.detach().to("cpu", torch.float64)
        y = as_1d_float("y", y).to(torch.float64)
        r = as_1d_float("rewards", rewards).to(torch.float64)
        if x.dim() != 2 or x.shape[0] != y.numel() or r.numel() != y.numel():
            raise ValueError(f"fit: x {tuple(x.shape)}, y [{y.numel()}] and rewards [{r.numel()}] must align")
        if bool(((y != 0) & (y != 1)).any()):
            raise ValueError("fit: y must hold 0/1 outcomes")
        n1 = int(y.sum())
        n0 = y.numel() - n1
        if n0 == 0 or n1 == 0:
            raise ValueError(f"fit: both outcomes are needed, got {n0} failures and {n1} successes")
        self.mean = x.mean(0)
        sd = x.std(0, unbiased=False)
        self.scale = torch.where(sd > 1e-12, sd, torch.ones_like(sd))
        z = torch.cat([torch.ones(x.shape[0], 1, dtype=torch.float64), (x - self.mean) / self.scale], 1)
        w = torch.zeros(z.shape[1], dtype=torch.float64)
        w[0] = math.log(n1 / n0)
        penalty = torch.full((z.shape[1],), self.l2, dtype=torch.float64)
        penalty[0] = 1e-8  # the intercept is (nearly) free
        for _ in range(self.max_iter):
            p = torch.sigmoid(z @ w)
            grad = z.T @ (p - y) + penalty * w
            hess = (z * (p * (1 - p)).unsqueeze(1)).T @ z + torch.diag(penalty)
            step = torch.linalg.solve(hess, grad)
            w = w - step
            if float(step.abs().max()) < 1e-8:
                break
        self.weights = w
        self.class_means = (float(r[y == 0].mean()), float(r[y == 1].mean()))
        self.examples = (n0, n1)
        self.version += 1
        return self

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """[R] float64 P(success) of each row of ``x`` [R, F] (the fitted column layout)."""
        if self.weights is None or self.mean is None or self.scale is None:
            raise RuntimeError("PrefixPredictor.predict before fit: check .fitted first")
        x = x.detach().to("cpu", torch.float64)
        if x.dim() != 2 or x.shape[1] != self.mean.numel():
            raise ValueError(f"predict: x must be [R, {self.mean.numel()}], got {tuple(x.shape)}")
        return torch.sigmoid(self.weights[0] + ((x - self.mean) / self.scale) @ self.weights[1:])

    def state_dict(self) -> dict:
        return {"l2": self.l2, "max_iter": self.max_iter, "weights": self.weights, "mean": self.mean,
                "scale": self.scale, "class_means": self.class_means, "examples": self.examples,
                "version": self.version}

    def load_state_dict(self, state: dict) -> None:
        self.l2, self.max_iter = float(state["l2"]), int(state["max_iter"])
        self.weights, self.mean, self.scale = state["weights"], state["mean"], state["scale"]
        r0, r1 = state["class_means"]
        self.class_means = (float(r0), float(r1))
        n0, n1 = state["examples"]
        self.examples = (int(n0), int(n1))
        self.version = int(state["version"])


class StopHistory:
    """The predictor's training data: the boundary features of finished completions and their
    outcomes, kept for the last ``keep_steps`` steps. A step's examples are added after its
    decisions were made (``add``), and ``refit`` fits the predictor the next step uses on what
    is here: the current step's rewards never reach its own decisions.

    Each step holds x [E, F] float64 (one row per boundary a finished completion was scored at),
    y [E] 0/1, r [E] rewards, and the counts of finished completions of each outcome."""

    def __init__(self, keep_steps: int) -> None:
        self.keep_steps = check_int("keep_steps", keep_steps, minimum=1)
        self.steps: list[dict] = []

    def add(self, step: int, x: torch.Tensor, y: torch.Tensor, r: torch.Tensor, completions: tuple[int, int]) -> None:
        """File step ``step``'s examples (``completions``: finished failures, successes); keep the
        last ``keep_steps`` steps. Steps must come in increasing order."""
        check_int("step", step, minimum=0)
        if self.steps and step <= self.steps[-1]["step"]:
            raise ValueError(f"StopHistory.add: step {step} after step {self.steps[-1]['step']}; steps must increase")
        x = x.detach().to("cpu", torch.float64)
        if x.dim() != 2 or x.shape[0] != y.numel() or r.numel() != y.numel():
            raise ValueError(f"StopHistory.add: x {tuple(x.shape)}, y [{y.numel()}], r [{r.numel()}] must align")
        if self.steps and x.shape[0] and self.steps[0]["x"].shape[0] and x.shape[1] != self.steps[0]["x"].shape[1]:
            raise ValueError(f"StopHistory.add: {x.shape[1]} feature columns, the history has "
                             f"{self.steps[0]['x'].shape[1]}")
        self.steps.append({"step": int(step), "x": x, "y": y.detach().to("cpu", torch.float64),
                           "r": r.detach().to("cpu", torch.float64), "completions": tuple(int(c) for c in completions)})
        del self.steps[: -self.keep_steps]

    def completions(self) -> tuple[int, int]:
        """(failures, successes): finished completions in the history."""
        return (sum(s["completions"][0] for s in self.steps), sum(s["completions"][1] for s in self.steps))

    def refit(self, predictor: PrefixPredictor, min_examples: int) -> bool:
        """Fit ``predictor`` on every example here when both outcomes have at least
        ``min_examples`` completions and some of them reached a boundary; True when it is ready to
        decide. (Completions that all end before the first boundary count, but give no features.)"""
        n0, n1 = self.completions()
        scored = [s for s in self.steps if s["x"].numel()]
        if min(n0, n1) < min_examples or not scored:
            return False
        x = torch.cat([s["x"] for s in scored])
        y = torch.cat([s["y"] for s in scored])
        r = torch.cat([s["r"] for s in scored])
        predictor.fit(x, y, r)
        return True

    def state_dict(self) -> dict:
        return {"keep_steps": self.keep_steps, "steps": [dict(s) for s in self.steps]}

    def load_state_dict(self, state: dict) -> None:
        self.keep_steps = int(state["keep_steps"])
        self.steps = [dict(s) for s in state["steps"]]


# ---------------------------------------------------------------------------------- the rule
def explore_groups(num_groups: int, share: float, *, seed: int, step: int, round_: int = 0) -> torch.Tensor:
    """[M] bool, the groups of a round generated in full: floor(share M + u) of them (u uniform,
    so the count is share M on average), chosen at random; seeded by (seed, step, round)."""
    check_int("num_groups", num_groups, minimum=0)
    share = check_float("share", share, minimum=0.0)
    if share > 1:
        raise ValueError(f"share must be in [0, 1], got {share}")
    gen = seeded_generator(seed, step, stream=EXPLORE_STREAM + 1000 * check_int("round_", round_, minimum=0))
    u = float(torch.rand((), generator=gen, dtype=torch.float64))
    count = min(num_groups, math.floor(share * num_groups + u))
    out = torch.zeros(num_groups, dtype=torch.bool)
    out[torch.randperm(num_groups, generator=gen)[:count]] = True
    return out


@dataclass(frozen=True)
class StopDecision:
    """One boundary's decision over R rows.

    stop: [R] bool, running rows to stop now. majority: [R] float64, each row's probability of
    ending in its group's majority outcome (0 where the group has none). expected_share: [R]
    float64, the group's expected success share (mean q over its members)."""

    stop: torch.Tensor
    majority: torch.Tensor
    expected_share: torch.Tensor

    @property
    def num_stopped(self) -> int:
        return int(self.stop.sum())


def decide_stops(q: torch.Tensor, group_ids: torch.Tensor, status: torch.Tensor, *, min_running: int,
                 min_confidence: float, active: torch.Tensor | None = None, seed: int = 0, step: int = 0,
                 stream: int = 0) -> StopDecision:
    """Which running completions to stop at a boundary.

    Per group: its expected success share m = mean q over ALL its members (running, finished,
    and stopped with their last q); the minority outcome is success when m < 1/2, failure when
    m > 1/2 (none at m = 1/2: nothing is stopped). A running member's majority probability is
    1 - q (minority success) or q (minority failure); members with at least ``min_confidence``
    are candidates, the most certain first (ties by a seeded order), and as many are stopped as
    leave ``min_running`` members running or finished.

    Args:
        q: [R] float P(success) of every member (stopped ones: the q they were stopped with).
        group_ids: [R] int64.
        status: [R] int ``RUNNING`` / ``FINISHED`` / ``STOPPED``.
        min_running: >= 1 members of each group that run to their end.
        min_confidence: in [0.5, 1).
        active: [R] bool, rows whose group may stop now (False: an explore group, or no
            predictor yet); None: all.
        seed, step, stream: the tie-break order (identical on every rank and across restarts).

    Returns:
        a ``StopDecision``.
    """
    qq = as_1d_float("q", q, allow_empty=True).to(torch.float64)
    R = qq.numel()
    g = as_group_ids("group_ids", group_ids, R)
    st = torch.as_tensor(status).to(torch.int64)
    if st.shape != (R,) or bool(((st < RUNNING) | (st > STOPPED)).any()):
        raise ValueError(f"status must be [{R}] of RUNNING/FINISHED/STOPPED, got {st.tolist()}")
    check_int("min_running", min_running, minimum=1)
    if not 0.5 <= check_float("min_confidence", min_confidence) < 1:
        raise ValueError(f"min_confidence must be in [0.5, 1), got {min_confidence}")
    act = torch.ones(R, dtype=torch.bool) if active is None else torch.as_tensor(active, dtype=torch.bool)
    share = _group_mean(qq, g) if R else qq
    minority_success, minority_failure = share < 0.5 - SHARE_TIE, share > 0.5 + SHARE_TIE
    majority = torch.where(minority_success, 1 - qq, torch.where(minority_failure, qq, torch.zeros_like(qq)))
    candidate = (st == RUNNING) & act & (majority >= min_confidence) & (minority_success | minority_failure)
    stop = torch.zeros(R, dtype=torch.bool)
    if bool(candidate.any()):
        _, inv = torch.unique(g, return_inverse=True)
        alive = torch.zeros(int(inv.max()) + 1, dtype=torch.int64).index_add_(0, inv, (st != STOPPED).to(torch.int64))
        allowed = (alive - min_running).clamp_min(0)
        perm = torch.randperm(R, generator=seeded_generator(seed, step, stream=STOP_STREAM + stream))
        # most certain first, ties in the seeded order; then rank within each group
        order = perm[torch.sort(torch.where(candidate, majority, -1.0)[perm], descending=True, stable=True).indices]
        order = order[candidate[order]]
        order = order[torch.sort(inv[order], stable=True).indices]
        firsts = torch.zeros_like(allowed).index_add_(0, inv[order], torch.ones_like(order))
        start = torch.cumsum(firsts, 0) - firsts
        rank = torch.arange(order.numel()) - start[inv[order]]
        stop[order[rank < allowed[inv[order]]]] = True
    return StopDecision(stop=stop, majority=majority, expected_share=share)


def explore_group(key: str, share: float, *, seed: int, step: int) -> bool:
    """Whether the group named ``key`` (a host's prompt uid) is generated in full: a uniform
    drawn from (seed, step, key) alone is below ``share`` (for hosts that decide group by group)."""
    import hashlib

    share = check_float("share", share, minimum=0.0)
    digest = hashlib.sha256(f"{seed}:{step}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < share


@dataclass(frozen=True)
class BoundaryOutcome:
    """One boundary of ``decide_at_boundary`` over R rows (every member of the groups deciding).

    present: [R] bool, rows not stopped before (the ones with features). x: [P, F] float64 their
    features (P = present rows). q: [P] float64 their scores, or None without a predictor.
    stop: [R] bool rows to stop now. shadow: [R] bool explore rows the rule would have stopped now.
    status: [R] the statuses the rule saw (explore rows shadow-stopped earlier count as stopped)."""

    present: torch.Tensor
    x: torch.Tensor
    q: torch.Tensor | None
    stop: torch.Tensor
    shadow: torch.Tensor
    status: torch.Tensor


def decide_at_boundary(predictor: Scorer | None, *, logprobs: torch.Tensor, lengths: torch.Tensor,
                       status: torch.Tensor, group_ids: torch.Tensor, explore: torch.Tensor, q_last: torch.Tensor,
                       shadowed: torch.Tensor, segment_tokens: int, max_new_tokens: int, min_running: int,
                       min_confidence: float, seed: int, step: int, stream: int,
                       entropies: torch.Tensor | None = None, hidden: torch.Tensor | None = None) -> BoundaryOutcome:
    """One boundary: features of the present rows, their scores, the rule; explore rows are never
    stopped (their would-be stops come back as ``shadow``). ``q_last`` [R] float64 is updated in
    place with the new scores (stopped rows keep the q they were stopped with).

    Args (all [R], row-aligned, every member of each deciding group): logprobs [R, T], lengths,
    status (RUNNING / FINISHED / STOPPED), group_ids, explore (bool: the row's group runs in
    full), q_last, shadowed (bool: explore rows the rule stopped at an earlier boundary);
    ``predictor``: None (or unfitted) scores nothing and stops nothing; entropies [R, T] and
    hidden [R, D] when the feature set has them.
    """
    present = torch.as_tensor(status) != STOPPED
    x = prefix_features(logprobs[present], lengths[present], group_ids[present],
                        torch.as_tensor(status)[present] == FINISHED, segment_tokens=segment_tokens,
                        max_new_tokens=max_new_tokens, entropies=None if entropies is None else entropies[present],
                        hidden=None if hidden is None else hidden[present])
    R = present.numel()
    seen = torch.as_tensor(status).clone()
    if predictor is None or not predictor.fitted:
        none = torch.zeros(R, dtype=torch.bool)
        return BoundaryOutcome(present=present, x=x, q=None, stop=none, shadow=none.clone(), status=seen)
    q = predictor.predict(x)
    q_last[present] = q
    seen[shadowed & (seen == RUNNING)] = STOPPED
    d = decide_stops(q_last, group_ids, seen, min_running=min_running, min_confidence=min_confidence, seed=seed,
                     step=step, stream=stream)
    return BoundaryOutcome(present=present, x=x, q=q, stop=d.stop & ~explore, shadow=d.stop & explore, status=seen)


@dataclass(frozen=True)
class Replay:
    """``replay_early_stop``'s result over N rows: stopped [N] bool, stopped_at [N] int64 (-1: ran
    to its end), q_last [N] float64 (NaN: never scored), examples: (x [E, F], row [E] int64) the
    features of every row at every boundary it was present at."""

    stopped: torch.Tensor
    stopped_at: torch.Tensor
    q_last: torch.Tensor
    examples: tuple[torch.Tensor, torch.Tensor]


class _Known:
    """A predictor whose scores are given per row (an oracle, a planted test score): ``rows`` must be
    set to the present rows before each ``predict``."""

    @property
    def fitted(self) -> bool:
        return True

    def __init__(self, q: torch.Tensor) -> None:
        self.q = torch.as_tensor(q, dtype=torch.float64)
        self.rows = torch.zeros(0, dtype=torch.int64)

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        return self.q[self.rows]


def replay_early_stop(predictor: PrefixPredictor | None, logprobs: torch.Tensor, lengths: torch.Tensor,
                      ended: torch.Tensor, group_ids: torch.Tensor, *, cfg, group_size: int, keep: int,
                      max_new_tokens: int, seed: int = 0, step: int = 0, explore: torch.Tensor | None = None,
                      known_q: torch.Tensor | None = None) -> Replay:
    """The stops an engine would have made, boundary by boundary, on completions generated in full
    (a completion's prefix does not depend on its group's stops, so the decisions are the engine's).

    Args:
        predictor: the predictor (None or unfitted: features only, nothing stops).
        logprobs: [N, T] float sampled-token log-probs; lengths: [N] int64 full lengths; ended: [N]
            bool, the completion ended by EOS (False: it hit ``max_new_tokens``).
        group_ids: [N] int64; cfg: the ``EarlyStopConfig``; group_size, keep: G and CPPO's k
            (``min_running_for``); explore: [N] bool rows of explore groups (default none).
        known_q: [N] float scores given per row instead of the predictor's (an oracle that knows the
            outcome: the upper bound of early stopping).
    """
    N = int(lengths.numel())
    n = torch.as_tensor(lengths, dtype=torch.int64)
    g = as_group_ids("group_ids", group_ids, N)
    stopped_at = torch.full((N,), -1, dtype=torch.int64)
    q_last = torch.full((N,), float("nan"), dtype=torch.float64)
    shadowed = torch.zeros(N, dtype=torch.bool)
    ex = torch.zeros(N, dtype=torch.bool) if explore is None else torch.as_tensor(explore, dtype=torch.bool)
    min_running = cfg.min_running_for(group_size, keep)
    known = None if known_q is None else _Known(known_q)
    xs, rows = [], []
    for b, t in enumerate(range(cfg.segment_tokens, max_new_tokens, cfg.segment_tokens)):
        status = torch.where(stopped_at >= 0, STOPPED, torch.where(ended & (n <= t) | (n < t), FINISHED, RUNNING))
        if not bool((status == RUNNING).any()):
            break
        if known is not None:
            known.rows = (status != STOPPED).nonzero().squeeze(1)
        scorer = known if known is not None else predictor
        out = decide_at_boundary(scorer, logprobs=logprobs, lengths=torch.minimum(n, torch.tensor(t)),
                                 status=status, group_ids=g, explore=ex, q_last=q_last, shadowed=shadowed,
                                 segment_tokens=cfg.segment_tokens, max_new_tokens=max_new_tokens,
                                 min_running=min_running, min_confidence=cfg.min_confidence, seed=seed, step=step,
                                 stream=b)
        xs.append(out.x)
        rows.append(out.present.nonzero().squeeze(1))
        shadowed |= out.shadow
        stopped_at[out.stop] = t
    x = torch.cat(xs) if xs else torch.zeros(0, 0, dtype=torch.float64)
    r = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)
    return Replay(stopped=stopped_at >= 0, stopped_at=stopped_at, q_last=q_last, examples=(x, r))


# ---------------------------------------------------------------------------------- estimator
def imputed_moments(q: torch.Tensor, class_means: tuple[float, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """A stopped completion's expected reward and expected squared reward: ([R], [R]) float64,
    mu = q r1 + (1 - q) r0 and q r1^2 + (1 - q) r0^2, with (r0, r1) = ``class_means`` (mean
    reward of failures and successes)."""
    qq = as_1d_float("q", q, allow_empty=True).to(torch.float64)
    r0, r1 = (float(c) for c in class_means)
    return qq * r1 + (1 - qq) * r0, qq * r1 * r1 + (1 - qq) * r0 * r0


@dataclass(frozen=True)
class EarlyStopPrune:
    """The CPPO decision of a batch whose stopped completions have no reward.

    advantages: [N] float64 (0 for stopped rows, which are never trained). stats: the group
    statistics the advantages use (imputed or finished-only). selection: a ``Selection`` over all
    N rows: ``kept`` among the finished rows, ``pruned`` = the other finished rows + the stopped
    ones. stopped: [S] int64 ascending. pruned_after: [P] int64 ascending, finished rows CPPO
    pruned after generation."""

    advantages: torch.Tensor
    stats: GroupStats
    selection: Selection
    stopped: torch.Tensor
    pruned_after: torch.Tensor


def _imputed_stats(r: torch.Tensor, stopped: torch.Tensor, mu: torch.Tensor, sq: torch.Tensor,
                   g: torch.Tensor) -> GroupStats:
    uniq, inv = torch.unique(g, sorted=True, return_inverse=True)
    m = uniq.numel()
    one = torch.ones_like(r)
    size = torch.zeros(m, dtype=torch.float64).index_add_(0, inv, one)
    first = torch.where(stopped, mu, r)
    second = torch.where(stopped, sq, r * r)
    var_i = torch.where(stopped, (sq - mu * mu).clamp_min(0), torch.zeros_like(r))
    total = torch.zeros(m, dtype=torch.float64).index_add_(0, inv, first)
    squares = torch.zeros(m, dtype=torch.float64).index_add_(0, inv, second)
    spread = torch.zeros(m, dtype=torch.float64).index_add_(0, inv, var_i)
    mean = total / size
    ss = (squares - size * mean * mean - spread / size).clamp_min(0)
    std = torch.sqrt(ss / (size - 1).clamp_min(1))
    single = size < 2
    return GroupStats(group_ids=uniq, inverse=inv, size=size.to(torch.int64),
                      mean=torch.where(single, torch.zeros_like(mean), mean),
                      std=torch.where(single, torch.ones_like(std), std))


def early_stop_prune(rewards: torch.Tensor, stopped: torch.Tensor, group_ids: torch.Tensor, cfg: CPPOConfig, *,
                     expected: torch.Tensor | None = None, expected_sq: torch.Tensor | None = None,
                     step: int = 0) -> EarlyStopPrune:
    """Group statistics with stopped completions, then CPPO's selection over the finished ones.

    Args:
        rewards: [N] float; read for finished rows only (a stopped row's entry is ignored).
        stopped: [N] bool.
        group_ids: [N] int64 (uneven sizes allowed).
        cfg: the ``CPPOConfig`` (group scope, ``pruning_rate`` or ``keep_per_group``;
            ``early_stop.estimator``).
        expected, expected_sq: [N] float, a stopped row's expected reward and squared reward
            (``imputed_moments``); required by ``estimator=impute`` when a row is stopped.
        step: int >= 0, the seeded tie-breaks (as ``prune``).

    Returns:
        an ``EarlyStopPrune``. Each group keeps CPPO's k = keep_count(G) of its FULL size G among
        its finished rows (all of them when fewer finished).
    """
    check_config(cfg)
    stop = torch.as_tensor(stopped, dtype=torch.bool).cpu()
    N = stop.numel()
    raw = torch.as_tensor(rewards).detach().to("cpu", torch.float64)
    if raw.shape != (N,):
        raise ValueError(f"rewards must be [{N}] (one per row of stopped), got {tuple(raw.shape)}")
    r = as_1d_float("rewards of the finished rows", torch.where(stop, 0.0, raw))
    g = as_group_ids("group_ids", group_ids, N).cpu()
    es = cfg.early_stop
    if es.estimator == "impute" and bool(stop.any()):
        if expected is None or expected_sq is None:
            raise ValueError("estimator=impute needs expected and expected_sq for the stopped rows "
                             "(imputed_moments of their last predicted q)")
        mu = as_1d_float("expected", torch.where(stop, torch.as_tensor(expected, dtype=torch.float64), 0.0))
        sq = as_1d_float("expected_sq", torch.where(stop, torch.as_tensor(expected_sq, dtype=torch.float64), 0.0))
        stats = _imputed_stats(r, stop, mu, sq, g)
    elif bool(stop.any()):
        fin = ~stop
        _, fstats = group_advantages(r[fin], g[fin], adv_norm=cfg.adv_norm, eps=cfg.eps)
        stats = _finished_stats(g, fstats)
    else:
        _, stats = group_advantages(r, g, adv_norm=cfg.adv_norm, eps=cfg.eps)
    adv = r - stats.row_mean()
    if cfg.adv_norm == "std":
        adv = adv / (stats.row_std() + cfg.eps)
    adv = torch.where(stop, torch.zeros_like(adv), adv)
    selection = _select_finished(adv, g, stop, stats, cfg, step)
    kept_mask = selection.kept_mask()
    return EarlyStopPrune(advantages=adv, stats=stats, selection=selection, stopped=stop.nonzero().squeeze(1),
                          pruned_after=(~stop & ~kept_mask).nonzero().squeeze(1))


def _finished_stats(g: torch.Tensor, fstats: GroupStats) -> GroupStats:
    """Finished-only statistics laid out over every row's group (a group with no finished row
    cannot occur: min_running >= 1)."""
    uniq, inv = torch.unique(g, sorted=True, return_inverse=True)
    pos = torch.searchsorted(fstats.group_ids, uniq)
    if bool((pos >= fstats.group_ids.numel()).any()) or not torch.equal(fstats.group_ids[pos.clamp_max(
            max(fstats.group_ids.numel() - 1, 0))], uniq):
        raise ValueError("estimator=finished: a group has no finished completion (min_running must be >= 1)")
    size = torch.zeros(uniq.numel(), dtype=torch.int64).index_add_(0, inv, torch.ones_like(inv))
    return GroupStats(group_ids=uniq, inverse=inv, size=size, mean=fstats.mean[pos].to(torch.float64),
                      std=fstats.std[pos].to(torch.float64))


def _select_finished(adv: torch.Tensor, g: torch.Tensor, stop: torch.Tensor, stats: GroupStats,
                     cfg: CPPOConfig, step: int) -> Selection:
    """CPPO's selection among the finished rows, k from each group's full size; a ``Selection``
    over all N rows (stopped rows pruned)."""
    fin = (~stop).nonzero().squeeze(1)
    k_full = torch.tensor([keep_count(int(s), cfg.pruning_rate, cfg.keep_per_group) for s in stats.size.tolist()],
                          dtype=torch.int64)
    fin_count = torch.zeros_like(stats.size).index_add_(0, stats.inverse[fin], torch.ones_like(fin))
    k_group = torch.minimum(k_full, fin_count)
    kept_parts, weight_parts = [], []
    for k in sorted(set(k_group[fin_count > 0].tolist())):
        rows = fin[k_group[stats.inverse[fin]] == k]
        sub = select_completions(adv[rows], g[rows], replace(cfg, pruning_rate=None, keep_per_group=k), step=step)
        kept_parts.append(rows[sub.kept])
        assert sub.weights is not None
        weight_parts.append(sub.weights)
    N = adv.numel()
    weights = torch.ones(N, dtype=torch.float32)
    mask = torch.zeros(N, dtype=torch.bool)
    if kept_parts:
        kept_rows = torch.cat(kept_parts)
        mask[kept_rows] = True
        weights[kept_rows] = torch.cat(weight_parts)
    kept = mask.nonzero().squeeze(1)
    kept_per_group = torch.zeros_like(stats.size).index_add_(0, stats.inverse[kept], torch.ones_like(kept))
    return Selection(kept=kept, pruned=(~mask).nonzero().squeeze(1), group_ids=stats.group_ids,
                     group_size=stats.size, kept_per_group=kept_per_group, advantages=adv.to(torch.float32),
                     scope=cfg.scope, metric=cfg.metric, use_abs=cfg.use_abs,
                     weights=weights[kept] if cfg.metric == "importance" else None)


# ---------------------------------------------------------------------------------- accounting
def estimate_full_lengths(lengths: torch.Tensor, stopped: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """[N] float64, each row's estimated length had it run to its end: its own length when it
    finished; for a stopped row of length t, the mean length of its group's finished rows longer
    than t, else of the batch's finished rows longer than t, else t (no saving claimed)."""
    n = torch.as_tensor(lengths).to(torch.float64).cpu()
    stop = torch.as_tensor(stopped, dtype=torch.bool).cpu()
    g = as_group_ids("group_ids", group_ids, n.numel()).cpu()
    out = n.clone()
    fin = ~stop
    for i in stop.nonzero().squeeze(1).tolist():
        longer = fin & (n > n[i])
        same = longer & (g == g[i])
        pool = same if bool(same.any()) else longer
        if bool(pool.any()):
            out[i] = n[pool].mean()
    return out


@dataclass
class StopAccounting:
    """Where every completion started in a step went, and its tokens: kept, pruned after
    generation, or stopped early (``check`` raises when the counts do not add up)."""

    started: int = 0
    kept: int = 0
    pruned_after: int = 0
    stopped: int = 0
    tokens_generated: int = 0  # every token generated, stopped completions' prefixes included
    tokens_stopped: int = 0  # of which in the stopped completions
    tokens_budget: int = 0  # started x max_new_tokens: the most the step could have generated
    tokens_saved_estimate: float = 0.0  # estimate_full_lengths - lengths over the stopped rows
    extra: dict = field(default_factory=dict)

    def check(self) -> StopAccounting:
        if self.started != self.kept + self.pruned_after + self.stopped:
            raise RuntimeError(f"early stop accounting: {self.started} completions started but {self.kept} kept + "
                               f"{self.pruned_after} pruned + {self.stopped} stopped")
        if not 0 <= self.tokens_stopped <= self.tokens_generated <= max(self.tokens_budget, self.tokens_generated):
            raise RuntimeError(f"early stop accounting: tokens stopped {self.tokens_stopped} / generated "
                               f"{self.tokens_generated} / budget {self.tokens_budget} do not nest")
        return self

    def metrics(self, prefix: str = "early_stop/") -> dict[str, float]:
        n = max(self.started, 1)
        full = self.tokens_generated + self.tokens_saved_estimate
        out = {f"{prefix}started": float(self.started), f"{prefix}kept": float(self.kept),
               f"{prefix}pruned_after": float(self.pruned_after), f"{prefix}stopped": float(self.stopped),
               f"{prefix}stopped_share": self.stopped / n,
               f"{prefix}tokens_generated": float(self.tokens_generated),
               f"{prefix}tokens_stopped": float(self.tokens_stopped),
               f"{prefix}tokens_budget": float(self.tokens_budget),
               f"{prefix}tokens_saved_estimate": float(self.tokens_saved_estimate),
               f"{prefix}tokens_vs_budget": self.tokens_generated / self.tokens_budget if self.tokens_budget else 0.0,
               f"{prefix}tokens_vs_full_estimate": self.tokens_generated / full if full > 0 else 1.0}
        out.update({f"{prefix}{k}": float(v) for k, v in self.extra.items()})
        return out


def step_accounting(lengths: torch.Tensor, stopped: torch.Tensor, group_ids: torch.Tensor, kept: torch.Tensor,
                    max_new_tokens: int) -> tuple[StopAccounting, torch.Tensor]:
    """One step's ``StopAccounting`` (``check`` it once its ``extra`` is filled) and the [N] bool mask
    of the rows CPPO kept.

    lengths: [N] int tokens each completion generated (a stopped one's prefix); stopped: [N] bool;
    group_ids: [N] int64 each row's group; kept: [K] int64 the rows CPPO kept; max_new_tokens: the
    completion length limit (the budget is N x it). A stopped row among the kept is a RuntimeError:
    it has no reward to train on."""
    as_1d_float("lengths", lengths, allow_empty=True)  # checked; read exactly, as float64
    n = torch.as_tensor(lengths).to(torch.float64).cpu()
    stop = torch.as_tensor(stopped, dtype=torch.bool)
    N = n.numel()
    if stop.shape != (N,):
        raise ValueError(f"early stop accounting: stopped has shape {tuple(stop.shape)}, lengths {N} rows; "
                         "pass one flag per row")
    check_int("max_new_tokens", max_new_tokens, minimum=1)
    kept_mask = torch.zeros(N, dtype=torch.bool)
    kept_mask[torch.as_tensor(kept, dtype=torch.int64)] = True
    if bool((kept_mask & stop).any()):
        raise RuntimeError(f"early stop: a stopped completion was kept for training (rows "
                           f"{(kept_mask & stop).nonzero().squeeze(1).tolist()})")
    est = estimate_full_lengths(n, stop, group_ids)
    acc = StopAccounting(started=N, kept=int(kept_mask.sum()), pruned_after=int((~kept_mask & ~stop).sum()),
                         stopped=int(stop.sum()), tokens_generated=int(n.sum()), tokens_stopped=int(n[stop].sum()),
                         tokens_budget=N * int(max_new_tokens), tokens_saved_estimate=float((est - n)[stop].sum()))
    return acc, kept_mask


def shadow_wrong_stop_share(shadow: torch.Tensor, kept_mask: torch.Tensor) -> float:
    """The share of the explore rows the rule would have stopped (``shadow``, [N] bool) that CPPO then
    kept (``kept_mask``, [N] bool): the cost of the rule's mistakes; NaN without such rows."""
    sh, km = torch.as_tensor(shadow, dtype=torch.bool), torch.as_tensor(kept_mask, dtype=torch.bool)
    if sh.shape != km.shape:
        raise ValueError(f"shadow_wrong_stop_share: shadow {tuple(sh.shape)} and kept_mask {tuple(km.shape)} "
                         "differ; pass one flag per row for both")
    return float((sh & km).sum()) / float(sh.sum()) if bool(sh.any()) else float("nan")


# ---------------------------------------------------------------------------------- quality
def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve of ``scores`` [E] for 0/1 ``labels`` [E] (ties count one half);
    NaN when one outcome is absent."""
    s = as_1d_float("scores", scores, allow_empty=True).to(torch.float64)
    y = torch.as_tensor(labels).to(torch.float64).cpu()
    if y.shape != s.shape:
        raise ValueError(f"scores [{s.numel()}] and labels {tuple(y.shape)} must align")
    n1 = int((y == 1).sum())
    n0 = int((y == 0).sum())
    if n0 == 0 or n1 == 0:
        return float("nan")
    order = torch.argsort(s)
    ranks = torch.empty_like(s)
    sorted_s = s[order]
    uniq, inv, counts = torch.unique_consecutive(sorted_s, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).to(torch.float64)
    avg = ends - (counts.to(torch.float64) - 1) / 2  # average 1-based rank of each tie block
    ranks[order] = avg[inv]
    return float((ranks[y == 1].sum() - n1 * (n1 + 1) / 2) / (n0 * n1))


def quality_metrics(scores: torch.Tensor, labels: torch.Tensor, prefix: str) -> dict[str, float]:
    """``{prefix}auc``, ``brier``, ``ece`` and ``pairs`` of predicted success probabilities
    ``scores`` [E] against 0/1 outcomes ``labels`` [E] (NaN where undefined)."""
    brier, ece = calibration(scores, labels)
    return {f"{prefix}auc": roc_auc(scores, labels), f"{prefix}brier": brier, f"{prefix}ece": ece,
            f"{prefix}pairs": float(torch.as_tensor(scores).numel())}


def calibration(scores: torch.Tensor, labels: torch.Tensor, bins: int = 10) -> tuple[float, float]:
    """(Brier score, expected calibration error over ``bins`` equal-width bins) of predicted
    probabilities ``scores`` [E] against 0/1 ``labels``; (NaN, NaN) when E = 0."""
    s = as_1d_float("scores", scores, allow_empty=True).to(torch.float64)
    y = torch.as_tensor(labels).to(torch.float64).cpu()
    check_int("bins", bins, minimum=1)
    if s.numel() == 0:
        return float("nan"), float("nan")
    brier = float(((s - y) ** 2).mean())
    which = (s * bins).floor().clamp(0, bins - 1).to(torch.int64)
    ece = 0.0
    for b in range(bins):
        m = which == b
        if bool(m.any()):
            ece += float(m.sum()) / s.numel() * abs(float(s[m].mean()) - float(y[m].mean()))
    return brier, ece


def learner_state(predictor: PrefixPredictor, history: StopHistory, ready: bool, totals: dict[str, float]
                  ) -> dict[str, Any]:
    """What a checkpoint keeps of a run's early stopping: the predictor, its history, whether it
    may stop yet, and the run totals (``RUN_TOTALS``). Every host saves this one dict."""
    return {"predictor": predictor.state_dict(), "history": history.state_dict(), "ready": ready,
            "totals": dict(totals)}


def restore_learner_state(state: dict[str, Any], predictor: PrefixPredictor, history: StopHistory, *,
                          missing: str) -> tuple[bool, dict[str, float]]:
    """Load ``learner_state``'s dict into ``predictor`` and ``history``; return (ready, totals).
    A key not there is a ValueError ``"{missing}".format(key=...)`` (the host's own words)."""
    for key in ("predictor", "history", "ready", "totals"):
        if key not in state:
            raise ValueError(missing.format(key=repr(key)))
    predictor.load_state_dict(state["predictor"])
    history.load_state_dict(state["history"])
    return bool(state["ready"]), {k: float(state["totals"].get(k, 0.0)) for k in RUN_TOTALS}


class StopLearner:
    """What one run's early stopping carries from step to step, on every host: the predictor, its
    history, whether it may stop yet (``ready``) and the run totals (``RUN_TOTALS``); with the
    settings each step reads (``es``: the ``early_stop`` section, ``min_running`` members of a
    group that run to the end, G and the length limit).

    Args:
        cfg: the run's ``CPPOConfig`` (``early_stop`` section; its kept count k sets ``min_running``).
        group_size: G, completions per prompt.
        max_new_tokens: the completion length limit.
    """

    # the checkpoint error for a missing key (``{key}``); a host words its own
    missing = "early stop state: {key} missing from the checkpoint"

    def __init__(self, cfg: CPPOConfig, *, group_size: int, max_new_tokens: int) -> None:
        self.cfg, self.es = cfg, cfg.early_stop
        self.group_size, self.max_new_tokens = int(group_size), int(max_new_tokens)
        self.min_running = self.es.min_running_for(self.group_size, cfg.keep_for_group(self.group_size))
        self.predictor = PrefixPredictor(self.es.l2)
        self.history = StopHistory(self.es.history_steps)
        self.ready = False
        self.totals = dict.fromkeys(RUN_TOTALS, 0.0)

    def add_totals(self, acc: StopAccounting) -> dict[str, float]:
        """Add a step's accounting to the run totals; their ``early_stop/total_*`` metrics."""
        out = {}
        for key in RUN_TOTALS:
            self.totals[key] += float(getattr(acc, key))
            out[f"early_stop/total_{key}"] = self.totals[key]
        return out

    def state_dict(self) -> dict[str, Any]:
        return learner_state(self.predictor, self.history, self.ready, self.totals)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``; a missing key is a ValueError in ``missing``'s words."""
        self.ready, self.totals = restore_learner_state(state, self.predictor, self.history, missing=self.missing)
