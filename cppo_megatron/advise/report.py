"""The printed advice and its JSON form."""

from __future__ import annotations

from dataclasses import asdict

from .advice import GENERATION_BOUND, RateAdvice
from .recipe import RecipeFacts
from .split import HOSTS, PhaseSplit

__all__ = ["advice_json", "format_advice", "generation_warning"]

FORMATS = {"jsonl": "JSON lines", "console": "console log", "tensorboard": "TensorBoard events"}


def generation_warning(split: PhaseSplit, rows: list[RateAdvice]) -> str | None:
    """The flag for a run whose generation is ``GENERATION_BOUND`` or more of a step, else None."""
    if split.generation_share < GENERATION_BOUND:
        return None
    best = max(rows, key=lambda r: r.P)
    return (f"generation is {split.generation_share:.0%} of a step: pruning shortens only the other "
            f"{1 - split.generation_share:.0%}, so CPPO alone gains at most {best.s_max:.2f}x (P={best.P:g}) and will "
            "not pay for itself. Save on generation instead: selective rollout (cppo.selective.enabled=true: skip "
            "prompts whose recent groups all had equal rewards; docs/selective_rollout.md), or stopping unpromising "
            "completions early inside the rollout engine (in development); then prune what is left.")


def _phases_line(split: PhaseSplit) -> str:
    spec = HOSTS[split.host]
    parts = [f"{k.split('/', 1)[1]} {v:.3g}" for k, v in split.phases.items()
             if k in spec.prunable and v > 0]
    return ", ".join(parts) or "none logged"


def _header(split: PhaseSplit) -> list[str]:
    spec = HOSTS[split.host]
    used = split.steps_used
    span = f"step {used[0]}" if len(used) == 1 else f"steps {used[0]}-{used[-1]}"
    lines = [
        f"advise: {split.source} ({spec.label}, {FORMATS[split.fmt]}): {span}, {len(used)} step(s); {split.skip_note}",
        f"median step {split.step_s:.3g} s: generation {split.generation_s:.3g} s ({split.generation_share:.0%}), "
        f"prunable passes {split.prunable_s:.3g} s ({split.prunable_share:.0%}: {_phases_line(split)}), "
        f"everything else {max(0.0, split.fixed_s - split.generation_s):.3g} s",
    ]
    if split.pruned_fraction is not None:
        lines.append(f"note: this log is a CPPO run (it trained {split.pruned_fraction:.1%} of its completions): the "
                     "passes are scaled up to the full batch, an estimate (fixed per-pass costs make it high)")
    if split.overlapped:
        lines.append("note: the step is shorter than its phases together (generation overlaps training, an async "
                     "trainer): a step is the longer path, max(generation, the trainer's), and pruning shortens only "
                     "the trainer's")
    return lines


def _sec(x: float) -> str:
    return f"{x:,.0f} s" if x >= 100 else f"{x:.3g} s"


def _table(rows: list[RateAdvice]) -> list[str]:
    head = (f"{'P':>7} {'S_max':>7} {'speedup/prompt':>15} {'step no-alloc':>14} {'step alloc':>11} "
            f"{'prompts/step':>13} {'generated':>10} {'trained':>8}  allocation")
    out = [head]
    for r in rows:
        def n(x):
            return f"{x:,.0f}" if x is not None else "-"
        out.append(f"{r.P:>7g} {r.s_max:>6.2f}x {r.speedup_per_prompt:>14.2f}x {_sec(r.step_noalloc_s):>14} "
                   f"{_sec(r.step_alloc_s):>11} {n(r.prompts):>13} {n(r.generated):>10} {n(r.trained):>8}  "
                   f"{r.allocation}")
    return out


def format_advice(split: PhaseSplit, rows: list[RateAdvice], facts: RecipeFacts | None = None) -> str:
    """The text ``cppo-megatron advise`` prints."""
    lines = _header(split)
    if facts is not None:
        lines.append(f"recipe {facts.path}: {facts.prompts} prompts x G={facts.group_size} per step")
    warn = generation_warning(split, rows)
    if warn:
        lines.append(f"WARNING: {warn}")
    lines += ["", *_table(rows), ""]
    lines.append("step no-alloc: the same prompts a step; step alloc: B/(1-P) prompts, the same completions trained, "
                 "assuming everything pruning does not touch grows with the prompts (a larger batch that generates "
                 "more cheaply per prompt does better: measure with cppo-megatron bench)")
    for r in rows:
        lines.append(f"P={r.P:g}: allocation {r.allocation}: {r.reason}")
        lines.append(f"  {r.change}")
    return "\n".join(lines)


def advice_json(split: PhaseSplit, rows: list[RateAdvice], facts: RecipeFacts | None = None) -> dict:
    """Everything printed, as plain data (``--json``)."""
    s = asdict(split)
    s.update(fixed_s=split.fixed_s, generation_share=split.generation_share, prunable_share=split.prunable_share)
    return {
        "split": s,
        "recipe": None if facts is None else {"path": facts.path, "host": facts.host, "prompts": facts.prompts,
                                               "group_size": facts.group_size, "why_unsized": facts.why or None},
        "generation_warning": generation_warning(split, rows),
        "rates": [asdict(r) for r in rows],
    }
