"""The ``cppo.early_stop`` section: early stopping inside the rollout engine (beyond CPPO).

A section of its own (``CPPOConfig.early_stop``, an ``EarlyStopConfig``), documented and
checked from its fields' metadata like the rest of the settings: each field carries ``help``,
and ``choices`` or a ``check`` (a range), in the metadata shape ``settings.setting`` makes, so
``--help-recipe``, the docs' key tables and the recipe schema read it as any other section. This
module imports nothing of ours (``settings`` imports it, and documents the class with
``document_fields``). The functions that take it live in ``core.early_stop``;
docs/early_stopping.md is the user guide.

    cfg = CPPOConfig(pruning_rate=0.875, early_stop={"enabled": True, "segment_tokens": 16})
    cfg.early_stop.min_running_for(group_size=16, keep=2)   # -> 4
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["ESTIMATORS", "FEATURE_SETS", "EarlyStopConfig"]

# what the predictor sees of a prefix: the sampled tokens' log-probs (every engine), plus the
# per-token entropies (HF exactly, vLLM over its top log-probs), plus the policy's last hidden
# state at the boundary (the embedded trainer's HF engine only)
FEATURE_SETS = ("logprob", "entropy", "hidden")
# how the group statistics treat a stopped completion (it has no reward): its expected reward
# under the predictor stands in (impute), or the statistics come from the finished ones alone
ESTIMATORS = ("impute", "finished")
# the ranges a field's metadata can name (the subset of settings.CHECKS this section uses)
CHECKS = {"> 0": lambda v: v > 0, ">= 0": lambda v: v >= 0}


def setting(default: Any, help: str, *, choices: tuple | None = None, check: str | None = None) -> Any:
    """A dataclass field with ``help`` (and ``choices`` / ``check``) in its metadata, the shape
    ``settings.setting`` gives every documented field."""
    metadata: dict[str, Any] = {"help": " ".join(help.split())}
    if choices is not None:
        metadata["choices"] = tuple(choices)
    if check is not None:
        metadata["check"] = check
    return dataclasses.field(default=default, metadata=metadata)


@dataclass
class EarlyStopConfig:
    """Early stopping inside the rollout engine ("prune as you generate"; after ARRoL, Xu et al.,
    arXiv 2603.24840): generation runs in segments of ``segment_tokens``; at each boundary an online
    predictor scores every completion of a group from what the engine hands out (token log-probs,
    entropies, hidden state), and the unfinished completions it expects to end in the group's
    majority outcome (the ones CPPO would prune after generation: the smallest |A|) are stopped, their
    remaining tokens never generated. ``core.early_stop`` holds the rule, the predictor and the
    estimator; docs/early_stopping.md says how to turn it on in each host and what it changes.
    """

    enabled: bool = setting(False, """stop completions inside the rollout engine. Needs pruning (P > 0 or
        keep_per_group < G) in group scope: the completions stopped are the ones CPPO would prune.""")
    segment_tokens: int = setting(16, """tokens generated between two decisions; the predictor scores every
        unfinished completion after each segment (16: a decision every 16 tokens).""", check="> 0")
    min_running: int | None = setting(None, """completions of each group that always run to their end
        (finished ones count); null: twice CPPO's kept count k per group, at most G (k = 2 of G = 16 -> 4), so
        the kept set is still chosen among several finished completions.""")
    min_confidence: float = setting(0.6, """stop a completion only when the predictor gives it at least this
        probability, in [0.5, 1), of ending in its group's majority outcome (where |A| is small).""")
    estimator: str = setting("impute", """how a group's mean and std are formed when some of its completions
        were stopped (they have no reward). impute: a stopped completion's expected reward under the predictor
        stands in (mean unbiased, variance unbiased up to the std's square root, when the predictor is
        calibrated); finished: the statistics of the finished completions alone (ARRoL's survivors; biased
        toward their balance).""", choices=ESTIMATORS)
    explore_share: float = setting(0.125, """share in [0, 1] of each round's groups generated in full, without
        stopping (seeded): their outcomes train the predictor without the selection bias of stopping, and its
        AUC and calibration are measured on them.""")
    features: str = setting("logprob", """what the predictor sees of a prefix. logprob: the sampled tokens'
        log-probs (every engine); entropy: also the per-token entropies (HF exactly; vLLM over its top 20
        log-probs; not in veRL); hidden: also the policy's last hidden state at the boundary (the embedded
        trainer's HF engine only).""", choices=FEATURE_SETS)
    history_steps: int = setting(4, """the predictor is fitted after each step on the finished completions of
        this many previous steps (never the current step's, before its decisions are made).""", check="> 0")
    min_examples: int = setting(64, """nothing is stopped until the predictor has seen this many finished
        completions of each outcome (success and failure) in its history.""", check="> 0")
    l2: float = setting(1.0, """ridge penalty of the predictor's logistic regression (on standardised
        features).""", check=">= 0")
    success_threshold: float = setting(0.5, """a completion succeeds when its reward is at least this (the
        outcome the predictor predicts; 0.5 for 0/1 rewards and for correct + format rewards).""")
    timeout_s: float = setting(600.0, """veRL: seconds a group's coordinator waits for its members at a
        boundary before it lets every member run on (a member that died must not hang the step).""",
        check="> 0")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, where: str = "early_stop") -> EarlyStopConfig:
        """Check every field from its metadata (type, choices, range), then the ranges the
        metadata cannot name; ValueError naming ``cppo.<where>.<field>`` and the bad value."""
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            _check_field(f"cppo.{where}.{f.name}", getattr(self, f.name), hints[f.name], f.metadata)
        if self.min_running is not None and self.min_running < 1:
            raise ValueError(f"cppo.{where}.min_running must be an integer >= 1 or null, got {self.min_running!r}")
        if not 0.5 <= self.min_confidence < 1.0:
            raise ValueError(f"cppo.{where}.min_confidence must be in [0.5, 1), got {self.min_confidence!r}: "
                             "below 0.5 a completion would be stopped although it more likely ends in the minority")
        if not 0.0 <= self.explore_share <= 1.0:
            raise ValueError(f"cppo.{where}.explore_share must be a share in [0, 1], got {self.explore_share!r}")
        return self

    def check_with(self, *, is_grpo: bool, scope: str, keep_mass: float | None, dynamic_sampling: bool = False,
                   selective_rollout: bool = False) -> None:
        """The rules that span the CPPO settings (``CPPOConfig.validate`` calls it)."""
        if not self.enabled:
            return
        if is_grpo:
            raise ValueError("cppo.early_stop.enabled needs pruning (pruning_rate > 0 or keep_per_group < G): with "
                             "P = 0 every completion is kept, so none can be stopped")
        if scope != "group" or keep_mass is not None:
            raise ValueError(f"cppo.early_stop works in group scope with pruning_rate or keep_per_group (got "
                             f"scope={scope!r}, keep_mass={keep_mass!r}): the kept count of each group must be "
                             "known while it generates")
        for name, on in (("dynamic_sampling", dynamic_sampling), ("selective_rollout", selective_rollout)):
            if on:
                raise ValueError(f"cppo.early_stop does not combine with cppo.{name}: both read every completion's "
                                 "reward of a group, and a stopped completion has none; turn one of them off")

    def min_running_for(self, group_size: int, keep: int) -> int:
        """Completions of a group of ``group_size`` that run to the end: ``min_running`` (default
        2 ``keep``), at least ``keep`` (CPPO's k) and at most ``group_size``."""
        want = 2 * keep if self.min_running is None else self.min_running
        return max(keep, min(group_size, want))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> EarlyStopConfig:
        """From a mapping (a YAML section); an unknown key is an error naming it."""
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(str(k) for k in values if k not in known)
        if unknown:
            raise ValueError(f"cppo.early_stop: unknown key(s) {unknown}; known keys: {known}")
        return cls(**{str(k): values[k] for k in values})


def _check_field(name: str, value: Any, hint: Any, metadata: Mapping[str, Any]) -> None:
    """The field's type (from its annotation), choices and range (from ``setting``'s metadata)."""
    args = typing.get_args(hint)
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), hint) if args else hint
    if value is None and optional:
        return
    if base is bool:
        ok = isinstance(value, bool)
    elif base is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif base is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    else:
        ok = isinstance(value, base)
    if not ok:
        raise ValueError(f"{name} must be {'a ' + base.__name__ if base is not bool else 'true or false'}"
                         f"{' or null' if optional else ''}, got {value!r}")
    choices = metadata.get("choices")
    if choices is not None and value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
    check = metadata.get("check")
    if check is not None and not CHECKS[check](value):
        raise ValueError(f"{name} must be {check}, got {value!r}")
