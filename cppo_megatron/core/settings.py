"""The CPPO settings type the core functions take, and the choice lists its fields allow.

Every decision where the CPPO paper (arXiv 2503.22342) and its released code differ is a
field here, not a fork in the code. It lives in the core (and imports nothing of ours
outside it) so the core stands on its own; ``cppo_megatron.config`` re-exports it as the
recipe-level ``CPPOConfig``. The dataclass works as a plain Python object and as an
omegaconf structured config::

    cfg = CPPOConfig(pruning_rate=0.875)
    cfg = CPPOConfig.from_dict({"keep_per_group": 2, "scope": "batch", "selective.enabled": True})
    schema = OmegaConf.structured(CPPOConfig)          # type-checked YAML / dotlist merges
    cfg = CPPOConfig.from_omegaconf(OmegaConf.merge(schema, user_yaml))

``setting`` / ``document_fields`` / ``field_help`` build TRL-style documented dataclass
fields (help text, choices, range and fix in the field metadata); ``check_fields`` validates
a dataclass from that metadata alone, section by section (``section_type``: a field whose
default factory is such a dataclass, e.g. ``CPPOConfig.selective``). The recipe schema
(``trainer.config``) is built and checked the same way.
"""

from __future__ import annotations

import dataclasses
import math
import typing
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ._checks import check_int

__all__ = [
    "ADV_NORMS",
    "CHECKS",
    "CHECK_WORDS",
    "allowed_words",
    "CONFIG_KEYS",
    "CPPOConfig",
    "DEFAULT_PRUNING_RATE",
    "EARLY_STOP_ESTIMATORS",
    "EARLY_STOP_FEATURE_SETS",
    "EarlyStopConfig",
    "FIELD_NAMES",
    "KEEP_MASS_METRICS",
    "MAGNITUDE_METRICS",
    "METRICS",
    "RENAMED",
    "SCOPES",
    "SELECTIVE_PARAMETERS",
    "TwoWaveConfig",
    "SelectiveConfig",
    "build_sections",
    "check_config",
    "check_fields",
    "check_value",
    "document_fields",
    "field_help",
    "field_keys",
    "flatten_keys",
    "keep_count",
    "nest_keys",
    "renamed_key",
    "section_type",
    "setting",
]

# ---------------------------------------------------------------------- choice lists
DEFAULT_PRUNING_RATE = 0.875
METRICS = ("smallest", "largest", "random", "importance")
# metrics that take |A| as a magnitude: use_abs=False (signed A) makes no sense for them
MAGNITUDE_METRICS = ("importance",)
# metrics keep_mass can decide the count for: the kept set is the top of |A| (smallest) or a
# PPS sample of that size (importance); largest / random would not reach the mass
KEEP_MASS_METRICS = ("smallest", "importance")
SCOPES = ("group", "batch")
ADV_NORMS = ("std", "none")


# ---------------------------------------------------------------------- documented fields
def setting(default: Any, help: str, *, choices: tuple | None = None, check: str | None = None,
            fix: str | None = None, **kwargs: Any) -> Any:
    """A dataclass field whose metadata carries its help text (as TRL's configs do), and
    optionally its allowed values (``choices``), its range (``check``, a key of ``CHECKS``:
    ``"> 0"``, ``"[0, 1)"``, ...) and the hint an error about it ends with (``fix``):
    ``--help-recipe``, the generated class docstrings, the docs and the validation
    (``check_fields``) all read them from there. A field whose default is a dataclass built
    with ``setting`` (``default_factory=``) is a nested section."""
    metadata: dict[str, Any] = {"help": " ".join(help.split())}
    if choices is not None:
        metadata["choices"] = tuple(choices)
    if check is not None:
        if check not in CHECKS:
            raise ValueError(f"setting: check must be one of {list(CHECKS)}, got {check!r}")
        metadata["check"] = check
    if fix is not None:
        metadata["fix"] = " ".join(fix.split())
    if "default_factory" in kwargs:
        return dataclasses.field(metadata=metadata, **kwargs)
    return dataclasses.field(default=default, metadata=metadata, **kwargs)


# range checks a field's metadata can name, with the test each stands for and its words in errors
CHECKS = {
    "> 0": lambda v: v > 0,
    ">= 0": lambda v: v >= 0,
    ">= 1": lambda v: v >= 1,
    ">= 2": lambda v: v >= 2,
    "(0, 1]": lambda v: 0 < v <= 1,
    "[0, 1]": lambda v: 0 <= v <= 1,
    "[0, 1)": lambda v: 0 <= v < 1,
}
CHECK_WORDS = {check: (f"in {check}" if check[0] in "([" else check) for check in CHECKS}


def allowed_words(metadata: Mapping[str, Any]) -> str:
    """What a setting allows, in words, from its field metadata: its choices, else its check's words."""
    if metadata.get("choices"):
        return ", ".join(f"`{c}`" for c in metadata["choices"])
    return CHECK_WORDS[metadata["check"]] if metadata.get("check") else ""


