"""Early stopping, the trainer side both hosts share: one step's accounting, quality and history.

A host's rollout hands each completion's record back with its row (veRL: ``extra_fields``; OpenRLHF:
an attribute of the rollout sample), as ``GroupCoordinator.info`` wrote it: stopped or not, at which
boundary, its last score, whether its group explored, and its features at every boundary with the
score it got there. ``GroupStopLearner.account_step`` turns a step's rows into the ``early_stop/*``
metrics (``core.step_accounting``; the predictor's quality on the explore groups, measured with the
predictor that decided the step), files the finished rows in the predictor's history with their
outcomes and refits it for the next step. The step's own rewards reach the predictor only here,
after every decision of the step was made.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.early_stop import (
    StopLearner,
    imputed_moments,
    quality_metrics,
    shadow_wrong_stop_share,
    step_accounting,
)

__all__ = ["GroupStopLearner"]


class GroupStopLearner(StopLearner):
    """Predictor, history and totals of one run (``core.StopLearner``) fed from per-row records."""

    def moments(self, infos: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's expected reward and squared reward ([N], [N] float64) under the predictor that
        decided the step (rows never scored: q = 1/2)."""
        q = torch.tensor([float("nan") if i["q"] is None else float(i["q"]) for i in infos], dtype=torch.float64)
        # the class means of the predictor that decided: it is refitted only in account_step
        return imputed_moments(torch.nan_to_num(q, nan=0.5), self.predictor.class_means)

    def account_step(self, step: int, uids: list[str], rewards: torch.Tensor, lengths: torch.Tensor,
                     infos: list[dict], kept: torch.Tensor) -> tuple[dict[str, float], dict[str, Any]]:
        """(the step's ``early_stop/*`` metrics, its audit record); then the finished rows join the
        history and the predictor is refitted (``ready``) for step ``step + 1``.

        uids: [N] each row's group key; rewards: [N] float (stopped rows' entries are not read);
        lengths: [N] int tokens generated; infos: [N] per-row records; kept: [K] int64 rows CPPO kept."""
        stopped = torch.tensor([bool(i["stopped"]) for i in infos], dtype=torch.bool)
        y = (rewards.to(torch.float64) >= self.es.success_threshold).to(torch.float64)
        first: dict[str, int] = {}
        gids = torch.tensor([first.setdefault(u, len(first)) for u in uids], dtype=torch.int64)
        acc, kept_mask = step_accounting(lengths, stopped, gids, kept, self.max_new_tokens)
        acc.extra.update(self._quality(infos, y, stopped))
        mu, _ = self.moments(infos)
        shadow = torch.tensor([bool(i.get("shadow")) for i in infos], dtype=torch.bool)
        acc.extra.update({
            "predictor_ready": float(self.ready), "predictor_version": float(self.predictor.version),
            "min_running": float(self.min_running), "shadow_stopped": float(shadow.sum()),
            "shadow_wrong_stop_share": shadow_wrong_stop_share(shadow, kept_mask),
            "degraded_groups": float(len({u for u, i in zip(uids, infos, strict=True) if i.get("degraded")})),
            "reward_mean_estimate": float(torch.where(stopped, mu, rewards.to(torch.float64)).mean()),
        })
        metrics = acc.check().metrics()
        metrics.update(self.add_totals(acc))
        record = {"step": step, "uids": uids, "stopped": stopped.nonzero().squeeze(1).tolist(),
                  "stopped_at": [int(i["stopped_at"]) for i in infos], "q": [i["q"] for i in infos],
                  "kept": kept.tolist(), "explore": [bool(i["explore"]) for i in infos],
                  "ready": acc.extra["predictor_ready"], "version": acc.extra["predictor_version"],
                  "lengths": lengths.tolist()}
        self._file(step, infos, y, rewards, stopped)
        self.ready = self.history.refit(self.predictor, self.es.min_examples)
        return metrics, record

    def _quality(self, infos: list[dict], y: torch.Tensor, stopped: torch.Tensor) -> dict[str, float]:
        pairs: dict[str, tuple[list, list]] = {"predictor_": ([], []), "predictor_first_": ([], []),
                                               "predictor_all_": ([], [])}
        for i, info in enumerate(infos):
            if stopped[i]:
                continue
            scored = [q for _b, _x, q in info["records"] if q is not None]
            for j, q in enumerate(scored):
                names = ["predictor_all_"] + (["predictor_"] + (["predictor_first_"] if j == 0 else [])
                                              if info["explore"] else [])
                for name in names:
                    pairs[name][0].append(q)
                    pairs[name][1].append(float(y[i]))
        out: dict[str, float] = {"predictor_auc": float("nan")}
        for name, (qs, ys) in pairs.items():
            if qs:
                out.update(quality_metrics(torch.tensor(qs, dtype=torch.float64), torch.tensor(ys), name))
        return out

    def _file(self, step: int, infos: list[dict], y: torch.Tensor, rewards: torch.Tensor,
              stopped: torch.Tensor) -> None:
        xs, ys, rs = [], [], []
        for i, info in enumerate(infos):
            if stopped[i]:
                continue
            for _b, x, _q in info["records"]:
                xs.append(x)
                ys.append(float(y[i]))
                rs.append(float(rewards[i]))
        fin = ~stopped
        counts = (int((y[fin] == 0).sum()), int((y[fin] == 1).sum()))
        x = torch.tensor(xs, dtype=torch.float64) if xs else torch.zeros(0, 0, dtype=torch.float64)
        self.history.add(step, x, torch.tensor(ys, dtype=torch.float64), torch.tensor(rs, dtype=torch.float64), counts)
