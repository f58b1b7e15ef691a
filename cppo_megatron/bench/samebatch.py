"""The host benches' table against two GRPO baselines (``bench verl``, ``bench openrlhf``).

With allocation CPPO draws B / (1 - P) prompts a step: its rollout generates 1/(1 - P) times
GRPO's batch, and whatever a larger rollout batch saves per prompt (the paper's gain beyond
S_max) any GRPO run with that many prompts would get too. So each bench also runs GRPO at the
prompts allocation draws (``SAME_BATCH``), and the allocation row reports its speedup against
both: against GRPO (the headline) with S_max from GRPO's phase split, and against the same-batch
GRPO with S_max from *that* run's split (the gain of pruning alone). The same-batch GRPO row's
own speedup against GRPO is the batching gain; it has no pruning bound.

Each run's summary is a dict with ``s_per_prompt``, ``prompts_per_step``, ``trained_per_step``
and ``<phase>_s_per_prompt`` for the host's phases (``bench.verl.summarize``,
``bench.openrlhf.summarize``).
"""

from __future__ import annotations

from .bound import fraction_of_bound, speedup, speedup_bound

__all__ = ["GRPO", "SAME_BATCH", "host_split", "rows_against_both", "same_batch_prompts"]

GRPO = "grpo"
SAME_BATCH = "grpo same batch"


def same_batch_prompts(prompts: int, group_size: int, keep: int, what: str) -> int:
    """Prompts per step allocation draws: B G / k, as a whole number (else ValueError naming ``what``)."""
    if prompts * group_size % keep:
        raise ValueError(f"{what}={prompts} x G={group_size} / keep={keep} is not a whole number of prompts: "
                         "pass --no-same-batch or another rate")
    return prompts * group_size // keep


def host_split(summary: dict, gen_phases: tuple[str, ...], rest_phases: tuple[str, ...]) -> dict:
    """A run's phase split per prompt: T_gen, T_rest (seconds) and the whole step."""
    return {"t_gen_per_prompt_s": sum(summary.get(f"{ph}_s_per_prompt", 0.0) for ph in gen_phases),
            "t_rest_per_prompt_s": sum(summary.get(f"{ph}_s_per_prompt", 0.0) for ph in rest_phases),
            "t_step_per_prompt_s": summary["s_per_prompt"]}


def _vs(split: dict, p: float, s_per_prompt: float) -> tuple[float, float, float]:
    sp = speedup(split["t_step_per_prompt_s"], s_per_prompt)
    bound = speedup_bound(p, split["t_gen_per_prompt_s"], split["t_rest_per_prompt_s"])
    return sp, bound, fraction_of_bound(sp, bound)


def rows_against_both(results: dict[str, dict], rate: float, gen_phases: tuple[str, ...],
                      rest_phases: tuple[str, ...]) -> tuple[list[dict], dict]:
    """Table rows (in ``results``' order) and the splits: ``results`` maps run name -> summary;
    ``GRPO`` must be there, ``SAME_BATCH`` may be; other names are CPPO at ``rate`` (``alloc`` /
    ``no-alloc`` in the name)."""
    base = host_split(results[GRPO], gen_phases, rest_phases)
    same = host_split(results[SAME_BATCH], gen_phases, rest_phases) if SAME_BATCH in results else None
    rows = []
    for name, s in results.items():
        p = rate if name not in (GRPO, SAME_BATCH) else 0.0
        sp, bound, frac = _vs(base, p, s["s_per_prompt"])
        row = {"run": name, "prompts/step": s["prompts_per_step"], "trained/step": s["trained_per_step"],
               "ms/prompt": 1e3 * s["s_per_prompt"], "speedup": sp, "bound": bound,
               "of bound": frac if p > 0 else 1.0,
               "speedup same batch": None, "bound same batch": None, "of bound same batch": None}
        if name == SAME_BATCH:
            row["bound"] = row["of bound"] = None  # a baseline: its speedup is the batching gain
        elif same is not None and p > 0 and "no-alloc" not in name:
            sp2, bound2, frac2 = _vs(same, p, s["s_per_prompt"])
            row.update({"speedup same batch": sp2, "bound same batch": bound2, "of bound same batch": frac2})
        rows.append(row)
    return rows, {**base, "same_batch": same}


def same_batch_note(rows: list[dict]) -> list[str]:
    """One line for the notes: the batching gain and pruning's gain over the same-batch GRPO."""
    by = {r["run"]: r for r in rows}
    same = by.get(SAME_BATCH)
    alloc = next((r for r in rows if r["speedup same batch"] is not None), None)
    if same is None or alloc is None:
        return []
    return [f"GRPO at allocation's {same['prompts/step']:g} prompts a step: {same['speedup']:.2f}x GRPO per prompt "
            f"(the batching gain); {alloc['run']} against it {alloc['speedup same batch']:.2f}x, bound "
            f"{alloc['bound same batch']:.2f}x from its own split ({alloc['of bound same batch']:.0%} of it: "
            "pruning alone)"]