def section_type(f: dataclasses.Field) -> type | None:
    """The dataclass of a nested section (a field whose default factory is a dataclass), else None."""
    factory = f.default_factory
    if factory is not dataclasses.MISSING and isinstance(factory, type) and dataclasses.is_dataclass(factory):
        return factory
    return None


def _simple_type(hint: Any) -> tuple[Any, bool]:
    """(base type, None allowed) of an annotation such as ``float`` or ``int | None``."""
    args = typing.get_args(hint)
    if args and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else None), True
    return hint, False


def _type_error(base: Any, value: Any) -> str | None:
    """What is wrong with ``value`` for a field of type ``base`` (bool, int, float, str), or None."""
    if base is bool and not isinstance(value, bool):
        return "must be true or false"
    if base is int and (isinstance(value, bool) or not isinstance(value, int)):
        return "must be an integer"
    if base is float and (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)):
        return "must be a finite number"
    if base is str and not isinstance(value, str):
        return "must be a string"
    return None


def check_value(name: str, value: Any, hint: Any, metadata: Mapping[str, Any]) -> None:
    """ValueError naming ``name``, ``value`` and the fix when ``value`` does not fit a field of
    annotation ``hint`` with ``metadata`` (``setting``'s choices, check, fix)."""
    fix = f"; {metadata['fix']}" if metadata.get("fix") else ""
    base, optional = _simple_type(hint)
    if value is None and optional:
        return
    check = metadata.get("check")
    words = f" {CHECK_WORDS[check]}" if check else ""
    problem = _type_error(base, value)
    if problem is not None:
        raise ValueError(f"{name} {problem}{words}, got {value!r}{fix}")
    choices = metadata.get("choices")
    if choices is not None and value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}{fix}")
    if check is not None and not CHECKS[check](value):
        raise ValueError(f"{name} must be{words}, got {value!r}{fix}")


