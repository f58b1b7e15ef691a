"""The study's grid of arms and its results, shared by the embedded study (``study.py``) and
the veRL study (``verl_study.py``): the arms a command line asks for (``grid``, ``run_id``),
the summary table and its verdicts against the seed spread (``summarize``, ``compare``,
``verdict_line``, ``findings``), the per-run CSV (``write_csv``) and the accuracy-vs-time
curves (``plot_curves``). It imports neither study, so both can take it."""

from __future__ import annotations

import csv
import json
import math
import statistics
from pathlib import Path

__all__ = ["DEFAULT", "FULL", "GENERATION", "METRIC_SETTINGS", "add_time_to_target", "arm_name", "compare",
           "config_key", "default_target", "findings", "generation_findings", "grid", "plot_auc", "plot_curves",
           "run_id", "sd_or_zero", "summarize", "time_to_target", "verdict_line", "write_csv"]

DEFAULT = {"rates": "0,0.5,0.875", "metrics": "smallest,random,largest", "allocation": "on"}
FULL = {"rates": "0,0.5,0.75,0.875,0.9375", "metrics": "smallest,random,largest,signed", "allocation": "both"}
METRIC_SETTINGS = {  # name -> (cppo.metric, cppo.use_abs)
    "smallest": ("smallest", True),
    "largest": ("largest", True),
    "random": ("random", True),
    "signed": ("smallest", False),
    "importance": ("importance", True),  # 1/pi-weighted PPS sample (core.sampling)
    "keep_mass": ("smallest", True),  # adaptive k: one run per seed, --keep-mass f instead of P
}
# how a run chooses what to generate (--generation) -> (recipe overrides, label suffix)
GENERATION = {
    "all": ({}, ""),  # every prompt drawn is generated, every group trained on (CPPO prunes after rewards)
    "selective": ({"cppo.selective.enabled": True}, " + selective rollout"),  # GRESO: skip before generation
    "dapo": ({"cppo.dynamic_sampling": True}, " + DAPO filter"),  # drop zero-variance groups, refill
    "early_stop": ({"cppo.early_stop.enabled": True}, " + early stopping"),  # stop completions inside the engine
    # k per prompt first, the rest only where they varied; at P = 0 it is GRPO + two waves (the baseline arm)
    "two_wave": ({"cppo.two_wave.enabled": True}, " + two waves"),
}
# generation modes that need pruning (P > 0): their GRPO arm would be the plain one
NEEDS_PRUNING = ("early_stop",)


def grid(args) -> list[dict]:
    """The runs (one dict per arm and seed: kind, P, metric, allocation, seed, keep_mass,
    generation) that ``args`` (--rates, --metrics, --allocation, --full, --seeds, --keep-mass,
    --generation, --no-control) ask for; an unknown metric or generation mode, or a keep-mass
    outside (0, 1], is a ValueError."""
    spec = dict(FULL if args.full else DEFAULT)
    for key in ("rates", "metrics", "allocation"):
        if getattr(args, key):
            spec[key] = getattr(args, key)
    rates = sorted({float(x) for x in spec["rates"].split(",")})
    metrics = [m.strip() for m in spec["metrics"].split(",")]
    unknown = [m for m in metrics if m not in METRIC_SETTINGS]
    if unknown:
        raise ValueError(f"--metrics: unknown {unknown}; choose from {list(METRIC_SETTINGS)}")
    gens = [g.strip() for g in (getattr(args, "generation", None) or "all").split(",")]
    bad = [g for g in gens if g not in GENERATION]
    if bad:
        raise ValueError(f"--generation: unknown {bad}; choose from {list(GENERATION)}")
    allocs = {"on": [True], "off": [False], "both": [True, False]}[spec["allocation"]]
    f = getattr(args, "keep_mass", 0.9)
    if "keep_mass" in metrics and not (0 < f <= 1):
        raise ValueError(f"--keep-mass must be in (0, 1], got {f}")
    per_p = [m for m in metrics if m != "keep_mass"] or ["smallest"]
    runs = []
    for seed in range(args.seeds):
        for p in rates:
            for a in allocs:
                # at P = 0 nothing is pruned: metric and allocation change nothing
                for m in ([per_p[0]] if p == 0 else [m for m in metrics if m != "keep_mass"]):
                    if p == 0 and a != allocs[0]:
                        continue
                    runs += [{"kind": "rl", "P": p, "metric": "grpo" if p == 0 else m, "allocation": a, "seed": seed,
                              "keep_mass": None, "generation": g} for g in gens
                             if not (p == 0 and g in NEEDS_PRUNING)]
        if "keep_mass" in metrics:
            for a in allocs:
                runs += [{"kind": "rl", "P": None, "metric": "keep_mass", "allocation": a, "seed": seed,
                          "keep_mass": f, "generation": g} for g in gens if g not in NEEDS_PRUNING]
        if not args.no_control:
            runs.append({"kind": "control", "P": None, "metric": "sft", "allocation": None, "seed": seed,
                         "keep_mass": None, "generation": None})
    return _exclude(runs, getattr(args, "exclude", None))


