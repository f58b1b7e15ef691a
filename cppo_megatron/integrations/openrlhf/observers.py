"""Who watches OpenRLHF's GPU path: the pruning seam's decision and the features' records, handed
to whatever diagnostics subscribed (none unless asked for: ``diagnostics/__init__.py``). ``HUB``
is OpenRLHF's own ``Observers`` (``integrations/observers.py``, host-neutral; veRL's is another
object, so a process loading both keeps them apart); what is OpenRLHF's is the decision and its
records.

The GPU path never imports a diagnostic. The hook decides (through the core), hands the decision
to its own observers (metrics, selective rollout's history, DAPO's filter account) and then to
the ones subscribed to ``HUB``:

- ``HUB.on_prune(fn)``: ``fn(decision)`` once per step with the seam's ``PruneDecision``, after the
  survivors are chosen and before they are passed on (an observer may add an ``info`` entry to
  the samples, as the audit's row ids do). It must not change which samples are kept.
- ``HUB.on_record(fn)``: ``fn(kind, role=..., **fields)`` for every named record a feature emits in
  OpenRLHF's samples generator (``filter``, ``selective``, role ``generator``); ``HUB.recording()``
  says whether anyone listens.

The audit (``diagnostics/audit.py``) subscribes to both in audit mode (``CPPO_OPENRLHF_AUDIT``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..observers import Observers

__all__ = ["HUB", "PruneDecision"]


@dataclass(frozen=True)
class PruneDecision:
    """One step's decision at the ``make_experience_batch`` seam, as the core made it.

    Args:
        step: OpenRLHF's global step before this one (0-based; a resumed run continues the count).
        samples: [N] the step's single-sample rollout ``Experience`` objects, in rollout order (an
            observer may add to their ``info``; the survivors carry it on to the model actors).
        rewards: [N] float32, each sample's reward after OpenRLHF's length penalties.
        group_ids: [N] int64, each sample's group (consecutive runs of one prompt).
        result: the core's ``PruneResult``: ``selection.kept`` ([K'] int64 ascending indices into
            ``samples``: the core's own choice, before the top-up to OpenRLHF's multiple), the
            full-group statistics and advantages.
        survivors: [K] indices into ``samples`` in the order passed on (topped up and balanced).
        account: DAPO's filter: the step's ``filtering.StepAccount``; None when the filter is off.
        ledgers: the serials of the filter ledgers whose passed groups this rollout is.
        selective: selective rollout: the step's account (prompts drawn / skipped / generated, each
            group's prompt index and outcome); None when it is off.
    """

    step: int
    samples: list
    rewards: torch.Tensor
    group_ids: torch.Tensor
    result: Any
    survivors: list[int]
    account: Any = None
    ledgers: list[str] = field(default_factory=list)
    selective: dict | None = None


# OpenRLHF's own subscribers (integrations/observers.py); the other host's hub is another object
HUB: Observers[PruneDecision] = Observers()