def check_fields(obj: Any, where: str, *, label: str = "", skip: tuple[str, ...] = ()) -> None:
    """Check every field of the dataclass ``obj`` against its annotation and ``setting``
    metadata (``check_value``); a nested section by its own ``validate(name)`` when it has
    one (its rules that span keys), else field by field in turn. Errors name the key as
    ``label + where.field`` (``where`` empty: the bare field name); ``skip``: fields left out."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        if f.name in skip:
            continue
        name = f"{where}.{f.name}" if where else f.name
        value = getattr(obj, f.name)
        section = section_type(f)
        if section is None:
            check_value(f"{label}{name}", value, hints[f.name], f.metadata)
        elif not isinstance(value, section):
            raise ValueError(f"{label}{name} must be a section of {section.__name__} keys, got {value!r}")
        elif hasattr(value, "validate"):
            value.validate(name)
        else:
            check_fields(value, name, label=label)


def field_keys(cls: type, prefix: str = "") -> tuple[str, ...]:
    """Every leaf key of a dataclass built with ``setting``, dotted through its sections
    (``"pruning_rate"``, ..., ``"selective.enabled"``)."""
    out: list[str] = []
    for f in dataclasses.fields(cls):
        section = section_type(f)
        out += field_keys(section, f"{prefix}{f.name}.") if section else [f"{prefix}{f.name}"]
    return tuple(out)


def nest_keys(cls: type, values: Mapping[str, Any], *, where: str, renamed: Mapping[str, str] | None = None
              ) -> dict[str, Any]:
    """``values`` as the nested dict ``cls`` is built from: dotted keys (``"selective.p_min"``)
    and deprecated flat names (``renamed``: old -> new dotted key, a FutureWarning each) go into
    their sections, mappings for a section are nested in turn. An unknown key, or one given
    twice (old and new name), is a ValueError naming it and the known keys."""
    renamed = renamed or {}
    out: dict[str, Any] = {}
    given: dict[str, str] = {}  # dotted key -> the name it was given as
    sections = {f.name: section_type(f) for f in dataclasses.fields(cls)}
    for raw, value in values.items():
        key = str(raw)
        if key in renamed:
            warnings.warn(f"{where}.{key} is deprecated: write {where}.{renamed[key]} (same meaning)", FutureWarning,
                          stacklevel=3)
            key = renamed[key]
        head, _, rest = key.partition(".")
        if head not in sections or (rest and sections[head] is None):
            raise ValueError(f"{where}.{raw} is not a CPPO setting (unknown key); known keys: {list(field_keys(cls))}")
        if sections[head] is not None and (rest or isinstance(value, Mapping)):
            leaves = {rest: value} if rest else {str(k): v for k, v in value.items()}
            for leaf in leaves:
                dotted = f"{head}.{leaf}"
                if dotted in given:
                    raise ValueError(f"{where}: {given[dotted]} and {raw if rest else dotted} set the same key "
                                     f"{where}.{dotted}; keep one")
                given[dotted] = str(raw) if rest else dotted
            out.setdefault(head, {}).update(leaves)
            continue
        if key in given:
            raise ValueError(f"{where}: {given[key]} and {raw} set the same key {where}.{key}; keep one")
        given[key] = str(raw)
        out[key] = value
    for name, section in sections.items():
        if section is not None and isinstance(out.get(name), dict):
            out[name] = nest_keys(section, out[name], where=f"{where}.{name}")
    return out


def flatten_keys(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested mapping of keys as one flat dict of dotted leaf keys (``{"selective": {"enabled":
    True}}`` -> ``{"selective.enabled": True}``), in order; the inverse of ``nest_keys``."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, Mapping):
            out.update(flatten_keys(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def field_help(cls: type) -> dict[str, str]:
    """field name -> help text of a dataclass (or of an instance's class) built with ``setting``."""
    if not dataclasses.is_dataclass(cls):
        raise ValueError(f"field_help needs a dataclass type (e.g. CPPOConfig), got {cls!r}")
    return {f.name: f.metadata.get("help", "") for f in dataclasses.fields(cls)}


def document_fields(cls: type) -> type:
    """Append an ``Attributes:`` section built from the fields' help to ``cls.__doc__``,
    so ``help(cls)`` shows what ``--help-recipe`` shows, from the same text."""
    import textwrap

    lines = ["", "    Attributes:"]
    for f in dataclasses.fields(cls):
        default = f"{f.default!r}" if f.default is not dataclasses.MISSING else "(a section)"
        choices = f.metadata.get("choices")
        allowed = f", one of {'/'.join(map(str, choices))}" if choices else ""
        text = textwrap.fill(f"{f.name} (default {default}{allowed}): {f.metadata.get('help', '')}", width=88,
                             initial_indent="        ", subsequent_indent="            ")
        lines.append(text)
    cls.__doc__ = (cls.__doc__ or cls.__name__).rstrip() + "\n" + "\n".join(lines) + "\n"
    return cls


@document_fields
@dataclass
class SelectiveConfig:
    """Selective rollout (GRESO, Zheng et al., arXiv 2506.02177; beyond CPPO): the ``cppo.selective``
    section. Before generation each drawn prompt is skipped with probability
    1 - max(p_e ** z, 0.01), z = its consecutive zero-variance groups of one kind (all correct /
    all wrong) in earlier steps, and replaced by the next one (``core.selective``,
    docs/selective_rollout.md). The embedded trainer, veRL's V1 sync loop and OpenRLHF's
    synchronous loop run it.
    """

    enabled: bool = setting(False, """turn selective rollout on: skip prompts whose recent groups all had equal
        rewards and draw replacements, so a step still generates as many prompts (docs/selective_rollout.md). The
        other keys of this section are read only when it is on.""")
    target_zero_variance: float = setting(0.25, """alpha, the wanted share of zero-variance groups among those
        generated per step: alpha / 3 for all-correct, 2 alpha / 3 for all-wrong groups (the authors'
        target_zero_variance).""", check="[0, 1]", fix="the authors use 0.25")
    p_easy: float = setting(0.5, """initial exploration probability p_e for prompts whose last group was all
        correct (within [p_min, p_max]).""", check="(0, 1]",
        fix="0 would never explore a zero-variance prompt again")
    p_hard: float = setting(0.5, """initial exploration probability p_e for prompts whose last group was
        zero-variance and not all correct (within [p_min, p_max]).""", check="(0, 1]",
        fix="0 would never explore a zero-variance prompt again")
    step_size: float = setting(0.01, """how far p_easy and p_hard move after each step toward the target share (0
        keeps them fixed).""", check=">= 0", fix="0 keeps p_easy / p_hard fixed, the authors use 0.01")
    p_min: float = setting(0.05, """lower bound of p_easy and p_hard: every prompt keeps at least this chance per
        zero-variance generation of being explored.""", check="(0, 1]",
        fix="0 would never explore a zero-variance prompt again")
    p_max: float = setting(0.95, "upper bound of p_easy and p_hard.", check="(0, 1]")
    adapt_after_first_epoch: bool = setting(True, """true: p_easy and p_hard stay at their initial values until
        the first pass over the training prompts is complete, and adapt after every step that starts after it (the
        authors' trainer adapts from the second epoch); false: adapt after every step.""")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, where: str = "CPPOConfig.selective") -> SelectiveConfig:
        """Check every key (``check_fields``), then the bounds; ValueError naming ``where.key``."""
        check_fields(self, where)
        lo, hi = self.p_min, self.p_max
        if lo > hi:
            raise ValueError(f"{where}.p_min ({lo!r}) is larger than {where}.p_max ({hi!r}); swap them")
        for name in ("p_easy", "p_hard"):
            v = getattr(self, name)
            if not lo <= v <= hi:
                raise ValueError(f"{where}.{name} = {v!r} is outside [p_min, p_max] = [{lo!r}, {hi!r}]; set it "
                                 "inside the bounds (or widen them)")
        return self