def arm_name(spec: dict) -> str:
    """The run's name without its seed (``p0_grpo_alloc_selective``): what ``--exclude`` takes."""
    return run_id(spec).rsplit("_s", 1)[0]


def _exclude(runs: list[dict], exclude: str | None) -> list[dict]:
    """``runs`` without the arms named in ``exclude`` (comma-separated ``arm_name``s); a name that
    is not one of the grid's arms is a ValueError listing them."""
    if not exclude:
        return runs
    names = [n.strip() for n in exclude.split(",") if n.strip()]
    arms = list(dict.fromkeys(arm_name(r) for r in runs))
    unknown = [n for n in names if n not in arms]
    if unknown:
        raise ValueError(f"--exclude {unknown}: not an arm of this study; its arms are {arms}")
    kept = [r for r in runs if arm_name(r) not in names]
    if not kept:
        raise ValueError(f"--exclude {exclude}: no arm left to run")
    return kept


def run_id(spec: dict) -> str:
    """The run's name (``p0.875_smallest_alloc_s1``, ``p0_grpo_alloc_dapo_s0``, ``control_s0``):
    its folder and CSV row."""
    if spec["kind"] == "control":
        return f"control_s{spec['seed']}"
    what = f"keepmass{spec['keep_mass']:g}" if spec["metric"] == "keep_mass" else f"p{spec['P']:g}_{spec['metric']}"
    gen = spec.get("generation") or "all"
    return f"{what}_{'alloc' if spec['allocation'] else 'noalloc'}{'' if gen == 'all' else '_' + gen}_s{spec['seed']}"


def summarize(rows: list[dict]) -> tuple[list[dict], list[str]]:
    """Per-run ``rows`` grouped by configuration (kind, P, metric, allocation, generation): the
    summary table (means over seeds, seed sd, eval stderr, steps, prompts, generation tokens
    per step where the rows have them) and its ``findings``."""
    groups: dict = {}
    for r in rows:
        groups.setdefault(config_key(r), []).append(r)
    table = []
    for (kind, p, metric, alloc, gen), rs in groups.items():
        accs = [r["accuracy_final"] for r in rs]
        at_prompts = [r["accuracy_at_grpo_prompts"] for r in rs if r.get("accuracy_at_grpo_prompts") is not None]
        if p == 0:
            at_prompts = accs  # GRPO's final evaluation is the equal-prompts point
        if kind == "control":
            label = "SFT control"
        elif metric == "keep_mass":
            label = f"keep_mass f={rs[0]['keep_mass']:g}{'' if alloc else ' no-alloc'}"
        else:
            label = f"P={p:g} {metric}{'' if alloc else ' no-alloc'}"
        label += GENERATION[gen][1] if kind != "control" else ""
        tokens = [r["gen_tokens_per_step"] for r in rs if r.get("gen_tokens_per_step") is not None]
        table.append({
            "config": label,
            "acc @ GRPO's prompts": statistics.mean(at_prompts) if at_prompts else None,
            "P": p, "metric": metric, "allocation": alloc, "seeds": len(rs),
            "final acc (mean)": statistics.mean(accs),
            "seed spread (sd)": statistics.stdev(accs) if len(accs) > 1 else float("nan"),
            "eval stderr": statistics.mean(r["eval_stderr"] for r in rs),
            "steps": statistics.mean(r["steps"] for r in rs),
            "prompts": statistics.mean(r["prompts_drawn"] or 0 for r in rs),
            "trained": statistics.mean(r["completions_trained"] or 0 for r in rs),
            "kind": kind,
            "generation": gen if kind != "control" else None,
            "gen tokens/step": statistics.mean(tokens) if tokens else None,
        })
    order = list(GENERATION)
    table.sort(key=lambda t: (t["P"] is None, t["P"] or 0, t["metric"], order.index(t["generation"] or "all")))
    return table, findings(table)


def config_key(r: dict) -> tuple:
    """What makes runs one configuration of the table (a per-run row or a summary row)."""
    kind = r.get("kind") or ("control" if r["metric"] == "sft" else "rl")
    return (kind, r["P"], r["metric"], r["allocation"], r.get("generation") or "all" if kind != "control" else "all")


def add_time_to_target(table: list[dict], rows: list[dict], target: float) -> None:
    """Per summary row (in place): ``time to target (s)``, the mean over the seeds that reached
    ``target`` of their first evaluation time at or above it, and ``reached`` ("k/n")."""
    for t in table:
        times = [time_to_target(r["curve"], target) for r in rows if config_key(r) == config_key(t)]
        reached = [x for x in times if x is not None]
        t["time to target (s)"] = statistics.mean(reached) if reached else None
        t["reached"] = f"{len(reached)}/{len(times)}"


