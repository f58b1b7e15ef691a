"""Selective rollout (GRESO) in veRL 0.9.1's V1 sync trainer: skip prompts before generation.

The seams, all on ``verl.trainer.ppo.v1.trainer_base.PPOTrainer`` and inert unless the run sets
``algorithm.adv_estimator=cppo`` and ``cppo.selective.enabled=true``:

- ``_fetch_one_gen_batch`` (trainer_base.py:1466), the one place V1 takes prompts from the train
  dataloader (the step's batch in ``prepare_step`` and any refill go through ``_next_train_batch``,
  which calls it once per ``data.gen_batch_size`` chunk). ``prepare`` sets ``data.gen_batch_size=1``,
  so each call hands one prompt; the wrapper draws candidates from the original (the same
  dataloader, in its order) and asks the core (``fill_batch`` with ``cppo.seed`` and
  ``global_steps``) which to skip, until one is kept: that one is returned, the skipped ones are
  used up (the dataloader moved past them, as in the embedded trainer). The history is keyed by
  the dataset's stable prompt index, the ``index`` field veRL takes from ``extra_info.index``.
- the plugin's CPPO seam at ``_balance_batch`` (``hook.prune_kv_batch``), which reads every
  finished group's rewards of the sync step (without ``algorithm.filter_groups`` nothing is evicted
  before it): ``record`` files each group's outcome (zero variance, easy, hard) under its prompt
  index, adapts the rates (after the first pass over the data set, by default) and writes the
  step's ``selective/*`` metrics into veRL's metrics dict, with ``tokens_saved_estimate`` = skipped
  x G x the mean of the rows' generated tokens (``response_mask`` summed, read with the rewards).
- ``_save_checkpoint`` / ``_load_checkpoint`` (trainer_base.py:948, 850): the history, rates and
  counters go to ``global_step_N/cppo_selective.pt`` beside veRL's own files (written before veRL
  writes its tracker file) and come back on resume.

veRL's V1 driver is one process (the TaskRunner holds the trainer; workers never draw prompts), so
the history is "identical on every rank" by construction: there is one copy.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from typing import Any

import torch

from ...config import CPPOConfig
from ...core.selective import EASY, HARD, INFORMATIVE
from ...core.selective_run import SelectiveRun
from ..importhook import after_import
from ..wrap import unwrap, wrap_methods
from . import observers
from .checkpoint import state_file_seams
from .runconfig import selective_enabled, settings_of

__all__ = [
    "has_state",
    "STATE_FILE",
    "TARGET",
    "VerlSelective",
    "enabled",
    "install",
    "state_of",
    "uninstall",
]

STATE_FILE = "cppo_selective.pt"  # beside veRL's files in global_step_N/
# each trainer's VerlSelective, kept beside the host object rather than set on it (it dies with it)
_STATES: weakref.WeakKeyDictionary[Any, VerlSelective] = weakref.WeakKeyDictionary()
TARGET = ("verl.trainer.ppo.v1.trainer_base", "PPOTrainer")
SEAMS = ("_fetch_one_gen_batch", "_save_checkpoint", "_load_checkpoint")
WRAP_TAG = __name__
enabled = selective_enabled
_COUNTERS = ("groups_recorded", "groups_unrecorded")  # veRL's own, beside the driver's (SelectiveRun)


def _warn(message: str) -> None:
    warnings.warn(f"cppo: {message.removeprefix('warning: ')}", stacklevel=3)


# ---------------------------------------------------------------------------------- the state
class VerlSelective(SelectiveRun):
    """The core's driver (``SelectiveRun``) with veRL's side: one kept prompt per dataloader fetch, the
    prompt index each row carries, the uid veRL gives each generated row, the audit record.

    Args:
        cfg: the run's ``CPPOConfig`` (its ``selective`` section; ``seed`` seeds the draws).
        num_prompts: rows in the train dataset (one pass = one epoch; bounds one fetch's draws).
        group_size: G, veRL's ``actor_rollout_ref.rollout.n`` (the tokens-saved estimate).
    """

    def __init__(self, cfg: CPPOConfig, *, num_prompts: int, group_size: int) -> None:
        super().__init__(cfg, num_prompts=num_prompts, group_size=group_size, counters=_COUNTERS, warn=_warn)
        # the indices drawn in the dataloader's current pass (epoch): one pass is num_prompts draws
        # (one prompt per fetch), counted from the run's start; None: the count is not known (a
        # resume from a checkpoint without the selective state), so repeats are not checked
        self.epoch_seen: set[int] | None = set()
        self._begin(-1)

    def _begin(self, step: int) -> None:
        if step >= 0:
            self.start_step(step)  # the rates move from the second pass on (the authors' rule), unless told otherwise
        else:
            self.step, self.rounds = -1, []
        self.generated: dict[str, int] = {}  # uid veRL gave the row -> its prompt index, this step
        self.drawn_this_step: list[int] = []

    # ------------------------------------------------------------------ before generation
    def fetch(self, trainer: Any, original: Any) -> Any:
        """One kept prompt (veRL's one-row TensorDict); skipped candidates are replaced by the
        next ones from ``original`` (veRL's ``_fetch_one_gen_batch``, endless: it starts a new pass
        itself). After ``1 + num_prompts`` skipped candidates the last of them is kept anyway
        (``SelectiveRun.fill``): a fetch always returns a row."""
        step = int(trainer.global_steps)
        if step != self.step:
            self._begin(step)
        rows: list[Any] = []

        def draw(n: int) -> list[int]:
            for _ in range(n):
                rows.append(original(trainer))
                self.drawn_this_step.append(self._index_of(rows[-1], step))
            return self.drawn_this_step[len(self.drawn_this_step) - n:]

        fb = self.fill(draw, 1)
        row = rows[-1]  # the one kept is the last drawn: fill stops at the first kept, or forces the last
        self.generated[str(row["uid"][0])] = int(fb.kept[0])
        return row

    def _index_of(self, row: Any, step: int) -> int:
        if len(row) != 1:
            raise ValueError(
                f"selective rollout: the dataloader handed {len(row)} prompts in one fetch; the hook replaces "
                "skipped prompts one at a time, set data.gen_batch_size=1"
            )
        if "index" not in row.keys():
            raise ValueError("selective rollout: the dataloader's batch has no 'index' field (veRL's rl_dataset "
                             "sets it from extra_info.index); give every row an extra_info.index")
        value = row["index"][0]
        try:
            index = int(value)
        except (TypeError, ValueError):
            raise ValueError(f"selective rollout: prompt index {value!r} is not an int; give every row of "
                             "data.train_files an int extra_info.index (its row number)") from None
        # draws since the run started: a new pass over the data set begins every num_prompts draws, and
        # within one pass every index comes once (a shuffled pass may repeat one of this step's earlier draws)
        drawn_in_run = int(self.totals["prompts_drawn"]) + len(self.drawn_this_step)
        if self.epoch_seen is not None and drawn_in_run % self.num_prompts == 0:
            self.epoch_seen = set()
        if self.epoch_seen is not None and index in self.epoch_seen:
            hint = (" veRL sets index 0 when a row has no extra_info.index (rl_dataset.py)." if index == 0 else "")
            raise ValueError(
                f"selective rollout: prompt index {index} was drawn twice in step {step} within "
                f"{drawn_in_run % self.num_prompts + 1} draws from a data set of {self.num_prompts} prompts (one "
                f"pass over it): the index is the key of each prompt's history and must be unique.{hint} Give "
                "every row of data.train_files a unique extra_info.index (its row number)"
            )
        if self.epoch_seen is not None:
            self.epoch_seen.add(index)
        return index

    # ------------------------------------------------------------------ after rewards
    def record(self, step: int, uids: list[str], rewards: torch.Tensor,
               response_tokens: torch.Tensor) -> dict[str, float]:
        """File every finished group of the step under its prompt index, adapt the rates, count;
        returns the step's ``selective/*`` metrics.

        Args:
            step: veRL's ``global_steps``.
            uids: [N] veRL's prompt uid of each completion row (padding excluded).
            rewards: [N] float, each row's reward (rm_scores summed); easy: all >= 1.
            response_tokens: [N] int64, each row's generated tokens (``response_mask`` summed): the
                skipped prompts' tokens are estimated as skipped x G x their mean.
        """
        if len(response_tokens) != len(uids):
            raise ValueError(f"selective rollout: {len(response_tokens)} response lengths for {len(uids)} rows "
                             "at the CPPO seam: give one per row (response_mask summed)")
        if step != self.step:  # no prompt was drawn through the hook in this step
            self._begin(step)
        order: dict[str, list[int]] = {}
        for row, uid in enumerate(uids):
            order.setdefault(uid, []).append(row)
        known = [u for u in order if u in self.generated]
        unrecorded = len(self.generated) - len(known)  # generated but never reached the seam (failed)
        rows = [r for u in known for r in order[u]]
        group = torch.tensor([j for j, u in enumerate(known) for _ in order[u]], dtype=torch.int64)
        out = self.file_groups(torch.tensor([self.generated[u] for u in known], dtype=torch.int64),
                               rewards[rows].to(torch.float64), group, completion_lengths=response_tokens,
                               expect_all=False, counts={"groups_recorded": len(known),
                                                         "groups_unrecorded": unrecorded})
        out.update({
            "selective/groups_recorded": float(len(known)),
            "selective/groups_unrecorded": float(unrecorded),
            "selective/groups_unknown": float(len(order) - len(known)),
        })
        if observers.HUB.recording():
            self._audit(step)
        self.generated = {}  # the step is filed: a second call in the same step (none in the sync loop) starts empty
        return out

    def _audit(self, step: int) -> None:
        """The ``selective`` audit record of the step: every candidate drawn, in draw order, with its
        decision and why (streak, kind of its last group, skip probability, the rates used), the ones
        kept although skipped (``forced``), and the groups filed, in filing order, with their outcome
        (0 informative, 1 easy, 2 hard)."""
        rounds = self.rounds

        def cat(name: str) -> list:
            return [v for fb in rounds for v in getattr(fb.decision, name).tolist()]

        ids, zv, easy = self.last_filed
        filed = torch.where(easy, EASY, torch.where(zv, HARD, INFORMATIVE)).tolist()
        observers.HUB.record("selective", step=step, drawn=cat("prompt_ids"), skipped=cat("skip"),
                         forced=[v for fb in rounds for v in fb.forced_mask.tolist()],
                         skip_prob=cat("skip_prob"), streak=cat("streak"), last_outcome=cat("last_outcome"),
                         rates={"p_easy": self.rates.p_easy, "p_hard": self.rates.p_hard}, seed=self.cfg.seed,
                         recorded=ids.tolist(), outcomes=filed, adapts=self.adapt)

    # ------------------------------------------------------------------ persistence
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``; a malformed entry is an error naming it."""
        super().load_state_dict(state)
        self.epoch_seen = set()  # resumed inside a pass: its earlier draws are not known, the rest are checked
        self._begin(-1)


def state_of(trainer: Any) -> VerlSelective:
    """The trainer's ``VerlSelective``, created on first use from its config and train dataset."""
    if trainer not in _STATES:
        run = settings_of(trainer)
        _STATES[trainer] = VerlSelective(run.cfg, num_prompts=len(trainer.train_dataset), group_size=run.group_size)
    return _STATES[trainer]


def has_state(trainer: Any) -> bool:
    """Whether selective rollout has acted on this trainer (``state_of`` was called)."""
    return trainer in _STATES


def record(trainer: Any, uids: list[str], rewards: torch.Tensor, response_tokens: torch.Tensor, metrics: dict) -> None:
    """The CPPO seam's call (``hook.prune_kv_batch``): file the step's groups, add the metrics.
    ``response_tokens``: [N] each row's generated tokens (``response_mask`` summed)."""
    if not settings_of(trainer).selective:
        return
    metrics.update(state_of(trainer).record(int(getattr(trainer, "global_steps", 0)), uids, rewards,
                                            response_tokens))


# ---------------------------------------------------------------------------------- the seams
def _fetching(original):
    @functools.wraps(original)
    def _fetch_one_gen_batch(self, *args, **kwargs):
        if args or kwargs or not settings_of(self).selective:
            return original(self, *args, **kwargs)
        return state_of(self).fetch(self, original)

    return _fetch_one_gen_batch


# the history, rates and counters ride in veRL's checkpoint (global_step_N/cppo_selective.pt)
def _unknown_pass(trainer: Any) -> str:
    state_of(trainer).epoch_seen = None  # where the dataloader's pass stands is not known: no repeat check
    return "resuming with an empty history and the initial rates"


_saving, _loading = state_file_seams(STATE_FILE, "selective-rollout", enabled, state_of, missing=_unknown_pass)

_MAKERS = {"_fetch_one_gen_batch": _fetching, "_save_checkpoint": _saving, "_load_checkpoint": _loading}


def _patch(module) -> None:
    wrap_methods(module, TARGET, {name: _MAKERS[name] for name in SEAMS}, tag=WRAP_TAG,
                 changed="veRL changed (pinned 0.9.1)")


def install() -> None:
    """Wrap the three seams when veRL's V1 trainer module is imported (idempotent)."""
    after_import(TARGET[0], _patch)


def uninstall() -> None:
    """Remove the wrappers (tests)."""
    import sys

    from .. import importhook

    importhook.remove(_patch)
    module = sys.modules.get(TARGET[0])
    if module is not None:
        for name in SEAMS:
            unwrap(getattr(module, TARGET[1]), name, tag=WRAP_TAG)
