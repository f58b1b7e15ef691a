"""Dynamic completion allocation and prompt accounting.

Pruning leaves the update passes a fraction (1 - P) of the work; allocation draws more
prompts per step so the survivors fill the same capacity. The number of prompts per step
is capacity / survivors-per-prompt, which is rarely an integer: the fractional remainder
is carried across steps (exact rational arithmetic), so after S steps exactly
floor(S * capacity / survivors-per-prompt) prompts have been planned.

Every prompt drawn ends a step in exactly one of three bins: trained (at least one
completion survived), fully pruned (all its completions pruned), or dropped (dynamic
sampling removed its zero-variance group before selection). ``end_step`` checks this, so
nothing is lost silently, and ``state_dict`` carries it across restarts.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import torch

from ._checks import check_int
from .selection import Selection
from .settings import DEFAULT_PRUNING_RATE, check_config, keep_count

if TYPE_CHECKING:
    from .settings import CPPOConfig

__all__ = ["AllocationPlanner", "AllocationTotals", "PromptSampler"]


@dataclass
class AllocationTotals:
    """Running totals since the start of the run (restored on resume)."""

    steps: int = 0
    prompts_planned: int = 0
    prompts_drawn: int = 0
    prompts_trained: int = 0
    prompts_fully_pruned: int = 0
    prompts_dropped: int = 0
    completions_generated: int = 0
    completions_kept: int = 0
    completions_pruned: int = 0
    completions_dropped: int = 0
    refill_rounds: int = 0


class AllocationPlanner:
    """How many prompts to draw per step so that the survivors fill the update capacity.

    Args:
        capacity: completions the update passes take per step (the GRPO batch, B * G).
        group_size: G, completions generated per prompt.
        pruning_rate, keep_per_group: as in ``CPPOConfig`` (both None = rate 0.875).
        scope: ``group`` (k survivors per prompt) or ``batch`` (G (1 - P) per prompt on
            average).
        allocation: False draws capacity / G prompts per step (fewer completions train).
        dynamic_sampling: drop zero-variance groups and draw replacements, up to
            ``max_refill_rounds`` extra rounds per step.
        keep_mass: adaptive counts (``CPPOConfig.keep_mass``): survivors per prompt are not
            known in advance. The first round draws capacity / (running mean of survivors
            per drawn prompt; G / 2 before any step) prompts; ``next_fill`` then asks for
            more until the survivors reach the capacity (up to ``max_refill_rounds`` fill
            rounds). The last round may overshoot the capacity: trimming survivors would
            change which completions the rule keeps.

    Use per step::

        n = planner.begin_step()                 # draw n prompts, generate, reward
        planner.record_round(n, n * G)
        while (extra := planner.next_refill(valid_prompts)) > 0:   # dynamic sampling only
            ...; planner.record_round(extra, extra * G)
        while (extra := planner.next_fill(num_kept)) > 0:          # keep_mass only
            ...; planner.record_round(extra, extra * G)                 # and re-select
        stats = planner.end_step(selection, dropped_prompts=d, dropped_completions=d * G)
    """

    def __init__(
        self,
        capacity: int,
        group_size: int,
        *,
        pruning_rate: float | None = None,
        keep_per_group: int | None = None,
        scope: str = "group",
        allocation: bool = True,
        dynamic_sampling: bool = False,
        max_refill_rounds: int = 3,
        keep_mass: float | None = None,
    ) -> None:
        self.capacity = check_int("capacity", capacity, minimum=1)
        self.group_size = check_int("group_size", group_size, minimum=1)
        if scope not in ("group", "batch"):
            raise ValueError(f"scope must be 'group' or 'batch', got {scope!r}")
        if pruning_rate is not None and keep_per_group is not None:
            raise ValueError(
                f"set either pruning_rate ({pruning_rate}) or keep_per_group ({keep_per_group}), not both"
            )
        if keep_mass is not None:
            if isinstance(keep_mass, bool) or not isinstance(keep_mass, (int, float)) or not 0 < keep_mass <= 1:
                raise ValueError(f"keep_mass must be a number in (0, 1], got {keep_mass!r}")
            if pruning_rate is not None or keep_per_group is not None:
                raise ValueError(
                    f"keep_mass={keep_mass} decides the counts itself: unset pruning_rate ({pruning_rate}) "
                    f"and keep_per_group ({keep_per_group})"
                )
        self.keep_mass = keep_mass
        # keep_mass: a placeholder k (G / 2) for the first plan; the running mean replaces it
        self.keep = max(1, group_size // 2) if keep_mass is not None else keep_count(
            group_size, pruning_rate, keep_per_group)
        if not isinstance(allocation, bool) or not isinstance(dynamic_sampling, bool):
            raise ValueError(
                f"allocation and dynamic_sampling must be booleans, got {allocation!r}, {dynamic_sampling!r}"
            )
        self.allocation = allocation
        self.dynamic_sampling = dynamic_sampling
        self.max_refill_rounds = check_int("max_refill_rounds", max_refill_rounds, minimum=0)

        if keep_mass is not None:
            survivors = Fraction(group_size, 2)
        elif scope == "batch" and keep_per_group is None:
            p = DEFAULT_PRUNING_RATE if pruning_rate is None else pruning_rate
            # limit_denominator turns binary floats like 0.6 into the 3/5 the user meant
            survivors = Fraction(group_size) * (1 - Fraction(p).limit_denominator(1_000_000))
        else:
            survivors = Fraction(self.keep)
        self.survivors_per_prompt = survivors
        per_step = Fraction(capacity) / (survivors if allocation else Fraction(group_size))
        self.prompts_per_step = per_step  # exact, possibly fractional
        if per_step < 1:
            raise ValueError(
                f"capacity={capacity} is too small for group_size={group_size}: fewer than one prompt "
                "per step; raise the capacity"
            )

        self._carry = Fraction(0)
        self._open: dict[str, int] | None = None
        self.totals = AllocationTotals()

    @classmethod
    def from_config(cls, cfg: CPPOConfig, capacity: int, group_size: int) -> AllocationPlanner:
        """From a ``CPPOConfig``: capacity completions per step, groups of group_size."""
        check_config(cfg)
        return cls(
            capacity,
            group_size,
            pruning_rate=cfg.pruning_rate,
            keep_per_group=cfg.keep_per_group,
            scope=cfg.scope,
            allocation=cfg.allocation,
            dynamic_sampling=cfg.dynamic_sampling,
            max_refill_rounds=cfg.max_refill_rounds,
            keep_mass=getattr(cfg, "keep_mass", None),
        )

    @property
    def adaptive(self) -> bool:
        """True when survivors per prompt vary (keep_mass) and ``next_fill`` tops steps up."""
        return self.keep_mass is not None and self.allocation

    def survivors_estimate(self, kept_so_far: int = 0) -> float:
        """Mean survivors per drawn prompt so far in the run (this step's ``kept_so_far``
        included); the configured survivors per prompt before anything was drawn."""
        drawn = self.totals.prompts_drawn + (self._open["drawn"] if self._open is not None else 0)
        kept = self.totals.completions_kept + kept_so_far
        if drawn == 0 or kept == 0:
            return float(self.survivors_per_prompt)
        return kept / drawn

    # ------------------------------------------------------------------ per step
    def begin_step(self) -> int:
        """Open a step; returns the number of prompts (int >= 0) to draw in its first round:
        floor(carry + capacity / survivors-per-prompt), the remainder carried to the next step."""
        if self._open is not None:
            raise RuntimeError("begin_step called twice without end_step")
        if self.adaptive:
            # plan from the running mean (fill rounds top up); at most `capacity` prompts
            target = max(1, min(self.capacity, int(self.capacity / self.survivors_estimate())))
        else:
            self._carry += self.prompts_per_step
            target = int(self._carry)  # floor: Fraction >= 0
            self._carry -= target
        self.totals.prompts_planned += target
        self._open = {"target": target, "drawn": 0, "generated": 0, "rounds": 0, "fill_rounds": 0}
        return target

    def record_round(self, prompts: int, completions: int) -> None:
        """Record what a generation round drew (``prompts``) and produced (``completions``,
        G per prompt), both ints >= 0."""
        st = self._require_open("record_round")
        check_int("prompts", prompts, minimum=0)
        check_int("completions", completions, minimum=0)
        st["drawn"] += prompts
        st["generated"] += completions

    def next_refill(self, valid_prompts: int) -> int:
        """Dynamic sampling: prompts (int >= 0) to draw in another round, 0 when done.

        ``valid_prompts``: int, the drawn prompts so far whose group has reward variance.
        """
        st = self._require_open("next_refill")
        check_int("valid_prompts", valid_prompts, minimum=0)
        if valid_prompts > st["drawn"]:
            raise ValueError(f"valid_prompts={valid_prompts} exceeds the {st['drawn']} prompts drawn this step")
        if not self.dynamic_sampling or st["rounds"] >= self.max_refill_rounds:
            return 0
        need = st["target"] - valid_prompts
        if need <= 0:
            return 0
        st["rounds"] += 1
        return need

    def next_fill(self, num_kept: int) -> int:
        """keep_mass with allocation: prompts to draw in another round so that the survivors
        (``num_kept``, the selection over everything drawn so far this step) reach the
        capacity; 0 when full, when counts are fixed, or after ``max_refill_rounds`` fills."""
        st = self._require_open("next_fill")
        check_int("num_kept", num_kept, minimum=0)
        if not self.adaptive or num_kept >= self.capacity or st["fill_rounds"] >= self.max_refill_rounds:
            return 0
        st["fill_rounds"] += 1
        need = self.capacity - num_kept
        # ceil(need / mean survivors per prompt), at least 1, at most `need` prompts
        return max(1, min(need, math.ceil(need / max(self.survivors_estimate(num_kept), 1e-9))))

    def end_step(
        self,
        selection: Selection,
        *,
        dropped_prompts: int = 0,
        dropped_completions: int = 0,
    ) -> dict[str, float]:
        """Close the step; check that every prompt and completion is accounted for.

        Args:
            selection: the ``Selection`` over the completions of the prompts that were not
                dropped (its M groups plus ``dropped_prompts`` = the prompts drawn).
            dropped_prompts: int, prompts dynamic sampling removed before selection.
            dropped_completions: int, their completions.

        Returns:
            per-step ``alloc/*`` metrics, plain floats.
        """
        st = self._require_open("end_step")
        check_int("dropped_prompts", dropped_prompts, minimum=0)
        check_int("dropped_completions", dropped_completions, minimum=0)
        groups = int(selection.group_ids.numel())
        if groups + dropped_prompts != st["drawn"]:
            raise ValueError(
                f"prompt accounting: {st['drawn']} drawn this step but the selection has {groups} groups "
                f"and {dropped_prompts} were dropped; every prompt must be trained, pruned or dropped"
            )
        if selection.num_total + dropped_completions != st["generated"]:
            raise ValueError(
                f"completion accounting: {st['generated']} generated this step but {selection.num_kept} "
                f"kept + {selection.num_pruned} pruned + {dropped_completions} dropped"
            )
        trained = int((selection.kept_per_group > 0).sum())
        t = self.totals
        t.steps += 1
        t.prompts_drawn += st["drawn"]
        t.prompts_trained += trained
        t.prompts_fully_pruned += groups - trained
        t.prompts_dropped += dropped_prompts
        t.completions_generated += st["generated"]
        t.completions_kept += selection.num_kept
        t.completions_pruned += selection.num_pruned
        t.completions_dropped += dropped_completions
        t.refill_rounds += st["rounds"] + st["fill_rounds"]
        self._open = None
        return {
            "alloc/prompts_planned": float(st["target"]),
            "alloc/prompts_drawn": float(st["drawn"]),
            "alloc/prompts_trained": float(trained),
            "alloc/prompts_dropped": float(dropped_prompts),
            "alloc/completions_generated": float(st["generated"]),
            "alloc/completions_trained": float(selection.num_kept),
            "alloc/capacity_fill": selection.num_kept / self.capacity,
            "alloc/refill_rounds": float(st["rounds"]),
            "alloc/fill_rounds": float(st["fill_rounds"]),
        }

    def _require_open(self, what: str) -> dict[str, int]:
        if self._open is None:
            raise RuntimeError(f"{what} called outside a step: call begin_step first")
        return self._open

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> dict[str, Any]:
        """The carry (an exact fraction), the plan and the totals; only between steps."""
        if self._open is not None:
            raise RuntimeError("state_dict during an open step: checkpoint between steps")
        return {
            "carry": (self._carry.numerator, self._carry.denominator),
            "prompts_per_step": (self.prompts_per_step.numerator, self.prompts_per_step.denominator),
            "totals": asdict(self.totals),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``; a checkpoint planned for other settings is an error."""
        pps = Fraction(*state["prompts_per_step"])
        if pps != self.prompts_per_step:
            raise ValueError(
                f"checkpoint planned {float(pps):g} prompts per step but this planner plans "
                f"{float(self.prompts_per_step):g}: capacity, group size or pruning rate changed"
            )
        self._carry = Fraction(*state["carry"])
        known = {f.name for f in fields(AllocationTotals)}
        self.totals = AllocationTotals(**{k: v for k, v in state["totals"].items() if k in known})
        self._open = None

    def metrics(self, prefix: str = "alloc/total_") -> dict[str, float]:
        """The running totals as plain floats (``alloc/total_prompts_drawn``, ...)."""
        return {prefix + k: float(v) for k, v in asdict(self.totals).items()}


class PromptSampler:
    """Draws prompt indices epoch by epoch in a seeded order; resumable.

    Every index of ``range(num_prompts)`` is drawn once per epoch; the order of epoch e is
    a permutation decided by (seed, e) alone, so a resumed run draws exactly what the
    uninterrupted run would have drawn.
    """

    def __init__(self, num_prompts: int, *, seed: int = 0, shuffle: bool = True) -> None:
        self.num_prompts = check_int("num_prompts", num_prompts, minimum=1)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self.total_drawn = 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_prompts)
        from .selection import seeded_generator

        return torch.randperm(self.num_prompts, generator=seeded_generator(self.seed, epoch, stream=7))

    def draw(self, n: int) -> list[int]:
        """The next ``n`` prompt indices, ints in [0, num_prompts) (crossing into the next
        epoch when needed)."""
        check_int("n", n, minimum=0)
        out: list[int] = []
        while len(out) < n:
            if self.position == self.num_prompts:
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
            take = min(n - len(out), self.num_prompts - self.position)
            out.extend(self._order[self.position : self.position + take].tolist())
            self.position += take
        self.total_drawn += n
        return out

    def state_dict(self) -> dict[str, int]:
        """Where the sampler stands (epoch, position, total drawn) and what it samples."""
        return {
            "num_prompts": self.num_prompts,
            "seed": self.seed,
            "epoch": self.epoch,
            "position": self.position,
            "total_drawn": self.total_drawn,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore ``state_dict()``; another data set size or seed is an error."""
        if state["num_prompts"] != self.num_prompts or state["seed"] != self.seed:
            raise ValueError(
                f"sampler checkpoint is for {state['num_prompts']} prompts / seed {state['seed']}, "
                f"this sampler has {self.num_prompts} / seed {self.seed}: the data set or seed changed"
            )
        self.epoch = state["epoch"]
        self.position = state["position"]
        self.total_drawn = state["total_drawn"]
        self._order = self._epoch_order(self.epoch)

    @property
    def epochs_float(self) -> float:
        """Prompts drawn so far / prompts in the data set."""
        return self.total_drawn / self.num_prompts
