"""From a phase split to advice per pruning rate: the bound, the step time to expect, whether
allocation is worth it, and the recipe change.

Per P, with T_step the median step, T_rest its prunable passes and T_fixed = T_step - T_rest:

- ``S_max(P) = T_step / (T_fixed + (1 - P) T_rest)`` (``bench.bound.speedup_bound``), the most
  pruning can give per prompt;
- without allocation (the same prompts a step) a step should take T_fixed + (1 - P) T_rest;
- with allocation (B / (1 - P) prompts, the same B G completions trained) a step should take
  T_fixed / (1 - P) + T_rest if everything pruning does not touch grows with the prompts — true of
  a rollout engine that is already full, pessimistic where a larger batch decodes more cheaply per
  prompt (a latency-bound GPU engine: that batching gain comes on top, and ``bench`` measures it).
  Per prompt that is S_max again; what allocation buys is a full update batch each step.
- a run whose generation and reward take ``GENERATION_BOUND`` or more of a step is flagged: pruning
  shortens only the rest, so CPPO alone cannot pay much there.

With the generation overlapped with training (an async trainer: a step shorter than its phases
together), the step is the longer of the two paths: pruning shortens the trainer's,
T(P) = max(T_gen, T_step - P T_rest).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..bench.bound import speedup_bound
from .recipe import EngineFit, RecipeFacts
from .split import PhaseSplit

__all__ = ["DEFAULT_RATES", "GENERATION_BOUND", "RateAdvice", "advise_rates", "recipe_line"]

DEFAULT_RATES = (0.5, 0.75, 0.875, 0.9375)
GENERATION_BOUND = 0.8


@dataclass(frozen=True)
class RateAdvice:
    """What to expect at one pruning rate ``P``; ``prompts``/``generated``/``trained`` are per
    step with allocation (None when the batch is unknown); ``fit`` sizes that generation batch."""

    P: float
    s_max: float
    step_noalloc_s: float
    step_alloc_s: float
    speedup_per_prompt: float
    prompts: float | None
    generated: float | None
    trained: float | None
    fit: EngineFit | None
    allocation: str  # "yes", "yes, in N waves", "no: does not fit", or "unsized"
    reason: str
    change: str


def recipe_line(host: str, P: float, allocation: bool) -> str:
    """The one-line change that turns a GRPO run of ``host`` into CPPO at ``P``."""
    alloc = "true" if allocation else "false"
    if host == "verl":
        return (f"cppo-megatron verl RECIPE algorithm.adv_estimator=cppo cppo.pruning_rate={P:g} "
                f"cppo.allocation={alloc}")
    if host == "openrlhf":
        return f"cppo-megatron openrlhf RECIPE --cppo.pruning_rate {P:g} --cppo.allocation {alloc}"
    return f"cppo-megatron train RECIPE cppo.pruning_rate={P:g} cppo.allocation={alloc}"


def _check_rate(P: float) -> float:
    if isinstance(P, bool) or not isinstance(P, (int, float)) or not 0.0 < P < 1.0:
        raise ValueError(f"pruning rates must be in (0, 1), got {P!r}")
    return float(P)


def _allocation_verdict(P: float, fit: EngineFit | None, facts: RecipeFacts | None) -> tuple[str, str]:
    """(verdict for the table, why): ``yes``, ``yes, in N waves``, ``no: does not fit`` or ``unsized``."""
    if facts is None:
        return "unsized", ("give --recipe to size the generation batch against the rollout engine; allocation "
                           f"generates {1 / (1 - P):g}x the completions per step")
    if fit is None:
        return "unsized", f"cannot size the rollout: {facts.why}"
    what = (f"{fit.sequences:,} completions a step need {fit.need_gb:.3g} GB at once, the rollout has "
            f"{fit.pool_gb:.3g} GB")
    if fit.concurrent == 0:
        return "no: does not fit", (f"{what}: not even one sequence of the recipe's length fits the rollout's "
                                    "memory; the run cannot start as it is (shorter sequences, more memory)")
    if facts.host == "trainer" and fit.need_gb > fit.pool_gb:
        return "no: does not fit", (f"{what}: the run would run out of memory; keep allocation off or lower "
                                    "rollout.max_batch_sequences")
    if fit.fits:
        return "yes", (f"{what}: it decodes them at once, so the larger batch can cost less per prompt than the "
                       "bound assumes (the paper's gain beyond S_max), and every step trains the full update batch")
    return f"yes, in {fit.waves} waves", (
        f"{what}, {fit.concurrent:,} at a time: decoding gains nothing from the larger batch ({fit.waves} waves), "
        "so expect about S_max per prompt, plus what per-step fixed costs (weight sync, launches) spread over more "
        "prompts; every step still trains the full update batch, each step takes longer")


def advise_rates(split: PhaseSplit, rates=DEFAULT_RATES, facts: RecipeFacts | None = None) -> list[RateAdvice]:
    """One ``RateAdvice`` per rate (module docstring); ``facts`` (a recipe's) sizes allocation."""
    rates = [_check_rate(p) for p in rates]
    if not rates:
        raise ValueError("give at least one pruning rate")
    b = facts.prompts if facts is not None else split.prompts_per_step
    g = facts.group_size if facts is not None else split.group_size
    out = []
    for P in rates:
        fixed, rest = split.fixed_s, split.prunable_s
        s_max = speedup_bound(P, fixed, rest)
        if split.overlapped:
            no_alloc = max(split.generation_s, split.step_s - P * rest)
            per_prompt = split.step_s / no_alloc
        else:
            no_alloc, per_prompt = fixed + (1 - P) * rest, s_max
        with_alloc = fixed / (1 - P) + rest
        prompts = b / (1 - P) if b else None
        generated = prompts * g if prompts and g else None
        fit = facts.fit(round(generated)) if facts is not None and generated else None
        verdict, reason = _allocation_verdict(P, fit, facts)
        out.append(RateAdvice(P, s_max, no_alloc, with_alloc, per_prompt, prompts, generated,
                              b * g if b and g else None, fit, verdict, reason,
                              recipe_line(split.host, P, not verdict.startswith("no"))))
    return out
