"""DAPO's dynamic sampling (OpenRLHF's ``--algo.dynamic_filtering_enable``) under CPPO, accounted for.

What OpenRLHF 0.11.2 does (``trainer/ppo_utils/samples_generator.py``):

- ``generate_samples`` (l. 106-116) calls ``_generate_vllm`` once per step for
  ``--rollout.vllm_generate_batch_size`` prompts (OpenRLHF sets it to ``--rollout.batch_size``
  when unset, ``cli/train_ppo_ray.py:737``), so with the launcher's allocation the filter fills
  the allocated count b x G/k, not the GRPO count b: allocation and refill agree.
- ``_generate_vllm`` draws that many prompts (l. 150), one vLLM request of G completions each;
  a group whose **mean score** is not strictly inside ``--algo.dynamic_filtering_range`` (default
  ``0 1``) is dropped (l. 169-177) and one new prompt is drawn for it (l. 183-189), until every
  drawn prompt has passed or been replaced, or the dataloader (batch size 1, so nothing is
  skipped) is exhausted. A group without scores is never filtered (l. 169).
- It logs ``dynamic_filtering_pass_rate = samples passed / prompts drawn x 100`` (l. 122-123):
  samples over prompts, G times too high. ``cppo/filter_pass_rate`` here is groups over prompts.

OpenRLHF keeps no record of the dropped groups. The narrowest seam that sees them: every
completion goes through ``_process_response_into_experience`` (l. 163-165) inside one
``_generate_vllm`` call, and the call returns the accepted ones. ``install_generator`` wraps
both: what was produced and not returned was filtered. The call's ``FilterLedger`` (every
prompt drawn, its scores and rewards, passed or filtered) rides on each accepted sample (the
``FILTER_ATTR`` attribute, pickled with it through Ray to the trainer), and the hook turns it
into the step's ``StepAccount``: drawn = filtered + passed, generated = filtered x G + kept +
pruned.

The semantics with CPPO: OpenRLHF's filter comes first, then CPPO prunes what passed. The filter
reads the scores and its range, not CPPO's rewards, so a group can pass with all rewards equal:
scores other than the rewards (like veRL's ``filter_groups.metric=acc``), a group without scores,
or a mean such as 0.5 strictly inside the range. Such a group has zero advantages (CPPO keeps k of
it under ``scope=group`` and prunes it first under ``scope=batch``); it is counted, not refused:
``StepAccount.passed_zero_variance``, ``cppo/filter_passed_zero_variance``.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import os
from collections.abc import Sequence
from typing import Any

import torch

from ..wrap import unwrap, wrap
from . import observers

__all__ = [
    "FILTER_ATTR", "GENERATOR_MODULE", "FilterLedger", "FilteredGroup", "StepAccount", "account_step",
    "build_ledger", "check_args", "enabled", "install_generator", "ledgers_of",
    "uninstall_generator",
]  # fmt: skip

logger = logging.getLogger(__name__)

FILTER_ATTR = "_cppo_filter"  # on each accepted rollout Experience: the FilterLedger of its generation call
GENERATOR_MODULE = "openrlhf.trainer.ppo_utils.samples_generator"
WRAP_TAG = __name__
_PRODUCED = "_cppo_produced"  # on the SamplesGenerator during one _generate_vllm call
_SERIAL = itertools.count()


def enabled(args: Any) -> bool:
    """Whether the run filters groups (``--algo.dynamic_filtering_enable``)."""
    return bool(getattr(args.algo, "dynamic_filtering_enable", False))


def _range(args: Any) -> tuple[float, float]:
    lo, hi = args.algo.dynamic_filtering_range
    return float(lo), float(hi)


# ---------------------------------------------------------------------------- records
@dataclasses.dataclass(frozen=True)
class FilteredGroup:
    """One prompt drawn by the filter loop: its label, its G scores and rewards (floats, None
    where the rollout gave none) and whether it passed."""

    prompt: str
    label: Any
    scores: tuple[float | None, ...]
    rewards: tuple[float | None, ...]
    passed: bool

    def to_record(self) -> dict:
        return {"prompt": self.prompt, "label": self.label, "scores": list(self.scores), "rewards": list(self.rewards),
                "passed": self.passed}


@dataclasses.dataclass(frozen=True)
class FilterLedger:
    """One ``_generate_vllm`` call with filtering on: every prompt it drew, in dispatch-completion
    order. ``drawn`` is OpenRLHF's own ``prompts_consumed``; each drawn prompt is one group."""

    serial: str
    drawn: int
    group_size: int
    groups: tuple[FilteredGroup, ...]
    exhausted: bool
    range: tuple[float, float]

    def __post_init__(self) -> None:
        if self.group_size < 1:
            raise ValueError(f"FilterLedger: group_size must be >= 1, got {self.group_size}")
        if self.drawn != len(self.groups):
            raise ValueError(f"FilterLedger {self.serial}: {self.drawn} prompts drawn but {len(self.groups)} groups "
                             "generated; every drawn prompt must come back as one group")
        for i, g in enumerate(self.groups):
            if len(g.scores) != self.group_size or len(g.rewards) != self.group_size:
                raise ValueError(f"FilterLedger {self.serial}: group {i} ({g.prompt[:60]!r}) has {len(g.scores)} "
                                 f"completions, expected {self.group_size}")

    @property
    def num_passed(self) -> int:
        return sum(g.passed for g in self.groups)

    @property
    def num_filtered(self) -> int:
        return len(self.groups) - self.num_passed

    def to_record(self) -> dict:
        return {"serial": self.serial, "drawn": self.drawn, "group_size": self.group_size,
                "exhausted": self.exhausted, "range": list(self.range),
                "groups": [g.to_record() for g in self.groups]}