# what the early-stop predictor sees of a prefix: the sampled tokens' log-probs (every engine), plus
# the per-token entropies (HF exactly, vLLM over its top log-probs), plus the policy's last hidden
# state at the boundary (the embedded trainer's HF engine only)
EARLY_STOP_FEATURE_SETS = ("logprob", "entropy", "hidden")
# how the group statistics treat a stopped completion (it has no reward): its expected reward
# under the predictor stands in (impute), or the statistics come from the finished ones alone
EARLY_STOP_ESTIMATORS = ("impute", "finished")


@document_fields
@dataclass
class EarlyStopConfig:
    """Early stopping inside the rollout engine ("prune as you generate"; after ARRoL, Xu et al.,
    arXiv 2603.24840; beyond CPPO): the ``cppo.early_stop`` section. Generation runs in segments of
    ``segment_tokens``; at each boundary an online predictor scores every completion of a group from
    what the engine hands out (token log-probs, entropies, hidden state), and the unfinished
    completions it expects to end in the group's majority outcome (the ones CPPO would prune after
    generation: the smallest |A|) are stopped, their remaining tokens never generated.
    ``core.early_stop`` holds the rule, the predictor and the estimator; docs/early_stopping.md says
    how to turn it on in each host and what it changes.

        cfg = CPPOConfig(pruning_rate=0.875, early_stop={"enabled": True, "segment_tokens": 16})
        cfg.early_stop.min_running_for(group_size=16, keep=2)   # -> 4
    """

    enabled: bool = setting(False, """stop completions inside the rollout engine. Needs pruning (P > 0 or
        keep_per_group < G) in group scope: the completions stopped are the ones CPPO would prune.""")
    segment_tokens: int = setting(16, """tokens generated between two decisions; the predictor scores every
        unfinished completion after each segment (16: a decision every 16 tokens).""", check="> 0")
    min_running: int | None = setting(None, """completions of each group that always run to their end
        (finished ones count); null: twice CPPO's kept count k per group, at most G (k = 2 of G = 16 -> 4), so
        the kept set is still chosen among several finished completions.""", check=">= 1")
    min_confidence: float = setting(0.6, """stop a completion only when the predictor gives it at least this
        probability, in [0.5, 1), of ending in its group's majority outcome (where |A| is small).""")
    estimator: str = setting("impute", """how a group's mean and std are formed when some of its completions
        were stopped (they have no reward). impute: a stopped completion's expected reward under the predictor
        stands in (mean unbiased, variance unbiased up to the std's square root, when the predictor is
        calibrated); finished: the statistics of the finished completions alone (ARRoL's survivors; biased
        toward their balance).""", choices=EARLY_STOP_ESTIMATORS)
    explore_share: float = setting(0.125, """share of each round's groups generated in full, without stopping
        (seeded): their outcomes train the predictor without the selection bias of stopping, and its AUC and
        calibration are measured on them.""", check="[0, 1]")
    features: str = setting("logprob", """what the predictor sees of a prefix. logprob: the sampled tokens'
        log-probs (every engine); entropy: also the per-token entropies (HF exactly; vLLM over its top 20
        log-probs; not in veRL); hidden: also the policy's last hidden state at the boundary (the embedded
        trainer's HF engine only).""", choices=EARLY_STOP_FEATURE_SETS)
    history_steps: int = setting(4, """the predictor is fitted after each step on the finished completions of
        this many previous steps (never the current step's, before its decisions are made).""", check="> 0")
    min_examples: int = setting(64, """nothing is stopped until the predictor has seen this many finished
        completions of each outcome (success and failure) in its history.""", check="> 0")
    l2: float = setting(1.0, """ridge penalty of the predictor's logistic regression (on standardised
        features).""", check=">= 0")
    success_threshold: float = setting(0.5, """a completion succeeds when its reward is at least this (the
        outcome the predictor predicts; 0.5 for 0/1 rewards and for correct + format rewards).""")
    timeout_s: float = setting(600.0, """veRL and OpenRLHF: seconds a group's coordinator waits for its members at a
        boundary before it lets every member run on (a member that died must not hang the step).""",
        check="> 0")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, where: str = "CPPOConfig.early_stop") -> EarlyStopConfig:
        """Check every key (``check_fields``), then min_confidence's half-open range; ValueError
        naming ``where.key`` and the bad value."""
        check_fields(self, where)
        if not 0.5 <= self.min_confidence < 1.0:
            raise ValueError(f"{where}.min_confidence must be in [0.5, 1), got {self.min_confidence!r}: "
                             "below 0.5 a completion would be stopped although it more likely ends in the minority")
        return self

    def check_with(self, *, is_grpo: bool, scope: str, keep_mass: float | None, dynamic_sampling: bool = False,
                   selective: bool = False) -> None:
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
        for name, on in (("dynamic_sampling", dynamic_sampling), ("selective.enabled", selective)):
            if on:
                raise ValueError(f"cppo.early_stop does not combine with cppo.{name}: both read every completion's "
                                 "reward of a group, and a stopped completion has none; turn one of them off")

    def min_running_for(self, group_size: int, keep: int) -> int:
        """Completions of a group of ``group_size`` that run to the end: ``min_running`` (default
        2 ``keep``), at least ``keep`` (CPPO's k) and at most ``group_size``."""
        want = 2 * keep if self.min_running is None else self.min_running
        return max(keep, min(group_size, want))


