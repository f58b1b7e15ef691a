"""Early stopping in the embedded trainer (``cppo.early_stop``; docs/early_stopping.md).

``EarlyStopping`` holds what persists across steps (the predictor, its history of finished
completions, running totals) and gives each generation round a ``RoundMonitor``, the
``rollout.base.StopMonitor`` the engine (HF in segments, vLLM stepped) calls at every boundary:

    monitor(round_, num_groups)  features of every present completion (``core.prefix_features``),
                                 the predictor's P(success), the stop rule (``core.decide_stops``)
                                 on all but the explore groups; it records what it saw and did
    moments()                    a stopped completion's expected reward and squared reward, for the
                                 estimator (``core.early_stop_prune``, in ``step.select_survivors``)
    end_step(batch, survivors)   the step's ``early_stop/*`` metrics (accounting; predictor quality
                                 measured with the predictor that made the step's decisions) and its
                                 audit line (``early_stop.jsonl`` in the run directory), then the
                                 step's finished completions join the history and the predictor is
                                 refitted for the next step

The predictor a step decides with was fitted at the end of the previous step: the step's own
rewards exist only after its generation, and reach the predictor only after its metrics.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..core.early_stop import (
    StopLearner,
    decide_at_boundary,
    explore_groups,
    imputed_moments,
    quality_metrics,
    shadow_wrong_stop_share,
    step_accounting,
)
from ..core.settings import CPPOConfig
from ..rollout.base import BoundaryView

__all__ = ["STATE_KEY", "EarlyStopping", "RoundMonitor"]

STATE_KEY = "early_stop"  # its entry in trainer.pt


class RoundMonitor:
    """The ``StopMonitor`` of one generation round of ``num_groups`` groups (rows prompt-major)."""

    def __init__(self, owner: EarlyStopping, *, step: int, round_: int, num_groups: int) -> None:
        es = owner.es
        self.owner, self.step, self.round = owner, step, round_
        self.segment_tokens = es.segment_tokens
        self.entropies = es.features in ("entropy", "hidden")
        self.hidden = es.features == "hidden"
        self.G = owner.group_size
        self.N = num_groups * self.G
        self.explore = explore_groups(num_groups, es.explore_share, seed=owner.cfg.seed, step=step, round_=round_)
        self.ready = owner.ready  # decided once per step: the predictor does not change within it
        self.q_last = torch.full((self.N,), float("nan"), dtype=torch.float64)
        self.shadow = torch.zeros(self.N, dtype=torch.bool)  # explore rows the rule would have stopped
        self.stopped_at = torch.full((self.N,), -1, dtype=torch.int64)
        self.records: list[dict[str, Any]] = []  # per boundary: rows, features, scores
        self.boundaries = 0

    def on_boundary(self, tokens: int, view: BoundaryView) -> torch.Tensor:
        es = self.owner.es
        rows = view.rows
        q_last = self.q_last[rows]
        out = decide_at_boundary(
            self.owner.predictor if self.ready else None, logprobs=view.logprobs, lengths=view.lengths,
            status=view.status, group_ids=rows // self.G, explore=self.explore[rows // self.G], q_last=q_last,
            shadowed=self.shadow[rows], segment_tokens=es.segment_tokens, max_new_tokens=self.owner.max_new_tokens,
            min_running=self.owner.min_running, min_confidence=es.min_confidence, seed=self.owner.cfg.seed,
            step=self.step, stream=1000 * self.round + self.boundaries, entropies=view.entropies, hidden=view.hidden)
        self.q_last[rows] = q_last
        self.shadow[rows[out.shadow]] = True
        self.stopped_at[rows[out.stop]] = tokens
        record: dict[str, Any] = {"boundary": tokens, "rows": rows[out.present].clone(), "x": out.x, "q": out.q}
        if out.q is not None:  # what the rule saw and decided (audit, tests): every member, stopped ones too
            record.update(decided_rows=rows.clone(), decided_q=q_last.clone(), decided_status=out.status,
                          stop=out.stop.clone(), explore=self.explore[rows // self.G])
        self.records.append(record)
        self.boundaries += 1
        return out.stop


class EarlyStopping(StopLearner):
    """Predictor, history and totals of one run (``core.StopLearner``), and the monitors of the step
    in progress.

    Args:
        cfg: the run's ``CPPOConfig`` (``early_stop`` section enabled; ``seed``; its kept count k).
        group_size: G, completions per prompt.
        max_new_tokens: the completion length limit.
    """

    def __init__(self, cfg: CPPOConfig, *, group_size: int, max_new_tokens: int,
                 audit_path: str | Path | None = None) -> None:
        if not cfg.early_stop.enabled:
            raise ValueError("EarlyStopping needs cppo.early_stop.enabled=true")
        super().__init__(cfg, group_size=group_size, max_new_tokens=max_new_tokens)
        self.step = -1
        self.monitors: list[RoundMonitor] = []
        self.audit_path = None if audit_path is None else Path(audit_path)

    def begin_step(self, step: int) -> None:
        self.step = step
        self.monitors = []

    def monitor(self, round_: int, num_groups: int) -> RoundMonitor:
        """The monitor of the step's round ``round_`` (its rows follow the earlier rounds' in the batch)."""
        m = RoundMonitor(self, step=self.step, round_=round_, num_groups=num_groups)
        self.monitors.append(m)
        return m

    def _cat(self, name: str) -> torch.Tensor:
        return torch.cat([getattr(m, name) for m in self.monitors]) if self.monitors else torch.zeros(0)

    def moments(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[N] expected reward and [N] expected squared reward of every row of the step (read for
        the stopped ones): ``core.imputed_moments`` of their last q and the predictor's class means."""
        q = self._cat("q_last")
        return imputed_moments(torch.nan_to_num(q, nan=0.5), self.predictor.class_means)

    def end_step(self, batch: Any, kept: torch.Tensor) -> dict[str, float]:
        """The step's ``early_stop/*`` metrics, then its finished completions go into the history
        and the predictor is refitted (the next step decides with it).

        batch: the step's ``RolloutBatch`` (``stopped``, ``rewards``, ``completion_lengths``);
        kept: [K] int64 rows CPPO kept."""
        N = batch.num_rows
        if sum(m.N for m in self.monitors) != N:
            raise RuntimeError(f"early stop: the step's monitors cover {sum(m.N for m in self.monitors)} rows, the "
                               f"batch has {N}")
        y = (batch.rewards >= self.es.success_threshold).to(torch.float64)
        # measured with the predictor that decided; only then do the step's rewards teach it
        metrics = self._step_metrics(batch, kept, y)
        self.history.add(self.step, *self._examples(y, batch.rewards.to(torch.float64), batch.stopped))
        self.ready = self.history.refit(self.predictor, self.es.min_examples)
        return metrics

    def _step_metrics(self, batch: Any, kept: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        """``early_stop/*``: accounting, predictor quality, totals; the audit line."""
        stopped = batch.stopped
        quality = self._quality(y, stopped)
        shadow = self._cat("shadow").to(torch.bool)
        acc, kept_mask = step_accounting(batch.completion_lengths, stopped, batch.group_ids, kept, self.max_new_tokens)
        acc.extra.update(quality)
        mu, _ = self.moments()
        fin = ~stopped
        at = self._cat("stopped_at").to(torch.float64)
        acc.extra.update({
            "predictor_ready": float(self.ready), "predictor_version": float(self.predictor.version),
            "history_failures": float(self.history.completions()[0]),
            "history_successes": float(self.history.completions()[1]),
            "min_running": float(self.min_running), "explore_groups": float(self._cat("explore").sum()),
            "shadow_stopped": float(shadow.sum()),
            "shadow_wrong_stop_share": shadow_wrong_stop_share(shadow, kept_mask),
            "stop_tokens_mean": float(at[stopped].mean()) if stopped.any() else float("nan"),
            "reward_mean_estimate": float(torch.where(fin, batch.rewards.to(torch.float64), mu).mean()),
        })
        metrics = acc.check().metrics()
        metrics.update(self.add_totals(acc))
        if self.audit_path is not None:
            self._audit(self.audit_path, batch, kept, stopped, shadow)
        return metrics

    def _audit(self, path: Path, batch: Any, kept: torch.Tensor, stopped: torch.Tensor, shadow: torch.Tensor) -> None:
        """One line per step in ``early_stop.jsonl``: each stopped row with its boundary and score, the
        explore groups and their would-be stops, the rows kept, every row's prompt and length; the
        predictor that decided (version; its history's steps)."""
        at, q = self._cat("stopped_at"), self._cat("q_last")
        line = {"step": self.step + 1, "predictor_version": self.predictor.version, "ready": self.ready,
                "history_steps": [s["step"] for s in self.history.steps], "group_size": self.group_size,
                "prompt_ids": batch.prompt_ids.tolist(), "lengths": batch.completion_lengths.tolist(),
                "stopped": [[int(r), int(at[r]), float(q[r])] for r in stopped.nonzero().squeeze(1).tolist()],
                "explore_groups": self._cat("explore").nonzero().squeeze(1).tolist(),
                "shadow": shadow.nonzero().squeeze(1).tolist(), "kept": kept.tolist()}
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")

    def _quality(self, y: torch.Tensor, stopped: torch.Tensor) -> dict[str, float]:
        """Predictor quality on the step's finished rows, from the scores its decisions used:
        over the explore groups (no selection by stopping: the headline ``predictor_auc``), at their
        first boundary, and over every finished row (biased toward the survivors)."""
        out: dict[str, float] = {}
        if not self.ready:
            return {"predictor_auc": float("nan")}
        q_ex, y_ex, q_first, y_first, q_all, y_all = [], [], [], [], [], []
        offset = 0
        for m in self.monitors:
            for i, rec in enumerate(m.records):
                rows = rec["rows"]
                fin = ~stopped[offset + rows]
                q = self.predictor.predict(rec["x"])
                ex = m.explore[rows // m.G] & fin
                q_ex.append(q[ex])
                y_ex.append(y[offset + rows[ex]])
                if i == 0:
                    q_first.append(q[ex])
                    y_first.append(y[offset + rows[ex]])
                q_all.append(q[fin])
                y_all.append(y[offset + rows[fin]])
            offset += m.N
        for name, qs, ys in (("predictor_", q_ex, y_ex), ("predictor_first_", q_first, y_first),
                             ("predictor_all_", q_all, y_all)):
            if qs:
                out.update(quality_metrics(torch.cat(qs), torch.cat(ys), name))
        out.setdefault("predictor_auc", float("nan"))
        return out

    def _examples(self, y: torch.Tensor, r: torch.Tensor, stopped: torch.Tensor):
        """(x, y, r, (failures, successes)) of the step's finished rows, one example per boundary."""
        xs, ys, rs = [], [], []
        offset = 0
        for m in self.monitors:
            for rec in m.records:
                rows = offset + rec["rows"]
                fin = ~stopped[rows]
                xs.append(rec["x"][fin])
                ys.append(y[rows[fin]])
                rs.append(r[rows[fin]])
            offset += m.N
        fin_rows = ~stopped
        counts = (int((y[fin_rows] == 0).sum()), int((y[fin_rows] == 1).sum()))
        if not xs:
            return torch.zeros(0, 0, dtype=torch.float64), torch.zeros(0), torch.zeros(0), counts
        return torch.cat(xs), torch.cat(ys), torch.cat(rs), counts