def _value(t: Any) -> float | None:
    return None if t is None else float(torch.as_tensor(t).reshape(-1)[0])


def build_ledger(produced: Sequence[Any], accepted: Sequence[Any], *, drawn: int, group_size: int,
                 exhausted: bool, filter_range: tuple[float, float], serial: str | None = None) -> FilterLedger:
    """The ledger of one filter call from what it produced and what it returned.

    ``produced``: every single-sample ``Experience`` made by ``_process_response_into_experience``
    during the call, in order (a request's G completions are processed together, l. 163-165);
    ``accepted``: the call's return value. A group passed when all its G samples were returned.
    """
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"build_ledger: group_size must be an integer >= 1, got {group_size!r}")
    if len(produced) != drawn * group_size:
        raise ValueError(f"build_ledger: {drawn} prompts drawn x G={group_size} should give {drawn * group_size} "
                         f"completions, {len(produced)} were produced")
    accepted_ids = {id(e) for e in accepted}
    produced_ids = {id(e) for e in produced}
    if not accepted_ids <= produced_ids:
        raise ValueError(f"build_ledger: {len(accepted_ids - produced_ids)} returned samples were not produced by "
                         "this call")
    groups = []
    for start in range(0, len(produced), group_size):
        members = produced[start:start + group_size]
        passed = [id(e) in accepted_ids for e in members]
        prompts = {e.prompts[0] for e in members}
        if len(prompts) != 1 or len(set(passed)) != 1:
            raise ValueError(f"build_ledger: completions {start}-{start + group_size - 1} are not one request's "
                             f"group (prompts {sorted(prompts)[:2]}, passed {passed})")
        labels = getattr(members[0], "labels", None) or [None]
        groups.append(FilteredGroup(prompt=members[0].prompts[0], label=labels[0],
                                    scores=tuple(_value(e.scores) for e in members),
                                    rewards=tuple(_value(e.rewards) for e in members), passed=passed[0]))
    lo, hi = filter_range
    return FilterLedger(serial=serial or f"{os.getpid()}:{next(_SERIAL)}", drawn=drawn, group_size=group_size,
                        groups=tuple(groups), exhausted=bool(exhausted), range=(float(lo), float(hi)))


def ledgers_of(samples: Sequence[Any]) -> list[FilterLedger]:
    """The distinct ledgers the rollout samples carry, in order of first appearance."""
    seen: dict[str, FilterLedger] = {}
    for s in samples:
        ledger = getattr(s, FILTER_ATTR, None)
        if ledger is not None and ledger.serial not in seen:
            seen[ledger.serial] = ledger
    return list(seen.values())