@document_fields
@dataclass
class TwoWaveConfig:
    """Adaptive group size in two waves (a cheap baseline beside early stopping; beyond CPPO): the
    ``cppo.two_wave`` section. Each drawn prompt first gets ``first_wave`` = k completions; only the
    groups whose k rewards differ (spread > ``min_spread``) get the other G - k, in the same step. A
    group whose first wave agreed stays at k completions: its advantages would all be 0, so it is not
    trained on and is counted as unfinished (with its k completions, generated and dropped).
    ``core.two_wave`` holds the rule and the accounting; docs/early_stopping.md ("Two waves") states
    the estimator and its bias. P = 0 with two waves is the GRPO baseline arm.

        cfg = CPPOConfig(pruning_rate=0.0, two_wave={"enabled": True, "first_wave": 4})
        cfg.two_wave.first_wave_for(group_size=16)   # -> 4
    """

    enabled: bool = setting(False, """generate each group in two waves: k completions per prompt, then the other
        G - k only for the groups whose first wave shows reward variance (the embedded trainer, backend=hf).""")
    first_wave: int | None = setting(None, """k, completions per prompt in the first wave, 2 <= k < G; null: G / 4
        (at least 2: 16 -> 4). A group of k equal rewards is left unfinished.""", check=">= 2",
        fix="one completion never shows reward variance, so no group would be finished")
    min_spread: float = setting(0.0, """a group is finished when the spread (max - min) of its first-wave rewards
        is larger than this; 0: any difference. With correct + format rewards, 0.5 ignores groups that differ
        in format alone.""", check=">= 0")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, where: str = "CPPOConfig.two_wave") -> TwoWaveConfig:
        """Check every key (``check_fields``); ValueError naming ``where.key``."""
        check_fields(self, where)
        return self

    def check_with(self, *, early_stop: bool, selective: bool) -> None:
        """The rules that span the CPPO settings (``CPPOConfig.validate`` calls it)."""
        if not self.enabled:
            return
        for name, on in (("early_stop.enabled", early_stop), ("selective.enabled", selective)):
            if on:
                raise ValueError(f"cppo.two_wave does not combine with cppo.{name}: each decides from a group's "
                                 "rewards which completions to generate; turn one of them off")

    def first_wave_for(self, group_size: int) -> int:
        """k for groups of ``group_size`` completions: ``first_wave`` (default G / 4, at least 2); a
        ValueError naming the key when k >= G (the second wave would generate nothing)."""
        check_int("group_size", group_size, minimum=1)
        k = max(2, group_size // 4) if self.first_wave is None else self.first_wave
        if k >= group_size:
            raise ValueError(f"cppo.two_wave.first_wave={k} must be smaller than rollout.group_size={group_size}: "
                             f"the second wave generates G - k completions; use 2 <= k < {group_size}")
        return k


@document_fields
@dataclass
class CPPOConfig:
    """Completion pruning (CPPO) settings.

    Every field's documentation is its ``help`` metadata (listed below, and by
    ``cppo-megatron train --help-recipe cppo``). Each checked key states its type, choices or
    range in that metadata (``setting``); ``validate`` checks them all, then the rules that
    span keys. A nested section (``selective``) is a dataclass of the same kind.
    """

    pruning_rate: float | None = setting(None, """P in [0, 1), the fraction of completions dropped before the
        old-policy / reference / update passes. P = 0 is plain GRPO, through the same code path. Leave unset
        (null) together with keep_per_group to get DEFAULT_PRUNING_RATE = 0.875 (paper: 16 -> 2 completions per
        prompt).""", check="[0, 1)", fix="P=1 would prune every completion; use P=0 for plain GRPO")
    keep_per_group: int | None = setting(None, """k, an alternative to pruning_rate: keep exactly k completions
        of every group (scope=group) or k * num_groups across the batch (scope=batch). Set either this or
        pruning_rate, not both.""", check=">= 1")
    keep_mass: float | None = setting(None, """f in (0, 1], an adaptive alternative to pruning_rate /
        keep_per_group (beyond the paper): per group keep the fewest completions whose A^2 reaches f of the group's
        A^2 total (scope=batch: of the batch's); zero-variance groups keep none. A^2, not |A|: if the completions'
        score-function gradients are roughly orthogonal and of similar norm, the squared norm of a group's policy
        gradient is proportional to sum A_i^2, so f is the share of gradient energy kept (relative norm error
        about sqrt(1 - f)); |A| mass would make a 1-of-16 group need 8 completions to reach f = 0.5 although its
        single correct answer carries 94% of the A^2. With allocation the planner draws prompts in fill rounds
        until the survivors fill the update capacity. Works with metric smallest (top-k_g by |A|) or importance
        (a PPS sample of k_g).""", check="(0, 1]")
    metric: str = setting("smallest", """which completions to prune. smallest (CPPO):
        prune the smallest score, keep the completions whose advantage teaches the most. largest: prune the
        largest score (the paper's worst ablation). random: prune uniformly at random (seeded). importance
        (beyond the paper): keep exactly k by randomised systematic sampling with inclusion probabilities pi
        proportional to |A| (capped at 1) and weight each survivor's loss by 1/pi, an unbiased
        (Horvitz-Thompson) estimate of the full-group loss (core.sampling).""", choices=METRICS)
    use_abs: bool = setting(True, """score = |A| when true (CPPO). false scores by the signed advantage A, the
        paper's "raw advantage" ablation (keeps the best completions, drops the worst).""")
    scope: str = setting("group", """group keeps k = floor(G (1 - P)) per prompt, as
        the paper's text says. batch keeps the top floor(N (1 - P)) across the whole batch, as the released code
        does with allocation on; the kept count per prompt then varies from 0 to G and all-zero-advantage groups
        vanish entirely.""", choices=SCOPES)
    adv_norm: str = setting("std", """std gives A = (r - mean) / (std + eps) over the full group
        (GRPO); none gives A = r - mean (Dr. GRPO).""", choices=ADV_NORMS)
    eps: float = setting(1e-6, "added to the group std. 1e-6 as in veRL; the paper's TRL fork used 1e-4.",
                         check=">= 0")
    allocation: bool = setting(True, """dynamic completion allocation. When true, prompts per step grow by
        1 / (1 - P) so the survivors fill the update capacity (steps per epoch shrink by (1 - P)); when false the
        same prompts are drawn and fewer completions train.""")
    dynamic_sampling: bool = setting(False, """DAPO-style: drop groups whose rewards are all equal (they carry no
        signal) and draw replacement prompts, up to max_refill_rounds extra rounds.""")
    max_refill_rounds: int = setting(3, "bound on the refill rounds of dynamic_sampling per step.", check=">= 0")
    rebalance: bool = setting(True, """redistribute the survivors across data-parallel ranks so the largest rank
        workload is minimal (core.balance).""")
    equal_size: bool = setting(False, """when rebalancing, give every rank the same number of sequences (needed by
        pipelines that split a batch into equal chunks).""")
    workload_linear: float = setting(24576.0, """a in the per-sequence workload model a * len + b * len**2 (the
        defaults match veRL's _balance_batch so the two balancers are compared on the same objective).""",
        check=">= 0")
    workload_quadratic: float = setting(1.0, "b in that workload model.", check=">= 0")
    seed: int = setting(0, """decides every random choice: tie-breaks between equal scores and the random metric.
        Combined with the step number, so choices differ between steps but are identical on every rank.""")
    selective: SelectiveConfig = setting(None, """selective rollout (GRESO, beyond CPPO): skip prompts before
        generation whose recent groups all had equal rewards (cppo.selective.enabled; docs/selective_rollout.md).
        The embedded trainer, veRL's V1 sync loop and OpenRLHF's synchronous loop run it.""",
        default_factory=SelectiveConfig)
    early_stop: EarlyStopConfig = setting(None, """early stopping inside the rollout engine (beyond CPPO): stop,
        while they generate, the completions CPPO would prune (cppo.early_stop.enabled; docs/early_stopping.md).""",
        default_factory=EarlyStopConfig)
    two_wave: TwoWaveConfig = setting(None, """adaptive group size in two waves (a baseline beside early stopping):
        k completions per prompt first, the rest only where they show reward variance (cppo.two_wave.enabled;
        docs/early_stopping.md, "Two waves").""", default_factory=TwoWaveConfig)

    def __post_init__(self) -> None:
        build_sections(self, "cppo")  # CPPOConfig(**cfg.to_dict()), CPPOConfig(selective={"enabled": True})
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self, where: str = "CPPOConfig") -> CPPOConfig:
        """Check every key against its metadata (``check_fields``: type, choices, range; the
        ``selective`` section by its own ``validate``), then the rules that span keys; raise
        ValueError naming the key, the bad value and the fix."""
        check_fields(self, where)
        if self.pruning_rate is not None and self.keep_per_group is not None:
            raise ValueError(f"{where}: set either pruning_rate ({self.pruning_rate}) or keep_per_group "
                             f"({self.keep_per_group}), not both")
        if self.keep_mass is not None:
            if self.pruning_rate is not None or self.keep_per_group is not None:
                raise ValueError(f"{where}: keep_mass={self.keep_mass} decides the count per group itself; unset "
                                 f"pruning_rate ({self.pruning_rate}) and keep_per_group ({self.keep_per_group})")
            if self.metric not in KEEP_MASS_METRICS:
                raise ValueError(f"{where}: keep_mass works with metric in {list(KEEP_MASS_METRICS)}, got "
                                 f"metric={self.metric!r}")
        if self.metric in MAGNITUDE_METRICS and self.use_abs is False:
            raise ValueError(f"{where}: metric={self.metric!r} samples in proportion to |A|; set use_abs=true")
        if self.workload_linear == 0 and self.workload_quadratic == 0:
            raise ValueError(f"{where}: workload_linear and workload_quadratic are both 0")
        self.early_stop.check_with(is_grpo=self.is_grpo, scope=self.scope, keep_mass=self.keep_mass,
                                   dynamic_sampling=self.dynamic_sampling, selective=self.selective.enabled)
        self.two_wave.check_with(early_stop=self.early_stop.enabled, selective=self.selective.enabled)
        return self

    # ------------------------------------------------------------------ derived values
    @property
    def rate(self) -> float:
        """The configured pruning rate (ignores keep_per_group; see ``rate_for_group``)."""
        return DEFAULT_PRUNING_RATE if self.pruning_rate is None else float(self.pruning_rate)

    @property
    def is_grpo(self) -> bool:
        """True when nothing is pruned (P = 0): the run is plain GRPO."""
        return self.keep_per_group is None and self.keep_mass is None and self.rate == 0.0

    def keep_for_group(self, group_size: int) -> int:
        """k for a group of ``group_size`` completions: floor(G (1 - P)), at least 1.

        With ``keep_per_group`` set, that k; a group smaller than k is an error. With
        ``keep_mass`` there is no fixed k (it is decided per group from the advantages).
        """
        if self.keep_mass is not None:
            raise ValueError(
                f"keep_mass={self.keep_mass} has no fixed k per group: the count is decided per group "
                "from the advantages (this host needs pruning_rate or keep_per_group)"
            )
        return keep_count(group_size, self.pruning_rate, self.keep_per_group)

    def rate_for_group(self, group_size: int) -> float:
        """The effective pruning rate 1 - k/G for groups of ``group_size`` completions."""
        return 1.0 - self.keep_for_group(group_size) / group_size

    def noop_reason(self, group_size: int) -> str | None:
        """Why this config, which asks for pruning (P > 0 or keep_per_group), cannot prune
        anything useful in groups of ``group_size`` completions; None when it can (or P = 0).

        G = 1: a lone completion's advantage is 0, nothing tells survivors apart. k >= G
        (group scope): every completion is kept. Launchers print it as a warning.
        """
        if self.is_grpo or self.keep_mass is not None:  # keep_mass: k is decided per group at run time
            return None
        what = f"keep_per_group={self.keep_per_group}" if self.keep_per_group is not None else f"P={self.rate:g}"
        if group_size == 1:
            return (f"{what} with G=1 completion per prompt: every advantage is 0, so pruning has no signal "
                    "and keeps 1 of G=1 in group scope")
        k = self.keep_for_group(group_size)
        if self.scope == "group" and k >= group_size:
            return f"{what} keeps {k} of G={group_size} completions per prompt: nothing is pruned"
        return None

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> CPPOConfig:
        """Build from a mapping of keys: nested (``{"selective": {"enabled": True}}``), dotted
        (``{"selective.enabled": True}``) or a deprecated flat name (``RENAMED``, a FutureWarning
        naming the new key). Unknown keys are errors (no silent typos)."""
        if not isinstance(values, Mapping):
            raise ValueError(f"CPPOConfig.from_dict expects a mapping, got {type(values).__name__}")
        return _build(cls, nest_keys(cls, values, where="cppo", renamed=RENAMED))

    @classmethod
    def from_omegaconf(cls, node: Any) -> CPPOConfig:
        """Build from an omegaconf node (DictConfig, structured or not). A DictConfig is a
        ``Mapping`` whose item access resolves interpolations, so this reads it as one (the
        core imports no omegaconf)."""
        if not isinstance(node, Mapping):
            raise ValueError(f"CPPOConfig.from_omegaconf expects a DictConfig or mapping, got {type(node).__name__}")
        return cls.from_dict({str(k): node[k] for k in node})

    def to_dict(self) -> dict:
        """Every key, sections as nested dicts (``from_dict`` reads it back)."""
        return dataclasses.asdict(self)

    def describe(self) -> str:
        """One line for logs: the settings a reader needs to interpret a run."""
        if self.keep_mass is not None:
            what = f"keep_mass={self.keep_mass:g}"
        elif self.keep_per_group is not None:
            what = f"keep_per_group={self.keep_per_group}"
        else:
            what = f"pruning_rate={self.rate:g}"
        return (
            f"CPPO {what} metric={self.metric} use_abs={self.use_abs} scope={self.scope} "
            f"adv_norm={self.adv_norm} eps={self.eps:g} allocation={self.allocation} "
            f"dynamic_sampling={self.dynamic_sampling} seed={self.seed}"
            + (" selective.enabled=True" if self.selective.enabled else "")
            + (f" early_stop(segment={self.early_stop.segment_tokens}, estimator={self.early_stop.estimator})"
               if self.early_stop.enabled else "")
            + (f" two_wave(first_wave={self.two_wave.first_wave}, min_spread={self.two_wave.min_spread:g})"
               if self.two_wave.enabled else "")
        )


