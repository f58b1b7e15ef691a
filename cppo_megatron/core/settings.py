"""The CPPO settings type the core functions take, and the choice lists its fields allow.

Every decision where the CPPO paper (arXiv 2503.22342) and its released code differ is a
field here, not a fork in the code. It lives in the core (and imports nothing of ours
outside it) so the core stands on its own; ``cppo_megatron.config`` re-exports it as the
recipe-level ``CPPOConfig``. The dataclass works as a plain Python object and as an
omegaconf structured config::

    cfg = CPPOConfig(pruning_rate=0.875)
    cfg = CPPOConfig.from_dict({"keep_per_group": 2, "scope": "batch"})
    schema = OmegaConf.structured(CPPOConfig)          # type-checked YAML / dotlist merges
    cfg = CPPOConfig.from_omegaconf(OmegaConf.merge(schema, user_yaml))

``setting`` / ``document_fields`` / ``field_help`` build TRL-style documented dataclass
fields (help text in the field metadata); the recipe schema (``trainer.config``) uses them
too.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ._checks import check_int
from .early_stop_settings import EarlyStopConfig

__all__ = [
    "ADV_NORMS",
    "CHECKS",
    "CPPOConfig",
    "DEFAULT_PRUNING_RATE",
    "FIELD_NAMES",
    "KEEP_MASS_METRICS",
    "MAGNITUDE_METRICS",
    "METRICS",
    "SCOPES",
    "SELECTIVE_PARAMETERS",
    "check_config",
    "document_fields",
    "field_help",
    "keep_count",
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
            **kwargs: Any) -> Any:
    """A dataclass field whose metadata carries its help text (as TRL's configs do), and
    optionally its allowed values (``choices``) or range (``check``: ``"> 0"``, ``">= 0"``
    or ``"(0, 1]"``): ``--help-recipe``, the generated class docstrings, the docs and the
    recipe validation all read them from there."""
    metadata: dict[str, Any] = {"help": " ".join(help.split())}
    if choices is not None:
        metadata["choices"] = tuple(choices)
    if check is not None:
        if check not in CHECKS:
            raise ValueError(f"setting: check must be one of {list(CHECKS)}, got {check!r}")
        metadata["check"] = check
    if "default_factory" in kwargs:
        return dataclasses.field(metadata=metadata, **kwargs)
    return dataclasses.field(default=default, metadata=metadata, **kwargs)


# range checks a field's metadata can name, with the test each stands for
CHECKS = {
    "> 0": lambda v: v > 0,
    ">= 0": lambda v: v >= 0,
    "(0, 1]": lambda v: 0 < v <= 1,
}


def field_help(cls: type) -> dict[str, str]:
    """field name -> help text of a dataclass built with ``setting``."""
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


# the cppo.early_stop section: its own dataclass in its own module (which imports nothing of ours)
document_fields(EarlyStopConfig)


@document_fields
@dataclass
class CPPOConfig:
    """Completion pruning (CPPO) settings.

    Every field's documentation is its ``help`` metadata (listed below, and by
    ``cppo-megatron train --help-recipe cppo``).
    """

    pruning_rate: float | None = setting(None, """P in [0, 1), the fraction of completions dropped before the
        old-policy / reference / update passes. P = 0 is plain GRPO, through the same code path. Leave unset
        (null) together with keep_per_group to get DEFAULT_PRUNING_RATE = 0.875 (paper: 16 -> 2 completions per
        prompt).""")
    keep_per_group: int | None = setting(None, """k, an alternative to pruning_rate: keep exactly k completions
        of every group (scope=group) or k * num_groups across the batch (scope=batch). Set either this or
        pruning_rate, not both.""")
    keep_mass: float | None = setting(None, """f in (0, 1], an adaptive alternative to pruning_rate /
        keep_per_group (beyond the paper): per group keep the fewest completions whose A^2 reaches f of the group's
        A^2 total (scope=batch: of the batch's); zero-variance groups keep none. A^2, not |A|: if the completions'
        score-function gradients are roughly orthogonal and of similar norm, the squared norm of a group's policy
        gradient is proportional to sum A_i^2, so f is the share of gradient energy kept (relative norm error
        about sqrt(1 - f)); |A| mass would make a 1-of-16 group need 8 completions to reach f = 0.5 although its
        single correct answer carries 94% of the A^2. With allocation the planner draws prompts in fill rounds
        until the survivors fill the update capacity. Works with metric smallest (top-k_g by |A|) or importance
        (a PPS sample of k_g).""")
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
    eps: float = setting(1e-6, "added to the group std. 1e-6 as in veRL; the paper's TRL fork used 1e-4.")
    allocation: bool = setting(True, """dynamic completion allocation. When true, prompts per step grow by
        1 / (1 - P) so the survivors fill the update capacity (steps per epoch shrink by (1 - P)); when false the
        same prompts are drawn and fewer completions train.""")
    dynamic_sampling: bool = setting(False, """DAPO-style: drop groups whose rewards are all equal (they carry no
        signal) and draw replacement prompts, up to max_refill_rounds extra rounds.""")
    max_refill_rounds: int = setting(3, "bound on the refill rounds of dynamic_sampling per step.")
    rebalance: bool = setting(True, """redistribute the survivors across data-parallel ranks so the largest rank
        workload is minimal (core.balance).""")
    equal_size: bool = setting(False, """when rebalancing, give every rank the same number of sequences (needed by
        pipelines that split a batch into equal chunks).""")
    workload_linear: float = setting(24576.0, """a in the per-sequence workload model a * len + b * len**2 (the
        defaults match veRL's _balance_batch so the two balancers are compared on the same objective).""")
    workload_quadratic: float = setting(1.0, "b in that workload model.")
    seed: int = setting(0, """decides every random choice: tie-breaks between equal scores and the random metric.
        Combined with the step number, so choices differ between steps but are identical on every rank.""")
    selective_rollout: bool = setting(False, """selective rollout (GRESO, arXiv 2506.02177; beyond CPPO): before
        generation, skip each drawn prompt with probability 1 - max(p_e ** z, 0.01), z = its consecutive zero-variance
        groups of one kind (all correct / all wrong) in earlier steps, and draw replacements so the step still
        generates as many prompts (docs/selective_rollout.md).
        Embedded trainer only: veRL and OpenRLHF runs refuse it.""")
    selective_target_zero_variance: float = setting(0.25, """alpha in [0, 1], the wanted share of zero-variance groups
        among those generated per step: alpha / 3 for all-correct, 2 alpha / 3 for all-wrong groups (the authors'
        target_zero_variance). Read only with selective_rollout.""")
    selective_p_easy: float = setting(0.5, """initial exploration probability p_e in (0, 1] for prompts whose last
        group was all correct (within [selective_p_min, selective_p_max]). Read only with selective_rollout.""")
    selective_p_hard: float = setting(0.5, """initial exploration probability p_e in (0, 1] for prompts whose last
        group was zero-variance and not all correct. Read only with selective_rollout.""")
    selective_step_size: float = setting(0.01, """>= 0, how far p_easy and p_hard move after each step toward the
        target share (0 keeps them fixed). Read only with selective_rollout.""")
    selective_p_min: float = setting(0.05, """lower bound in (0, 1] of p_easy and p_hard: every prompt keeps at least
        this chance per zero-variance generation of being explored. Read only with selective_rollout.""")
    selective_p_max: float = setting(0.95, """upper bound in (0, 1] of p_easy and p_hard. Read only with
        selective_rollout.""")
    selective_adapt_after_first_epoch: bool = setting(True, """true: p_easy and p_hard stay at their initial values
        until the first pass over the training prompts is complete, and adapt after every step that starts after it
        (the authors' trainer adapts from the second epoch); false: adapt after every step. Read only with
        selective_rollout.""")
    early_stop: EarlyStopConfig = setting(None, """early stopping inside the rollout engine (beyond CPPO): the
        cppo.early_stop section (core.early_stop_settings.EarlyStopConfig, docs/early_stopping.md).""",
        default_factory=EarlyStopConfig)

    def __post_init__(self) -> None:
        if isinstance(self.early_stop, Mapping):  # a nested mapping (from_dict, a YAML section)
            self.early_stop = EarlyStopConfig.from_dict(self.early_stop)
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> CPPOConfig:
        """Check every field; raise ValueError naming the field and the bad value."""
        if self.pruning_rate is not None and self.keep_per_group is not None:
            raise ValueError(
                f"CPPOConfig: set either pruning_rate ({self.pruning_rate}) or keep_per_group "
                f"({self.keep_per_group}), not both"
            )
        if self.pruning_rate is not None:
            p = self.pruning_rate
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not math.isfinite(p):
                raise ValueError(f"CPPOConfig.pruning_rate must be a number in [0, 1), got {p!r}")
            if not 0.0 <= p < 1.0:
                raise ValueError(
                    f"CPPOConfig.pruning_rate must be in [0, 1), got {p!r} "
                    "(P=1 would prune every completion; use P=0 for plain GRPO)"
                )
        if self.keep_per_group is not None:
            k = self.keep_per_group
            if isinstance(k, bool) or not isinstance(k, int) or k < 1:
                raise ValueError(f"CPPOConfig.keep_per_group must be an integer >= 1, got {k!r}")
        _check_choice("metric", self.metric, METRICS)
        if self.keep_mass is not None:
            f = self.keep_mass
            if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 < f <= 1.0:
                raise ValueError(f"CPPOConfig.keep_mass must be a number in (0, 1], got {f!r}")
            if self.pruning_rate is not None or self.keep_per_group is not None:
                raise ValueError(
                    f"CPPOConfig: keep_mass={f} decides the count per group itself; unset pruning_rate "
                    f"({self.pruning_rate}) and keep_per_group ({self.keep_per_group})"
                )
            if self.metric not in KEEP_MASS_METRICS:
                raise ValueError(
                    f"CPPOConfig: keep_mass works with metric in {list(KEEP_MASS_METRICS)}, got "
                    f"metric={self.metric!r}"
                )
        if self.metric in MAGNITUDE_METRICS and self.use_abs is False:
            raise ValueError(
                f"CPPOConfig: metric={self.metric!r} samples in proportion to |A|; set use_abs=true"
            )
        _check_choice("scope", self.scope, SCOPES)
        _check_choice("adv_norm", self.adv_norm, ADV_NORMS)
        for name in ("use_abs", "allocation", "dynamic_sampling", "rebalance", "equal_size"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"CPPOConfig.{name} must be true or false, got {getattr(self, name)!r}")
        if not (isinstance(self.eps, (int, float)) and math.isfinite(self.eps) and self.eps >= 0):
            raise ValueError(f"CPPOConfig.eps must be a finite number >= 0, got {self.eps!r}")
        if not isinstance(self.max_refill_rounds, int) or self.max_refill_rounds < 0:
            raise ValueError(
                f"CPPOConfig.max_refill_rounds must be an integer >= 0, got {self.max_refill_rounds!r}"
            )
        for name in ("workload_linear", "workload_quadratic"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"CPPOConfig.{name} must be a finite number >= 0, got {v!r}")
        if self.workload_linear == 0 and self.workload_quadratic == 0:
            raise ValueError("CPPOConfig: workload_linear and workload_quadratic are both 0")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"CPPOConfig.seed must be an integer, got {self.seed!r}")
        self._validate_selective()
        if not isinstance(self.early_stop, EarlyStopConfig):
            raise ValueError(f"CPPOConfig.early_stop must be a section of early_stop keys, got {self.early_stop!r}")
        self.early_stop.validate().check_with(is_grpo=self.is_grpo, scope=self.scope, keep_mass=self.keep_mass,
                                              dynamic_sampling=self.dynamic_sampling,
                                              selective_rollout=self.selective_rollout)
        return self

    def _validate_selective(self) -> None:
        for name in ("selective_rollout", "selective_adapt_after_first_epoch"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"CPPOConfig.{name} must be true or false, got {getattr(self, name)!r}")
        alpha = self.selective_target_zero_variance
        if not _finite(alpha) or not 0.0 <= alpha <= 1.0:
            raise ValueError(
                f"CPPOConfig.selective_target_zero_variance must be a share in [0, 1], got {alpha!r}; "
                "the authors use 0.25"
            )
        step = self.selective_step_size
        if not _finite(step) or step < 0:
            raise ValueError(
                f"CPPOConfig.selective_step_size must be a finite number >= 0, got {step!r}; 0 keeps "
                "p_easy / p_hard fixed, the authors use 0.01"
            )
        for name in ("selective_p_min", "selective_p_max", "selective_p_easy", "selective_p_hard"):
            v = getattr(self, name)
            if not _finite(v) or not 0.0 < v <= 1.0:
                raise ValueError(
                    f"CPPOConfig.{name} must be a probability in (0, 1], got {v!r}: 0 would never explore a "
                    "zero-variance prompt again"
                )
        lo, hi = self.selective_p_min, self.selective_p_max
        if lo > hi:
            raise ValueError(
                f"CPPOConfig.selective_p_min ({lo!r}) is larger than selective_p_max ({hi!r}); swap them"
            )
        for name in ("selective_p_easy", "selective_p_hard"):
            v = getattr(self, name)
            if not lo <= v <= hi:
                raise ValueError(
                    f"CPPOConfig.{name} = {v!r} is outside [selective_p_min, selective_p_max] = [{lo!r}, {hi!r}]; "
                    "set it inside the bounds (or widen them)"
                )

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
        """Build from a mapping; unknown keys are errors (no silent typos)."""
        if not isinstance(values, Mapping):
            raise ValueError(f"CPPOConfig.from_dict expects a mapping, got {type(values).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"CPPOConfig: unknown key(s) {unknown}; known keys: {sorted(known)}")
        return cls(**dict(values))

    @classmethod
    def from_omegaconf(cls, node: Any) -> CPPOConfig:
        """Build from an omegaconf node (DictConfig, structured or not). A DictConfig is a
        ``Mapping`` whose item access resolves interpolations, so this reads it as one (the
        core imports no omegaconf)."""
        if not isinstance(node, Mapping):
            raise ValueError(f"CPPOConfig.from_omegaconf expects a DictConfig or mapping, got {type(node).__name__}")
        return cls.from_dict({str(k): node[k] for k in node})

    def to_dict(self) -> dict:
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
            + (" selective_rollout=True" if self.selective_rollout else "")
            + (f" early_stop(segment={self.early_stop.segment_tokens}, estimator={self.early_stop.estimator})"
               if self.early_stop.enabled else "")
        )


def _finite(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)


def _check_choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"CPPOConfig.{name} must be one of {list(choices)}, got {value!r}")


FIELD_NAMES = tuple(f.name for f in dataclasses.fields(CPPOConfig))
# the fields read only with selective_rollout (a host that refuses it warns when one is changed)
SELECTIVE_PARAMETERS = tuple(n for n in FIELD_NAMES if n.startswith("selective_") and n != "selective_rollout")


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