def compare(a: dict, b: dict) -> tuple[str, float, float]:
    """(verdict, difference, combined seed sd) of summary row ``a`` against ``b``.

    A winner is declared only with at least 2 seeds on each side and a difference in mean
    final accuracy larger than the combined seed spread sqrt(sd_a^2 + sd_b^2); otherwise
    the verdict says why there is none.
    """
    diff = a["final acc (mean)"] - b["final acc (mean)"]
    seeds = min(a["seeds"], b["seeds"])
    if seeds < 2:
        return f"no winner: {seeds} seed(s), the seed spread is unknown (run --seeds 2 or more)", diff, float("nan")
    noise = math.sqrt(sd_or_zero(a["seed spread (sd)"]) ** 2 + sd_or_zero(b["seed spread (sd)"]) ** 2)
    if abs(diff) <= noise:
        return "no winner: the difference is within the combined seed spread", diff, noise
    return ("beats" if diff > 0 else "trails"), diff, noise


def verdict_line(a: dict, b: dict, *, name_a: str, name_b: str, where: str = "") -> str:
    """One sentence: summary row ``a`` (``name_a``) against ``b`` by ``compare``, both means,
    the difference and the combined seed sd; ``where`` follows the names (" at equal time")."""
    verdict, diff, noise = compare(a, b)
    sd = f"combined seed sd {noise:.3f}" if math.isfinite(noise) else "combined seed sd unknown"
    head = (f"{name_a} {verdict} {name_b}{where}" if verdict in ("beats", "trails")
            else f"{name_a} vs {name_b}{where}: {verdict}")
    return f"{head}: {a['final acc (mean)']:.3f} vs {b['final acc (mean)']:.3f} (difference {diff:+.3f}, {sd})"


def findings(table: list[dict]) -> list[str]:
    """The study's sentences from its summary ``table``: CPPO vs GRPO at equal time, the paper's
    ordering smallest > random > largest per P, the beyond-the-paper selections vs CPPO, the
    equal-prompts reading and the supervised control."""
    arms, table = table, [t for t in table if (t.get("generation") or "all") == "all"]
    by = {(t["P"], t["metric"], t["allocation"]): t for t in table}
    out = []
    grpo = next((t for t in table if t["P"] == 0), None)
    for t in table:
        if grpo and t["P"] and t["metric"] == "smallest" and t["allocation"]:
            out.append(verdict_line(t, grpo, name_a=f"CPPO P={t['P']:g} with allocation", name_b="GRPO",
                                    where=" at equal time"))
    for p in sorted({t["P"] for t in table if t["P"]}):
        rows = {m: by[(p, m, True)] for m in ("smallest", "random", "largest") if (p, m, True) in by}
        if len(rows) == 3:
            accs = {m: r["final acc (mean)"] for m, r in rows.items()}
            spread = max(sd_or_zero(r["seed spread (sd)"]) for r in rows.values())
            text = (f"P={p:g}: {', '.join(f'{m} {a:.3f}' for m, a in accs.items())} (largest seed sd {spread:.3f}); "
                    "the paper's ordering smallest > random > largest ")
            gaps = [compare(rows["smallest"], rows["random"])[0], compare(rows["random"], rows["largest"])[0]]
            if min(r["seeds"] for r in rows.values()) < 2:
                text += "is not tested: 1 seed, the seed spread is unknown (run --seeds 2 or more)"
            elif gaps == ["beats", "beats"]:
                text += "holds, each gap beyond the combined seed spread"
            elif accs["smallest"] > accs["random"] > accs["largest"]:
                text += "holds in the means only: a gap is within the combined seed spread"
            else:
                text += "does not hold in the means"
            out.append(text)
    cppo = next((t for t in table if t["metric"] == "smallest" and t["P"] and t["allocation"]), None)
    for t in table:
        if cppo and t["metric"] in ("importance", "keep_mass") and t["allocation"]:
            out.append(verdict_line(t, cppo, name_a=t["config"], name_b=f"CPPO {cppo['config']}",
                                    where=" at equal time"))
    if grpo:
        key = "acc @ GRPO's prompts"
        eq = [f"{t['config']} {t[key]:.3f}" for t in table if t.get(key) is not None and t["metric"] != "sft"]
        if len(eq) > 1:  # GRPO and at least one pruned run were read at GRPO's prompts
            out.append("at equal prompts drawn (GRPO's final count, the paper's comparison): " + ", ".join(eq))
    out += generation_findings(arms, by)
    ctrl = next((t for t in table if t["metric"] == "sft"), None)
    if ctrl:
        out.append(f"supervised control for the same time: {ctrl['final acc (mean)']:.3f}")
    return out