@dataclasses.dataclass(frozen=True)
class StepAccount:
    """Where every prompt drawn and every completion generated for one step went.

    ``drawn`` prompts = ``filtered`` + ``passed`` groups; ``drawn x group_size`` completions =
    ``filtered x group_size`` (dropped by the host's filter) + ``kept`` + ``pruned`` (CPPO).
    ``target`` is the prompts per step OpenRLHF asked for (``--rollout.batch_size``, allocated);
    ``short`` when fewer passed (the dataloader ran out while refilling). ``passed_zero_variance``:
    the passed groups whose rewards are all equal (no reward signal; see the module doc)."""

    drawn: int
    filtered: int
    passed: int
    group_size: int
    kept: int
    pruned: int
    target: int
    exhausted: bool
    passed_zero_variance: int = 0

    def __post_init__(self) -> None:
        for name in ("drawn", "filtered", "passed", "kept", "pruned", "target", "passed_zero_variance"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"StepAccount: {name} must be an integer >= 0, got {v!r}")
        if self.group_size < 1:
            raise ValueError(f"StepAccount: group_size must be >= 1, got {self.group_size}")
        if self.drawn != self.filtered + self.passed:
            raise ValueError(f"StepAccount: {self.drawn} prompts drawn != {self.filtered} filtered + {self.passed} "
                             "passed")
        if self.generated != self.filtered * self.group_size + self.kept + self.pruned:
            raise ValueError(f"StepAccount: {self.generated} completions generated != {self.filtered} filtered x "
                             f"G={self.group_size} + {self.kept} kept + {self.pruned} pruned")
        if self.passed_zero_variance > self.passed:
            raise ValueError(f"StepAccount: {self.passed_zero_variance} zero-variance groups passed of only "
                             f"{self.passed} passed")

    @property
    def generated(self) -> int:
        return self.drawn * self.group_size

    @property
    def short(self) -> bool:
        return self.passed < self.target

    def metrics(self) -> dict[str, float]:
        return {
            "cppo/filter_prompts_drawn": float(self.drawn),
            "cppo/filter_groups_filtered": float(self.filtered),
            "cppo/filter_groups_passed": float(self.passed),
            # groups over prompts; OpenRLHF's dynamic_filtering_pass_rate divides samples by prompts (x G)
            "cppo/filter_pass_rate": self.passed / self.drawn if self.drawn else 0.0,
            "cppo/filter_completions_generated": float(self.generated),
            "cppo/filter_completions_filtered": float(self.filtered * self.group_size),
            "cppo/filter_short": float(self.short),
            "cppo/filter_passed_zero_variance": float(self.passed_zero_variance),
        }

    def to_record(self) -> dict:
        return {**dataclasses.asdict(self), "generated": self.generated, "short": self.short}


def zero_variance(group: FilteredGroup) -> bool:
    """Whether a group of two or more completions has all its (known) rewards equal."""
    known = [r for r in group.rewards if r is not None]
    return len(known) > 1 and min(known) == max(known)


def account_step(ledgers: Sequence[FilterLedger], *, num_samples: int, kept: int, target: int) -> StepAccount:
    """The step's account from the ledgers its rollout samples carry.

    ``num_samples``: rollout samples the hook got (every passed group's G completions);
    ``kept``: how many CPPO passed on (selected + topped up); ``target``: ``--rollout.batch_size``.
    One generation call per step (``check_args`` refuses over-sampling), so the ledgers' passed
    groups are exactly this step's rollout.
    """
    if not ledgers:
        raise ValueError("account_step: no filter ledger on the rollout samples (is the samples generator hooked?)")
    sizes = {led.group_size for led in ledgers}
    if len(sizes) != 1:
        raise ValueError(f"account_step: ledgers disagree on the group size: {sorted(sizes)}")
    (g,) = sizes
    passed = sum(led.num_passed for led in ledgers)
    if passed * g != num_samples:
        raise ValueError(f"account_step: the filter passed {passed} groups x G={g} = {passed * g} completions but the "
                         f"step's rollout holds {num_samples}")
    if not 0 <= kept <= num_samples:
        raise ValueError(f"account_step: kept={kept} outside 0..{num_samples}")
    return StepAccount(drawn=sum(led.drawn for led in ledgers), filtered=sum(led.num_filtered for led in ledgers),
                       passed=passed, group_size=g, kept=kept, pruned=num_samples - kept, target=target,
                       exhausted=any(led.exhausted for led in ledgers),
                       passed_zero_variance=sum(grp.passed and zero_variance(grp) for led in ledgers
                                                for grp in led.groups))


