"""A run's phase split: the median seconds of a step, of its generation, and of the passes
pruning shrinks, over the steps after the warm-up.

Per host, which timers are what (read from the hosts' sources):

- veRL (``trainer/ppo/ray_trainer.py``, ``v1/trainer_base.py``): ``timing_s/step`` is the step;
  generation is ``gen`` (rollout; rule-based rewards are scored inside the agent loop) and
  ``reward`` (a colocated reward model); the prunable passes are ``old_log_prob``, ``ref``,
  ``values``, ``update_critic`` and ``update_actor``; ``save_checkpoint`` runs inside the step
  and is taken out of it (``testing`` runs outside it).
- OpenRLHF (``trainer/ppo_trainer.py``): ``timing/step_total`` is the step (in the synchronous
  trainer the sum of the others; in the async one the wall time of an iteration);
  ``timing/generation`` is generation (rewards are scored inside it); ``make_experience`` (the
  old-policy, reference and critic forwards) and ``ppo_train`` are prunable; ``broadcast`` (the
  weight sync) is not.
- the embedded trainer (``trainer/metrics.py``): ``time/step``; ``GEN_PHASES`` and
  ``PASS_PHASES``.

Everything in a step that is not a prunable pass (generation, weight sync, advantages,
bookkeeping) is T_gen of the bound S_max(P) = (T_gen + T_rest) / (T_gen + (1 - P) T_rest): the
time pruning does not touch.

Warm-up: the first logged step always pays for things later steps do not (compilation, caches,
allocator growth, a cold rollout engine), and is left out; so are the leading steps after it that
still take more than ``SLOW_FACTOR`` times the median of the rest (at most a quarter of the
steps). A log of one step keeps it, and says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..bench.report import median
from .logs import RunLog

__all__ = ["HOSTS", "SLOW_FACTOR", "HostPhases", "PhaseSplit", "phase_split"]

SLOW_FACTOR = 1.5
OVERLAP_FACTOR = 0.9  # a step shorter than this share of its phases' sum overlaps them (async)


@dataclass(frozen=True)
class HostPhases:
    """Which of a host's timers are the step, generation, the prunable passes, and time inside
    the step that is not a step's work (a checkpoint)."""

    label: str
    step: str
    generation: tuple[str, ...]
    prunable: tuple[str, ...]
    excluded: tuple[str, ...] = ()


HOSTS = {
    "verl": HostPhases("veRL", "timing_s/step", ("timing_s/gen", "timing_s/reward"),
                       ("timing_s/old_log_prob", "timing_s/ref", "timing_s/values", "timing_s/update_critic",
                        "timing_s/update_actor"), ("timing_s/save_checkpoint",)),
    "openrlhf": HostPhases("OpenRLHF", "timing/step_total", ("timing/generation",),
                           ("timing/make_experience", "timing/ppo_train")),
    "trainer": HostPhases("the embedded trainer", "time/step", ("time/rollout", "time/reward"),
                          ("time/old_logprob", "time/ref_logprob", "time/update")),
}


@dataclass(frozen=True)
class PhaseSplit:
    """Median seconds per step over ``steps_used``.

    step_s: a whole step (checkpoints taken out); generation_s: rollout + reward;
    prunable_s: the passes pruning shrinks, for the full batch (``pruned_fraction`` says when they
    were scaled up from a pruned run); fixed_s: step_s - prunable_s, everything pruning does not
    touch (T_gen of the bound); phases: the median of every timer the host logged.
    """

    host: str
    source: str
    fmt: str
    step_s: float
    generation_s: float
    prunable_s: float
    steps_used: tuple[int, ...]
    steps_skipped: tuple[int, ...]
    skip_note: str
    phases: dict[str, float] = field(default_factory=dict)
    overlapped: bool = False
    pruned_fraction: float | None = None  # kept / generated of a CPPO run's log, else None
    prompts_per_step: float | None = None
    group_size: float | None = None

    @property
    def fixed_s(self) -> float:
        return self.step_s - self.prunable_s

    @property
    def generation_share(self) -> float:
        return self.generation_s / self.step_s

    @property
    def prunable_share(self) -> float:
        return self.prunable_s / self.step_s