def generation_findings(arms: list[dict], by: dict) -> list[str]:
    """Each arm that changes what is generated (selective rollout, the DAPO filter) against the
    same arm generating everything, and a pruned one against the filter alone (DAPO + CPPO vs
    DAPO); with its generation tokens per step where the rows have them."""
    out = []
    dapo_alone = next((t for t in arms if t.get("generation") == "dapo" and t["P"] == 0), None)
    for t in arms:
        gen = t.get("generation") or "all"
        base = by.get((t["P"], t["metric"], t["allocation"]))
        if gen == "all" or base is None:
            continue
        line = verdict_line(t, base, name_a=t["config"], name_b=base["config"], where=" at equal time")
        if t.get("gen tokens/step") and base.get("gen tokens/step"):
            line += (f"; generation tokens per step {t['gen tokens/step']:.0f} vs {base['gen tokens/step']:.0f} "
                     f"({t['gen tokens/step'] / base['gen tokens/step']:.2f}x)")
        out.append(line)
        if gen == "dapo" and t["P"] and dapo_alone is not None:
            out.append(verdict_line(t, dapo_alone, name_a=t["config"], name_b=dapo_alone["config"],
                                    where=" at equal time"))
    return out


def time_to_target(curve: list, target: float) -> float | None:
    """The first evaluation time at which accuracy >= ``target`` (None if never). ``curve``:
    [[seconds, accuracy, ...], ...] in time order. Resolution: the spacing of the points."""
    for point in curve:
        if point[1] >= target:
            return float(point[0])
    return None


def default_target(start: float, table: list[dict]) -> float:
    """Halfway from the start accuracy to the lowest arm's mean accuracy at the budget, if
    every arm gained; else halfway to the best arm's (rounded down to 0.01, but never to the
    start or below it: every arm would "reach" that at 0 s): a level the arms reach inside the
    budget, so their times to it can be compared."""
    finals = [t["final acc (mean)"] for t in table]
    low, high = min(finals), max(finals)
    end = low if low > start else high
    above_start = (math.floor(100 * start + 1e-9) + 1) / 100  # the first 0.01 step above the start
    if end <= start:
        return round(start + 0.01, 2)
    return max(math.floor(100 * (start + 0.5 * (end - start))) / 100, above_start)


def sd_or_zero(x: float) -> float:
    """A seed spread for arithmetic: 0.0 where it is missing (None) or unknown (NaN, one seed)."""
    return 0.0 if x is None or (isinstance(x, float) and math.isnan(x)) else x


def write_csv(path: Path, rows: list[dict]) -> None:
    """The per-run ``rows`` as CSV (the union of their keys; ``curve`` as JSON)."""
    fields = list(dict.fromkeys(k for r in rows for k in r if k != "curve")) + ["curve"]  # union: keep_mass rows
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow({**r, "curve": json.dumps(r["curve"])})


def plot_curves(ax, rows: list[dict], xlabel: str = "RL time (s)", label=None) -> None:
    """Accuracy vs time per configuration (runs named ``CONFIG_sSEED``): the mean over seeds
    at each evaluation point, with a ± sd band. ``label`` maps a configuration name to the
    legend's text (default: the name)."""
    configs: dict = {}
    for r in rows:
        configs.setdefault(r["run"].rsplit("_s", 1)[0], []).append(r["curve"])
    for name, curves in sorted(configs.items()):
        n = min(len(c) for c in curves)
        ts = [statistics.mean(c[i][0] for c in curves) for i in range(n)]
        ms = [statistics.mean(c[i][1] for c in curves) for i in range(n)]
        sd = [statistics.stdev([c[i][1] for c in curves]) if len(curves) > 1 else 0.0 for i in range(n)]
        line = ax.plot(ts, ms, "o-" if "control" not in name else "s--", ms=3, label=label(name) if label else name)[0]
        ax.fill_between(ts, [m - s for m, s in zip(ms, sd, strict=True)], [m + s for m, s in zip(ms, sd, strict=True)],
                        alpha=0.15, color=line.get_color())
    ax.set(xlabel=xlabel, ylabel="held-out accuracy", title="accuracy vs time (mean ± sd over seeds)")
    ax.legend(fontsize=6)

def plot_auc(ax, rows: list[dict]) -> None:
    """The early-stopping predictor's AUC per step (explore groups), one line per run."""
    for r in rows:
        pts = [(s, a) for s, a in r["auc_per_step"] if a is not None and a == a]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], ".-", label=r["run"], alpha=0.8)
    ax.axhline(0.5, color="k", ls=":", lw=1)
    ax.set(xlabel="RL step", ylabel="predictor AUC (explore groups)", title="early stopping: predictor quality",
           ylim=(0.3, 1.0))
    ax.legend(fontsize=6)