# ---------------------------------------------------------------------------- guards
def check_args(args: Any) -> list[str]:
    """Launch-time: refuse what DAPO + CPPO cannot honour; notes (one line each) for the rest.
    ``args``: OpenRLHF's parsed arguments after allocation."""
    if not enabled(args):
        return []
    gen = getattr(args.rollout, "vllm_generate_batch_size", None)
    if gen and int(gen) != int(args.rollout.batch_size):
        raise ValueError(
            f"--rollout.vllm_generate_batch_size {gen} with --algo.dynamic_filtering_enable under CPPO: the filter "
            f"refills to that many groups per generation call, not to the {args.rollout.batch_size} prompts per step "
            "the allocation asks for (and a call's groups would spread over several steps, which the per-step "
            "account cannot follow); leave --rollout.vllm_generate_batch_size unset"
        )
    lo, hi = _range(args)
    return [
        f"dynamic filtering: OpenRLHF draws {args.rollout.batch_size} prompts per step, drops each group whose mean "
        f"score is not strictly inside ({lo:g}, {hi:g}) and draws one new prompt for it until "
        f"{args.rollout.batch_size} groups pass; then CPPO prunes them. A group that passes with all rewards equal "
        "(scores other than the rewards, or a mean inside the range such as 0.5) has no reward signal: it is "
        "counted as cppo/filter_passed_zero_variance"
    ]


# ---------------------------------------------------------------------------- the seam
def _wrap_process(original):
    @functools.wraps(original)
    def _process_response_into_experience(self, response, **generate_kwargs):
        exp = original(self, response, **generate_kwargs)
        produced = self.__dict__.get(_PRODUCED)
        if produced is not None:  # inside a filtering _generate_vllm call
            produced.append(exp)
        return exp

    return _process_response_into_experience


def _wrap_generate(original):
    @functools.wraps(original)
    def _generate_vllm(self, dataloader_iter, num_prompts, dynamic_filtering, **generate_kwargs):
        if not dynamic_filtering:  # evaluation, or a run without the filter
            return original(self, dataloader_iter, num_prompts, dynamic_filtering, **generate_kwargs)
        produced: list[Any] = []
        self.__dict__[_PRODUCED] = produced
        try:
            accepted, consumed, exhausted = original(self, dataloader_iter, num_prompts, dynamic_filtering,
                                                     **generate_kwargs)
        finally:
            del self.__dict__[_PRODUCED]
        group_size = int(generate_kwargs.get("n_samples_per_prompt", self.args.rollout.n_samples_per_prompt))
        ledger = build_ledger(produced, accepted, drawn=consumed, group_size=group_size, exhausted=exhausted,
                              filter_range=_range(self.args))
        for exp in accepted:
            setattr(exp, FILTER_ATTR, ledger)
        if observers.HUB.recording():
            observers.HUB.record("filter", role="generator", **ledger.to_record())
        logger.info("dynamic filtering: %d prompts drawn, %d groups filtered, %d passed", ledger.drawn,
                    ledger.num_filtered, ledger.num_passed)
        return accepted, consumed, exhausted

    return _generate_vllm


def install_generator(module: Any) -> None:
    """Wrap ``module.SamplesGenerator`` (``importhook`` callback; idempotent)."""
    cls = module.SamplesGenerator
    wrap(cls, "_process_response_into_experience", _wrap_process, tag=WRAP_TAG)
    wrap(cls, "_generate_vllm", _wrap_generate, tag=WRAP_TAG)


def uninstall_generator(module: Any) -> None:
    cls = module.SamplesGenerator
    for name in ("_process_response_into_experience", "_generate_vllm"):
        unwrap(cls, name, tag=WRAP_TAG)