def _step_seconds(spec: HostPhases, d: dict[str, float]) -> float:
    return d[spec.step] - sum(d.get(k, 0.0) for k in spec.excluded)


def _warmup(spec: HostPhases, timed: list[tuple[int, dict[str, float]]], skip: int | None) -> tuple[int, str]:
    """How many leading steps to leave out, and the sentence that says why."""
    n = len(timed)
    if skip is not None:
        if skip >= n:
            raise ValueError(f"--skip {skip} leaves none of the {n} timed steps: lower it")
        return skip, f"skipped the first {skip} step(s) (--skip {skip})"
    if n == 1:
        return 0, "only one timed step: it is used although it includes the warm-up (the split is rough)"
    k = 1
    limit = max(1, n // 4)
    while k < limit and k < n - 1:
        rest = median(_step_seconds(spec, d) for _, d in timed[k + 1:])
        if _step_seconds(spec, timed[k][1]) <= SLOW_FACTOR * rest:
            break
        k += 1
    first = timed[0][0]
    if k == 1:
        return 1, f"skipped step {first} (the first step pays for compilation, caches and a cold engine)"
    return k, (f"skipped steps {first}-{timed[k - 1][0]} (the first step, and the next ones while a step took more "
               f"than {SLOW_FACTOR:g}x the median of the rest)")


def _pruned_fraction(rows: list[dict[str, float]]) -> float | None:
    """kept / generated completions of a CPPO run (this package's ``cppo/*`` metrics), or None."""
    pairs = [(d["cppo/num_kept"], d["cppo/num_completions"]) for d in rows
             if d.get("cppo/num_completions", 0) > 0 and "cppo/num_kept" in d]
    if not pairs:
        return None
    frac = median(k / n for k, n in pairs)
    return frac if frac < 1.0 else None


def phase_split(run: RunLog, skip: int | None = None) -> PhaseSplit:
    """The median phase split of ``run`` (module docstring). ``skip``: leading steps to leave
    out (None: the warm-up rule). Raises ValueError when no step has the host's step timer."""
    spec = HOSTS[run.host]
    timed = [(s, d) for s, d in run.steps if spec.step in d]
    if not timed:
        raise ValueError(f"{run.source}: no step logged {spec.step} ({spec.label}'s step time)")
    k, note = _warmup(spec, timed, skip)
    used = timed[k:]
    rows = [d for _, d in used]
    step = median(_step_seconds(spec, d) for d in rows)
    gen = median(sum(d.get(x, 0.0) for x in spec.generation) for d in rows)
    prunable = median(sum(d.get(x, 0.0) for x in spec.prunable) for d in rows)
    phase_sum = median(sum(d.get(x, 0.0) for x in (*spec.generation, *spec.prunable)) for d in rows)
    if step <= 0:
        raise ValueError(f"{run.source}: the median step time is {step:g} s; the log's timings are not usable")
    frac = _pruned_fraction(rows)
    if frac is not None:  # the passes ran on the kept share only: scale them to the full batch
        step, prunable = step + prunable * (1.0 / frac - 1.0), prunable / frac
    keys = sorted({k for d in rows for k in d if k.startswith(spec.step.split("/")[0] + "/")})
    phases = {key: median(d.get(key, 0.0) for d in rows) for key in keys}
    prompts = [d["cppo/num_groups"] for d in rows if "cppo/num_groups" in d]
    groups = [d["cppo/num_completions"] / d["cppo/num_groups"] for d in rows if d.get("cppo/num_groups", 0) > 0
              and "cppo/num_completions" in d]
    return PhaseSplit(
        host=run.host, source=run.source, fmt=run.fmt, step_s=step, generation_s=gen, prunable_s=min(prunable, step),
        steps_used=tuple(s for s, _ in used), steps_skipped=tuple(s for s, _ in timed[:k]), skip_note=note,
        phases=phases, overlapped=step < OVERLAP_FACTOR * phase_sum, pruned_fraction=frac,
        prompts_per_step=median(prompts) if prompts else None, group_size=median(groups) if groups else None,
    )
