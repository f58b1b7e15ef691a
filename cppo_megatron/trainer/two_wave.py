"""Adaptive group size in two waves in the embedded trainer (``cppo.two_wave``; docs/early_stopping.md,
"Two waves").

``TwoWaves`` generates each round of a step in two engine calls: k = ``first_wave`` completions
per prompt, scored; then G - k more for the prompts whose first wave shows reward variance
(``core.finish_groups``). The round's rows come back in the batch's layout (group g = rows
g*G .. g*G+G-1), the rows an unfinished group never generated marked ``absent``; ``collect_groups``
leaves such a group out of the selection and counts it dropped (its k completions generated, none
trained).

    begin_step(step)          a step starts (its rounds' decisions are recorded)
    generate(rollout, ...)    one round's two waves (``LocalRollout.round`` calls it)
    end_step(batch, kept)     the step's ``two_wave/*`` metrics (``core.two_wave_accounting``) and
                              its audit line (``two_wave.jsonl`` in the run directory)
    state_dict()              the running totals (``two_wave/total_*``); nothing else persists: with
                              the HF engine both waves draw from the checkpointed global torch RNG,
                              with vLLM from a seed per (run seed, step, round, wave)
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from ..core.settings import CPPOConfig
from ..core.two_wave import TwoWaveAccounting, finish_groups, two_wave_accounting, wave_rows
from .step import PhaseTimer

__all__ = ["STATE_KEY", "TwoWaveTotals", "TwoWaves"]

STATE_KEY = "two_wave"  # its entry in trainer.pt

# what an absent row holds in each per-row list of a round (never read: the row was not generated)
_ABSENT = {"completions": [], "rewards": 0.0, "correct": 0.0, "formatted": 0.0, "truncated": False}


@dataclass
class TwoWaveTotals:
    """Running totals since the start of the run (restored on resume)."""

    steps: int = 0
    groups: int = 0
    groups_finished: int = 0
    completions_generated: int = 0
    completions_full: int = 0
    completions_unfinished: int = 0
    tokens_generated: int = 0


class TwoWaves:
    """Two-wave generation of one run.

    Args:
        cfg: the run's ``CPPOConfig`` (``two_wave`` section enabled).
        group_size: G, completions per finished group.
        audit_path: where each step's audit line is appended (None: no audit).
    """

    def __init__(self, cfg: CPPOConfig, *, group_size: int, audit_path: str | Path | None = None) -> None:
        if not cfg.two_wave.enabled:
            raise ValueError("TwoWaves needs cppo.two_wave.enabled=true")
        self.G = group_size
        self.k = cfg.two_wave.first_wave_for(group_size)
        self.min_spread = cfg.two_wave.min_spread
        self.audit_path = None if audit_path is None else Path(audit_path)
        self.totals = TwoWaveTotals()
        self.step = -1
        self.finish: list[torch.Tensor] = []  # per round of the step: [n] bool
        self.first_rewards: list[list[float]] = []  # per round: the first wave's rewards, n*k

    def begin_step(self, step: int) -> None:
        self.step = step
        self.finish, self.first_rewards = [], []

    def generate(self, rollout: Any, problems: list, *, step: int, round_: int, timer: PhaseTimer) -> dict:
        """One round's rows for ``problems`` (a ``LocalRollout``'s ``generate`` dict, every per-row list
        in the batch layout, plus ``absent``): wave 1 (k per prompt), its rewards, wave 2 (G - k) for the
        prompts whose first wave varied."""
        n, G, k = len(problems), self.G, self.k
        w1 = rollout.generate(problems, rollout.seed(step, round_), timer, n=k)
        finish = finish_groups(torch.tensor(w1["rewards"], dtype=torch.float64).reshape(n, k),
                               min_spread=self.min_spread)
        chosen = [p for p, f in zip(problems, finish.tolist(), strict=True) if f]
        w2 = rollout.generate(chosen, rollout.seed(step, round_, wave=1), timer, n=G - k)
        self.finish.append(finish)
        self.first_rewards.append(list(w1["rewards"]))
        first, second, absent = wave_rows(finish, G, k)
        out: dict[str, Any] = {"seconds": w1["seconds"] + w2["seconds"], "stopped": None,
                               "absent": absent.tolist()}
        # an absent row keeps its group's prompt (its prompt length stays meaningful)
        out["prompts"] = [w1["prompts"][(j // G) * k] for j in range(n * G)]
        keys = list(_ABSENT) + ([] if w1["logprobs"] is None else ["logprobs"])
        for key in keys:
            rows: list[Any] = [torch.zeros(0) if key == "logprobs" else _ABSENT[key]] * (n * G)
            for row, value in zip(first.tolist(), w1[key], strict=True):
                rows[row] = value
            for row, value in zip(second.tolist(), w2[key], strict=True):
                rows[row] = value
            out[key] = rows
        if w1["logprobs"] is None:
            out["logprobs"] = None
        return out

    def end_step(self, batch: Any, kept: torch.Tensor) -> dict[str, float]:
        """The step's ``two_wave/*`` metrics (accounting over its rounds; totals) and its audit line.

        batch: the step's ``RolloutBatch`` (``absent``, ``completion_lengths``, ``prompt_ids``);
        kept: [K] int64 rows CPPO kept (none of them absent, none in an unfinished group)."""
        finish = torch.cat(self.finish) if self.finish else torch.zeros(0, dtype=torch.bool)
        if finish.numel() * self.G != batch.num_rows:
            raise RuntimeError(f"two waves: the step's rounds cover {finish.numel()} groups, the batch has "
                               f"{batch.num_rows // self.G}")
        kept = torch.as_tensor(kept, dtype=torch.int64)
        unfinished_rows = (~finish).repeat_interleave(self.G)
        if bool(unfinished_rows[kept].any()):
            raise RuntimeError(f"two waves: rows {kept[unfinished_rows[kept]].tolist()} of unfinished groups were "
                               "kept for training; an unfinished group has no second wave and no signal")
        acc = two_wave_accounting(finish, batch.completion_lengths, batch.absent, group_size=self.G,
                                  first_wave=self.k)
        self._add(acc)
        metrics = acc.metrics()
        metrics["two_wave/completions_trained"] = float(kept.numel())
        metrics.update({f"two_wave/total_{f.name}": float(getattr(self.totals, f.name))
                        for f in fields(TwoWaveTotals)})
        if self.audit_path is not None:
            self._audit(self.audit_path, batch, finish, kept)
        return metrics

    def _add(self, acc: TwoWaveAccounting) -> None:
        t = self.totals
        t.steps += 1
        t.groups += acc.groups
        t.groups_finished += acc.finished
        t.completions_generated += acc.completions_generated
        t.completions_full += acc.completions_full
        t.completions_unfinished += acc.completions_unfinished
        t.tokens_generated += acc.tokens_generated

    def _audit(self, path: Path, batch: Any, finish: torch.Tensor, kept: torch.Tensor) -> None:
        """One line per step in ``two_wave.jsonl``: every group's prompt, its first-wave rewards and
        whether it was finished; every row's length; the rows kept."""
        line = {"step": self.step + 1, "group_size": self.G, "first_wave": self.k, "min_spread": self.min_spread,
                "prompt_ids": batch.prompt_ids.tolist(), "finished": finish.tolist(),
                "first_wave_rewards": [r for rnd in self.first_rewards for r in rnd],
                "lengths": batch.completion_lengths.tolist(), "kept": kept.tolist()}
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")

    def state_dict(self) -> dict[str, Any]:
        """The running totals (between steps)."""
        return {"totals": asdict(self.totals), "first_wave": self.k, "group_size": self.G}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``; a checkpoint written with another k or G is an error."""
        if (state["first_wave"], state["group_size"]) != (self.k, self.G):
            raise ValueError(f"checkpoint ran two waves with first_wave={state['first_wave']} of G="
                             f"{state['group_size']}, this run with {self.k} of {self.G}: resume with the same "
                             "cppo.two_wave.first_wave and rollout.group_size")
        known = {f.name for f in fields(TwoWaveTotals)}
        self.totals = TwoWaveTotals(**{k: v for k, v in state["totals"].items() if k in known})