def build_sections(obj: Any, where: str) -> None:
    """Replace each nested section of the dataclass ``obj`` given as a mapping (``to_dict``'s form)
    by the section's dataclass built from it (``nest_keys``: unknown keys are errors)."""
    for f in dataclasses.fields(obj):
        section, value = section_type(f), getattr(obj, f.name)
        if section is not None and isinstance(value, Mapping):
            setattr(obj, f.name, _build(section, nest_keys(section, value, where=f"{where}.{f.name}")))


def _build(cls: type, values: Mapping[str, Any]) -> Any:
    """``cls(**values)`` with each nested section's mapping built first (``nest_keys`` output)."""
    kwargs = dict(values)
    for f in dataclasses.fields(cls):
        section = section_type(f)
        if section is not None and isinstance(kwargs.get(f.name), Mapping):
            kwargs[f.name] = _build(section, kwargs[f.name])
    return cls(**kwargs)


FIELD_NAMES = tuple(f.name for f in dataclasses.fields(CPPOConfig))
# every key of a cppo section, dotted through its sections ("selective.enabled")
CONFIG_KEYS = field_keys(CPPOConfig)
# the keys read only when selective rollout is on (a host warns when one is set while it is off)
SELECTIVE_PARAMETERS = tuple(k for k in CONFIG_KEYS if k.startswith("selective.") and k != "selective.enabled")
# deprecated flat names of the selective section's keys (before it was a section), read with a FutureWarning
RENAMED = {"selective_rollout": "selective.enabled",
           **{f"selective_{k.split('.', 1)[1]}": k for k in SELECTIVE_PARAMETERS}}


def renamed_key(key: str) -> str | None:
    """The current name of a deprecated flat cppo key (``"selective_rollout"`` -> ``"selective.enabled"``),
    None for any other key."""
    return RENAMED.get(key)


def check_config(cfg: object) -> CPPOConfig:
    """``cfg`` itself, when it is a valid ``CPPOConfig``; otherwise TypeError / ValueError
    naming the problem. (Fields can be reassigned after construction, so validate again.)"""
    if not isinstance(cfg, CPPOConfig):
        raise TypeError(
            f"cfg must be a cppo_megatron.config.CPPOConfig, got {type(cfg).__name__}; build one with "
            "CPPOConfig(...) or CPPOConfig.from_dict(...)"
        )
    return cfg.validate()


# floor(G * (1 - P)) with this slack, so that 16 * (1 - 0.875) -> 2 even if it is 1.999...
K_TOLERANCE = 1e-6


def keep_count(group_size: int, pruning_rate: float | None, keep_per_group: int | None) -> int:
    """k for a group of ``group_size``: floor(G (1 - P)) (at least 1), or ``keep_per_group``.

    ``pruning_rate=None`` and ``keep_per_group=None`` means the default rate 0.875.
    Returns k, an int in [1, group_size]; ``keep_per_group > group_size`` is an error.
    """
    check_int("group_size", group_size, minimum=1)
    if keep_per_group is not None:
        check_int("keep_per_group", keep_per_group, minimum=1)
        if keep_per_group > group_size:
            raise ValueError(
                f"keep_per_group={keep_per_group} is larger than a group of {group_size} completions"
            )
        return keep_per_group
    p = DEFAULT_PRUNING_RATE if pruning_rate is None else pruning_rate
    _check_rate(p)
    return max(1, math.floor(group_size * (1.0 - p) + K_TOLERANCE))


def _check_rate(p: Any) -> float:
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0.0 <= p < 1.0):
        raise ValueError(f"pruning_rate must be a number in [0, 1), got {p!r}")
    return float(p)

