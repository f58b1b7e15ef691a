"""The equal-time study inside veRL: ``cppo-megatron study RECIPE`` with a veRL recipe.

Each arm is a real ``cppo-megatron verl RECIPE`` run (its own Ray session; the legacy loop,
whatever engine the recipe names) from the same exported start model and data:

- ``grpo``: P = 0 through the ``cppo`` estimator and hook (every completion kept; the
  advantages equal veRL's ``grpo`` estimator's), so every arm logs its prompt counts;
- ``cppo P``: P with allocation (prompts per step x 1/(1-P), the same update batch);
- ``cppo P no-alloc``: P with GRPO's prompt count (the update batch shrinks by k/G).

``--rates``, ``--metrics`` and ``--allocation`` choose the arms as in the embedded study
(default: P in {0, 0.875}, metric ``smallest``, allocation both ways). ``--generation
all,selective,dapo`` crosses them with what is generated: ``selective`` (``cppo.selective.enabled``,
GRESO's skip before generation) and ``dapo`` (veRL's own ``algorithm.filter_groups``: groups with
equal rewards are dropped in its replay buffer and refilled); both live in veRL's V1 loop only, so
a study with any of them runs every arm on V1 (``trainer.use_v1=true``), the arms generating
everything too. ``--exclude`` leaves arms out by name (``p0_grpo_alloc_selective``).

Equal wall time. Every run trains for ``--budget`` seconds of wall time, counted from the
moment the start weights reach the rollout (veRL's initial weight sync: Ray and worker
start-up are not charged) — rollout, reward, the log-prob passes, the update, the weight
sync and veRL's own bookkeeping all are. The run's trainer ends veRL's loop when the budget is
spent (``integrations/verl/diagnostics/clock.py``), so veRL exits normally.

Evaluation at wall-clock points. veRL validates on step counts, and a validation inside a
run would take time from it. Instead the rollout server keeps the policy that was in force at
each of ``--evals`` equally spaced points of the budget (the last weights synced before the
point: a step that had not finished does not count), and after the run one evaluator, the
same for every arm, measures greedy held-out accuracy of each snapshot on ``--eval-problems``
problems of the task's test set, with the prompts and the scorer veRL uses. Interpolating
veRL's own step-count validations in time would mix validation noise (200 problems) with
the arms' different step lengths; snapshots grade every arm at the same instants.

Load drift. Runs go seed-major, and the arms' order rotates with the seed (seed 0: A B C,
seed 1: B C A, ...), so a slow stretch of a shared machine hits every arm, and no arm always
runs first. The 1-minute load average is sampled every 5 s during each run and reported (it
includes the run's own processes: about 2 on a 2-core machine).

Outputs in ``--out``: ``study_verl.{json,md,png}`` (accuracy vs wall time per arm with seed
bands; the step-time split per arm), ``study.csv`` (one row per run), each run's directory
``runs/ID`` (veRL log, ``metrics.jsonl``, the clock's syncs and snapshots, ``result.json``).

Cost per arm. The ``hf`` rollout server counts the completions it generated and their tokens at
every weight sync (``syncs.jsonl``): completions generated and generation tokens per step include
what the DAPO filter dropped and CPPO pruned; prompts consumed from the data set are the
completions generated / G plus the prompts selective rollout skipped (``selective/prompts_skipped``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from .heldout import Evaluator
from .load import LoadSampler
from .report import Report, median, publish
from .study_table import (
    GENERATION,
    arm_name,
    default_target,
    generation_findings,
    grid,
    plot_auc,
    plot_curves,
    run_id,
    summarize,
    time_to_target,
    verdict_line,
    write_csv,
)

__all__ = ["DAPO_OVERRIDES", "arm_overrides", "default_target", "generation_counts", "interleave", "is_verl_recipe",
           "phase_split", "run", "run_overrides", "time_to_target", "verdicts"]

VERL_DEFAULTS = {"rates": "0,0.875", "metrics": "smallest", "allocation": "both"}
VERL_METRICS = ("smallest", "random", "largest", "signed")
PHASES = ("gen", "old_log_prob", "ref", "adv", "update_actor", "update_weights")
# the study grades the policy in force at each wall-clock mark, which the `hf` rollout server keeps
# (integrations/verl/diagnostics/clock.py); it replaces a recipe's vLLM rollout
STUDY_ROLLOUT, ROLLOUT_KEY = "hf", "actor_rollout_ref.rollout.name"
STEP_LIMIT = 1_000_000  # veRL needs a step count; the clock ends the run long before
# --generation dapo: veRL's own group filter (V1's sync replay buffer), as recipes/verl/tiny_cpu_dapo_cppo.yaml
DAPO_OVERRIDES = ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=reward",
                  "algorithm.filter_groups.max_inflight_gen_batches=1"]
# what --generation sets in veRL (the embedded study's keys are the trainer's: study_table.GENERATION)
VERL_GENERATION = {"all": [], "selective": ["cppo.selective.enabled=true"], "dapo": DAPO_OVERRIDES,
                   "early_stop": ["cppo.early_stop.enabled=true"]}


def is_verl_recipe(path: str | Path) -> bool:
    """A hydra recipe for ``cppo-megatron verl`` (a top-level ``defaults:`` list, which the
    embedded trainer's recipes never have)."""
    p = Path(path)
    if not p.is_file() or p.suffix not in (".yaml", ".yml"):
        return False
    return any(line.startswith("defaults:") for line in p.read_text().splitlines())


# ------------------------------------------------------------------------------ arms and order
def arm_overrides(spec: dict) -> list[str]:
    """veRL overrides of one arm: the ``cppo`` estimator at P (0 for GRPO), its metric and
    allocation, the seed in every place veRL and the plugin draw from, and what it generates
    (``spec["generation"]``: nothing more for ``all``; selective rollout; veRL's DAPO filter)."""
    metric = "smallest" if spec["metric"] == "grpo" else spec["metric"]
    if metric not in VERL_METRICS:
        raise ValueError(f"study on veRL: metric {spec['metric']!r} is not available there; use one of {VERL_METRICS}")
    seed = int(spec["seed"])
    out = ["algorithm.adv_estimator=cppo", f"cppo.pruning_rate={float(spec['P'])}",
           f"cppo.allocation={'true' if spec['allocation'] else 'false'}",
           f"cppo.metric={'smallest' if metric == 'signed' else metric}",
           f"cppo.use_abs={'false' if metric == 'signed' else 'true'}",
           f"cppo.seed={seed}", f"data.seed={seed}", f"actor_rollout_ref.rollout.seed={seed}",
           f"actor_rollout_ref.actor.data_loader_seed={seed}"]
    gen = spec.get("generation") or "all"
    if gen not in VERL_GENERATION:
        raise ValueError(f"study on veRL: generation {gen!r} is not available there; "
                         f"use one of {list(VERL_GENERATION)}")
    return out + VERL_GENERATION[gen]


def run_overrides(run_dir: Path, model_dir: Path, data_dir: Path, run_id: str, *, use_v1: bool = False) -> list[str]:
    """What every study run sets: its own run directory, the shared start model and data, the
    loop (legacy, or V1 for a study with selective rollout or the DAPO filter; the budget stop is
    installed in both), no validation or checkpoint inside the budget, and a step count the clock
    never reaches."""
    return [f"cppo_cpu.run_dir={run_dir}", f"cppo_cpu.model_dir={model_dir}", f"cppo_cpu.data_dir={data_dir}",
            f"trainer.experiment_name={run_id}", f"trainer.total_training_steps={STEP_LIMIT}",
            "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1",
            f"trainer.use_v1={'true' if use_v1 else 'false'}"]


def interleave(runs: list[dict]) -> list[dict]:
    """Seed-major order with the arms rotated by the seed's position (seed 0: A B C, seed 1:
    B C A, seed 2: C A B): each arm runs in every position once per len(arms) seeds."""
    seeds = list(dict.fromkeys(r["seed"] for r in runs))
    out = []
    for i, seed in enumerate(seeds):
        arms = [r for r in runs if r["seed"] == seed]
        k = i % len(arms)
        out += arms[k:] + arms[:k]
    return out


# ------------------------------------------------------------------------------ one run
def _run_verl(args_list: list[str], env: dict, log_path: Path, timeout_s: float) -> tuple[int, float]:
    """Run one veRL process (own process group) to its end; stop it after ``timeout_s``."""
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(args_list, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)  # its own group: veRL's driver and the Ray it started
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc = -signal.SIGTERM
    return rc, time.perf_counter() - t0


def _metrics(path: Path) -> dict[int, dict]:
    rows: dict[int, dict] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                rows.setdefault(int(rec["step"]), {}).update(rec["data"])
    return rows


def phase_split(metrics: dict[int, dict], steps: list[int], skip: int = 1,
                generate_s: dict[int, float] | None = None) -> dict:
    """Median seconds per step of veRL's ``timing_s/*`` phases over ``steps`` (the first
    ``skip`` left out while more remain), and per prompt; ``other`` is the step's remainder
    (metrics, data loading). ``generate_s``: the rollout server's HF ``generate`` seconds per
    step — the model's share of ``timing_s/gen``; the rest of it is veRL's per-request work."""
    use = [s for s in steps if "timing_s/step" in metrics.get(s, {})]
    use = use[skip:] if len(use) > skip else use
    if not use:
        return {}
    out: dict[str, float] = {"step_s": median(metrics[s]["timing_s/step"] for s in use)}
    if generate_s and all(s in generate_s for s in use):
        out["hf_generate_s"] = median(generate_s[s] for s in use)
    for ph in PHASES:
        out[f"{ph}_s"] = median(metrics[s].get(f"timing_s/{ph}", 0.0) for s in use)
    out["other_s"] = max(out["step_s"] - sum(out[f"{ph}_s"] for ph in PHASES), 0.0)
    prompts = median(metrics[s].get("cppo/num_groups", 0.0) for s in use)
    out["prompts_per_step"] = prompts
    out["completions_per_step"] = median(metrics[s].get("cppo/num_completions", 0.0) for s in use)
    out["trained_per_step"] = median(metrics[s].get("cppo/num_kept", 0.0) for s in use)
    if prompts:
        out["gen_ms_per_prompt"] = 1e3 * out["gen_s"] / prompts
        out["step_ms_per_prompt"] = 1e3 * out["step_s"] / prompts
    return out


def run_one(recipe: str, user_overrides: list[str], spec: dict, out: Path, model_dir: Path, data_dir: Path,
            budget: float, marks: list[float], timeout_s: float, *, use_v1: bool = False) -> dict:
    """One arm-seed: the veRL run under the clock; returns the raw result (no evaluation)."""
    from ..integrations.verl.diagnostics import clock

    name = run_id(spec)
    run_dir = (out / "runs" / name).resolve()
    clock_dir = run_dir / "clock"
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)  # a clean slate: veRL's file logger appends, the clock's logs too
    clock.write_settings(clock_dir, budget, marks)
    args_list = [sys.executable, "-m", "cppo_megatron.integrations.verl.main", recipe, *user_overrides,
                 *arm_overrides(spec), *run_overrides(run_dir, model_dir, data_dir, name, use_v1=use_v1)]
    env = {**os.environ, clock.ENV: str(clock_dir)}
    env.pop("CPPO_VERL_AUDIT", None)
    arm = arm_overrides(spec)
    print(f"study verl: {name}: {' '.join(arm[:3] + arm[9:10])} for {budget:g} s (log {run_dir / 'verl.log'})",
          flush=True)
    with LoadSampler() as load:
        rc, wall = _run_verl(args_list, env, run_dir / "verl.log", budget + timeout_s)
    if rc != 0:
        tail = "\n".join((run_dir / "verl.log").read_text(errors="replace").splitlines()[-15:])
        raise RuntimeError(f"study verl: run {name} failed (exit {rc}); log {run_dir / 'verl.log'}:\n{tail}")
    result = {"run": name, "spec": spec, "command": args_list[2:], "wall_s": wall, **load.summary()}
    (run_dir / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def generation_counts(sync_rows: list[dict], metrics: dict[int, dict], step: int, group_size: int) -> dict | None:
    """What a run generated in its first ``step`` steps, from the ``hf`` rollout server's counters
    at its last weight sync of a step <= ``step`` (``syncs.jsonl``).

    Args:
        sync_rows: the clock's sync records (``step``, ``requests``, ``tokens``: cumulative).
        metrics: veRL's metrics per step (``selective/prompts_skipped`` where selective rollout ran;
            ``early_stop/started`` where early stopping ran, whose segments are requests of their own).
        step: the last step counted (>= 0).
        group_size: G, completions per prompt (``actor_rollout_ref.rollout.n``).

    Returns:
        ``completions`` generated and generation ``tokens`` (both including what the DAPO filter
        dropped and CPPO pruned), ``skipped`` prompts, ``prompts`` consumed from the data set
        (completions / G + skipped) and ``tokens_per_step``; None when the sync log carries no
        counters (a run from before they were logged).
    """
    if int(group_size) < 1 or int(step) < 0:
        raise ValueError(f"generation_counts: group_size must be >= 1 and step >= 0, got {group_size}, {step}")
    rows = [r for r in sync_rows if int(r["step"]) <= step and "tokens" in r]
    if not rows:
        return None
    last = max(rows, key=lambda r: (int(r["step"]), float(r["elapsed"])))
    completions, tokens = int(last["requests"]), int(last["tokens"])
    started = [metrics.get(s, {}).get("early_stop/started") for s in range(1, step + 1)]
    if step and None not in started:
        # early stopping sends each segment as its own request: count the completions it started
        completions = int(sum(float(v or 0.0) for v in started))
    skipped = float(sum(metrics.get(s, {}).get("selective/prompts_skipped", 0.0) for s in range(1, step + 1)))
    return {"completions": completions, "tokens": tokens, "skipped": skipped,
            "prompts": completions / group_size + skipped, "tokens_per_step": tokens / step if step else 0.0}


def evaluate_run(result: dict, out: Path, evaluator: Evaluator, start: dict, group_size: int) -> dict:
    """The study row of a finished run: accuracy of the policy in force at each mark (one
    shared evaluator), prompts consumed and completions generated and trained up to it,
    generation tokens per step, the step-time split, the load."""
    from ..integrations.verl.diagnostics import clock

    spec = result["spec"]
    run_dir = out / "runs" / result["run"]
    c = clock.read_run(run_dir / "clock")
    metrics = _metrics(run_dir / "metrics.jsonl")
    budget = c["settings"].marks[-1]  # the last mark is the budget

    def upto(step: int, key: str) -> float:
        return float(sum(metrics.get(s, {}).get(key, 0.0) for s in range(1, step + 1)))

    def prompts(step: int) -> float:
        g = generation_counts(c["sync_rows"], metrics, step, group_size)
        return g["prompts"] if g is not None else upto(step, "cppo/num_groups")

    curve = [[0.0, start["accuracy"], 0.0]]
    final_eval = start
    for m in c["settings"].marks:
        pol = c["policies"][m]
        ev = evaluator.accuracy(pol["file"])
        curve.append([m, ev["accuracy"], prompts(int(pol["step"]))])
        final_eval = ev
    step_at_budget = int(c["policies"][budget]["step"])
    trained = [s for s in range(1, step_at_budget + 1)]
    syncs = dict(c["syncs"])
    gen_total = {int(r["step"]): float(r["generate_s"]) for r in c["sync_rows"] if "generate_s" in r}
    gen_per_step = {s: gen_total[s] - gen_total[s - 1] for s in gen_total if s - 1 in gen_total}
    counts = generation_counts(c["sync_rows"], metrics, step_at_budget, group_size)
    stopped = [float(metrics[s]["early_stop/stopped_share"]) for s in trained
               if "early_stop/stopped_share" in metrics.get(s, {})]
    tokens = [float(metrics[s].get("early_stop/tokens_generated", metrics[s].get("signal/generated_tokens", 0.0)))
              for s in trained if s in metrics]
    return {
        "run": result["run"], **spec,
        "steps": step_at_budget,
        "accuracy_start": start["accuracy"],
        "accuracy_final": final_eval["accuracy"],
        "eval_stderr": final_eval["stderr"],
        "prompts_drawn": prompts(step_at_budget),
        "completions_generated": (counts["completions"] if counts is not None
                                  else upto(step_at_budget, "cppo/num_completions")),
        # the rollout server's counters (the hf stand-in), else the rows' tokens (signal/*, early_stop/*)
        "gen_tokens_per_step": counts["tokens_per_step"] if counts is not None else (
            sum(tokens) / len(tokens) if tokens else None),
        "stopped_share": sum(stopped) / len(stopped) if stopped else None,
        "auc_per_step": [[s, metrics[s].get("early_stop/predictor_auc")] for s in trained
                         if "early_stop/predictor_auc" in metrics.get(s, {})] or None,
        "prompts_skipped": upto(step_at_budget, "selective/prompts_skipped"),
        "groups_filtered": upto(step_at_budget, "training/filter_groups/evicted_samples"),
        "completions_trained": upto(step_at_budget, "cppo/num_kept"),
        "accuracy_at_grpo_prompts": None,
        "prompts_at_grpo_prompts": None,
        "curve": curve,
        "steps_run": max(syncs) if syncs else 0,
        "last_sync_s": max(syncs.values()) if syncs else 0.0,
        "wall_s": result["wall_s"],
        "load_mean": result["load_mean"], "load_max": result["load_max"],
        "phases": phase_split(metrics, trained, generate_s=gen_per_step),
    }


# ------------------------------------------------------------------------------ reading
def verdicts(table: list[dict]) -> list[str]:
    """The CPPO arms against GRPO at the budget (``study_table.compare``: a winner only beyond the
    combined seed spread with >= 2 seeds a side)."""
    arms = table
    table = [t for t in table if (t.get("generation") or "all") == "all"]
    grpo = next((t for t in table if t["P"] == 0), None)
    out: list[str] = []
    by = {(t["P"], t["metric"], t["allocation"]): t for t in table}
    if grpo is None:
        return out + generation_findings(arms, by)
    for t in table:
        if not t["P"]:
            continue
        out.append(verdict_line(t, grpo, name_a=f"CPPO {t['config']}", name_b="GRPO", where=" at equal wall time"))
    for t in table:  # with and without allocation at the same P and metric
        other = next((o for o in table if o["P"] == t["P"] and o["metric"] == t["metric"] and t["allocation"]
                      and not o["allocation"]), None) if t["P"] else None
        if other is not None:
            out.append(verdict_line(t, other, name_a=f"CPPO {t['config']} (allocation)", name_b=other["config"]))
    return out + generation_findings(arms, by)


def _arm_key(row: dict) -> tuple:
    return (row["kind"], row["P"], row["metric"], row["allocation"], row.get("generation") or "all")


def enrich(table: list[dict], rows: list[dict], target: float) -> None:
    """Add time to ``target``, steps within the budget, the step-time split and the load to
    each summary row (in place)."""
    for t in table:
        rs = [r for r in rows if _arm_key(r) == (t.get("kind", "rl"), t["P"], t["metric"], t["allocation"],
                                                 t.get("generation") or "all")]
        times = [time_to_target(r["curve"], target) for r in rs]
        reached = [x for x in times if x is not None]
        t["time to target (s)"] = statistics.mean(reached) if reached else None
        t["reached"] = f"{len(reached)}/{len(rs)}"
        t["time to target sd"] = statistics.stdev(reached) if len(reached) > 1 else None
        ph = [r["phases"] for r in rs if r.get("phases")]
        for key in ("step_s", "gen_s", "hf_generate_s", "old_log_prob_s", "ref_s", "update_actor_s",
                    "update_weights_s", "other_s", "gen_ms_per_prompt", "step_ms_per_prompt"):
            vals = [p[key] for p in ph if key in p]
            t[key] = statistics.mean(vals) if vals else None
        t["s/step"] = t["step_s"]
        t["gen share"] = (t["gen_s"] / t["step_s"]) if t.get("gen_s") and t.get("step_s") else None
        t["load (mean)"] = statistics.mean(r["load_mean"] for r in rs)


def why_notes(table: list[dict]) -> list[str]:
    """What the phase split says about cost: generation per prompt and the update per step."""
    notes = []
    grpo = next((t for t in table if t["P"] == 0 and t.get("step_s")), None)
    for t in table:
        if not t.get("step_s"):
            continue
        notes.append(
            f"{t['config']}: {t['s/step']:.1f} s/step (median) = gen {t['gen_s']:.1f} s + old log-prob "
            f"{t['old_log_prob_s']:.1f} + ref {t['ref_s']:.1f} + update {t['update_actor_s']:.1f} + weight sync "
            f"{t['update_weights_s']:.1f} + other {t['other_s']:.1f}; {t['prompts']:.0f} prompts in "
            f"{t['steps']:.1f} steps within the budget; generation {t['gen_ms_per_prompt']:.0f} ms per prompt"
            + (f", of which HF generate {t['hf_generate_s']:.1f} s a step "
               f"({100 * t['hf_generate_s'] / t['gen_s']:.0f}% of "
               "gen; the rest is veRL's per-request agent-loop work)" if t.get("hf_generate_s") and t["gen_s"] else ""))
    if grpo is not None:
        for t in table:
            if t["P"] and t.get("step_s") and t["allocation"]:
                per_step = t["prompts"] / max(t["steps"], 1e-9)
                grpo_per_step = grpo["prompts"] / max(grpo["steps"], 1e-9)
                notes.append(
                    f"{t['config']} vs GRPO: {t['s/step'] / grpo['s/step']:.1f}x the time per step for "
                    f"{per_step / max(grpo_per_step, 1e-9):.1f}x "
                    f"the prompts per step; generation is {100 * t['gen share']:.0f}% of its step "
                    f"(GRPO {100 * grpo['gen share']:.0f}%), and pruning removes none of it")
    return notes


def _label(r: dict) -> str:
    """``GRPO``, ``CPPO P=0.875``, ``CPPO P=0.875 no-alloc`` (plus a non-default metric)."""
    gen = GENERATION[r.get("generation") or "all"][1]
    if not r["P"]:
        return f"GRPO{gen}"
    metric = "" if r["metric"] == "smallest" else f" {r['metric']}"
    return f"CPPO P={r['P']:g}{metric}{'' if r['allocation'] else ' no-alloc'}{gen}"


def _plot(fig, rows: list[dict], table: list[dict], target: float) -> None:
    aucs = [r for r in rows if r.get("auc_per_step")]
    cols = 3 if aucs else 2
    if aucs:
        plot_auc(fig.add_subplot(1, cols, 3), aucs)
    ax1 = fig.add_subplot(1, cols, 1)
    names = {arm_name(r): _label(r) for r in rows}
    plot_curves(ax1, rows, xlabel="wall time in veRL (s)", label=lambda n: names.get(n, n))
    ax1.axhline(target, color="grey", ls=":", lw=1)
    ax2 = fig.add_subplot(1, cols, 2)
    parts = [("gen_s", "generation"), ("old_log_prob_s", "old log-prob"), ("ref_s", "ref"),
             ("update_actor_s", "update"), ("update_weights_s", "weight sync"), ("other_s", "other")]
    arms = [_label(t) for t in table if t.get("step_s")]
    bottom = [0.0] * len(arms)
    for key, label in parts:
        vals = [t.get(key) or 0.0 for t in table if t.get("step_s")]
        ax2.bar(arms, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax2.set(ylabel="seconds per step (median)", title="where a veRL step goes")
    ax2.tick_params(axis="x", labelsize=6, labelrotation=25)  # five arms' names would overlap flat
    ax2.legend(fontsize=6)


# ------------------------------------------------------------------------------ the command
def _verl_args(args: argparse.Namespace) -> argparse.Namespace:
    bad = [name for name, given in (("--full", args.full), ("--warmup-checkpoint", args.warmup_checkpoint),
                                    ("--clock cpu", args.clock == "cpu")) if given]
    if bad:
        raise ValueError(f"study on a veRL recipe: {', '.join(bad)} not available (veRL runs are several processes "
                         "timed on the wall, from the recipe's exported start model)")
    a = argparse.Namespace(**vars(args))
    for key, default in VERL_DEFAULTS.items():
        if getattr(a, key) is None:
            setattr(a, key, default)
    a.no_control = True  # the supervised control belongs to the embedded trainer
    unknown = [m for m in a.metrics.split(",") if m.strip() not in VERL_METRICS]
    if unknown:
        raise ValueError(f"--metrics {unknown}: not available in veRL; choose from {list(VERL_METRICS)}")
    for o in args.overrides:
        if o.split("=", 1)[0].lstrip("+") in ("trainer.use_v1", "trainer.total_training_steps", "cppo.pruning_rate",
                                              "cppo.allocation", "algorithm.adv_estimator", "cppo.selective.enabled",
                                              "algorithm.filter_groups.enable"):
            raise ValueError(f"override {o!r}: the study sets it per arm (loop, budget, arms; --generation for "
                             "selective rollout and the DAPO filter)")
    return a


def compose(recipe: str, overrides: list[str]):
    """The recipe composed by hydra as ``cppo-megatron verl`` would (no Ray, no veRL start)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from ..integrations.verl.main import SEARCHPATH, recipe_args

    argv = recipe_args([recipe, *overrides])
    cdir = next(a.split("=", 1)[1] for a in argv if a.startswith("--config-path="))
    name = next(a.split("=", 1)[1] for a in argv if a.startswith("--config-name="))
    rest = [a for a in argv if not a.startswith("--config-")]
    if SEARCHPATH not in rest and not any(a.startswith("hydra.searchpath") for a in rest):
        rest.insert(0, SEARCHPATH)
    with initialize_config_dir(config_dir=cdir, version_base=None):
        return hydra_compose(config_name=name, overrides=rest)


def study_config(a: argparse.Namespace, recipe: str):
    """The recipe composed for the study, and the overrides that compose it: a CPU-mode recipe,
    its rollout switched to ``STUDY_ROLLOUT`` (whose server keeps the policy at each wall-clock
    mark) unless the user named another one, which is refused."""
    from ..integrations.verl.cpu.prepare import GROUP

    overrides = list(a.overrides)
    config = compose(recipe, overrides)
    if str(config.trainer.get("device", "")) != "cpu" or config.get(GROUP) is None:
        raise ValueError(f"{a.recipe}: the veRL study runs CPU-mode recipes (trainer.device=cpu with a {GROUP} "
                         "group, e.g. recipes/verl/tiny_cpu_grpo.yaml)")
    if str(config.actor_rollout_ref.rollout.name) != STUDY_ROLLOUT:
        if any(o.split("=", 1)[0].lstrip("+") == ROLLOUT_KEY for o in overrides):
            raise ValueError(f"the veRL study needs {ROLLOUT_KEY}={STUDY_ROLLOUT}: its rollout server keeps the "
                             "policy at each wall-clock mark for the held-out evaluation (vLLM's does not)")
        was = str(config.actor_rollout_ref.rollout.name)
        overrides = [f"{ROLLOUT_KEY}={STUDY_ROLLOUT}", *overrides]
        config = compose(recipe, overrides)
        print(f"study verl: generating with the `{STUDY_ROLLOUT}` rollout instead of the recipe's "
              f"`{was}`: its server keeps the policy in force at each wall-clock mark, which "
              "the held-out evaluation grades; vLLM's server does not", flush=True)
    return config, overrides


def run(args: argparse.Namespace) -> int:
    from ..integrations.verl.cpu.phases import Phases, choose_threads
    from ..integrations.verl.cpu.prepare import GROUP, ensure_inputs

    a = _verl_args(args)
    if a.seeds < 1 or a.budget <= 0 or a.evals < 1:
        raise ValueError(f"--seeds, --budget, --evals must be positive, got {a.seeds}, {a.budget}, {a.evals}")
    runs = interleave(grid(a))  # a wrong --exclude/--generation fails here, before the start model is built
    gens = [g.strip() for g in (getattr(a, "generation", None) or "all").split(",")]
    use_v1 = any(g != "all" for g in gens)  # selective rollout and veRL's filter exist in V1 only
    recipe = str(Path(a.recipe).resolve())
    config, overrides = study_config(a, recipe)
    group = config[GROUP]
    model_dir, data_dir = (Path(str(group[k])).expanduser().resolve() for k in ("model_dir", "data_dir"))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ensure_inputs(group, model_dir, data_dir, Phases())  # built once, before any run, charged to none
    import torch

    torch.set_num_threads(choose_threads())
    evaluator = Evaluator(model_dir, str(group.warmup_recipe), a.eval_problems,
                          int(config.data.max_response_length))
    start = evaluator.accuracy(None)
    marks = [round(a.budget * (i + 1) / a.evals, 3) for i in range(a.evals)]
    print(f"study verl: {len(runs)} runs x {a.budget:g} s of wall time from {model_dir} (held-out accuracy "
          f"{start['accuracy']:.3f} on {start['problems']} problems); evaluations at {marks} s", flush=True)
    t0 = time.perf_counter()
    rows = run_arms(a, runs, recipe, overrides, out=out, model_dir=model_dir, data_dir=data_dir, marks=marks,
                    evaluator=evaluator, start=start, group_size=int(config.actor_rollout_ref.rollout.n),
                    use_v1=use_v1, t0=t0)
    title = (f"study in veRL on {Path(a.recipe).name}: {a.budget:g} s of wall time per run, {a.seeds} seed(s), "
             f"{'V1' if use_v1 else 'legacy'} loop, {config.actor_rollout_ref.actor.strategy} engine")
    params = {"recipe": a.recipe, "overrides": overrides, "rates": a.rates, "metrics": a.metrics,
              "allocation": a.allocation, "generation": ",".join(gens), "exclude": getattr(a, "exclude", None),
              "seeds": a.seeds, "budget": a.budget, "evals": a.evals, "eval_problems": a.eval_problems}
    report_study(a, rows, start, marks, title=title, params=params, model_dir=model_dir, out=out, t0=t0)
    return 0


def run_arms(a: argparse.Namespace, runs: list[dict], recipe: str, overrides: list[str], *, out: Path,
             model_dir: Path, data_dir: Path, marks: list[float], evaluator: Evaluator, start: dict,
             group_size: int, use_v1: bool, t0: float) -> list[dict]:
    """Each arm-seed of ``runs`` in order: its veRL run (or, with ``--reuse``, the result a
    finished one left), then its policies graded at ``marks``; one row per run, ``study.csv``
    rewritten and a progress line printed after each."""
    import torch

    from ..integrations.verl.cpu.phases import choose_threads

    rows: list[dict] = []
    for i, spec in enumerate(runs):
        done = out / "runs" / run_id(spec) / "result.json"
        if a.reuse and done.is_file():
            result = json.loads(done.read_text())
            print(f"study verl: reusing {result['run']}", flush=True)
        else:
            result = run_one(recipe, overrides, spec, out, model_dir, data_dir, a.budget, marks,
                             a.run_timeout, use_v1=use_v1)
        torch.set_num_threads(choose_threads())
        row = evaluate_run(result, out, evaluator, start, group_size)
        rows.append(row)
        write_csv(out / "study.csv", [{k: v for k, v in r.items() if k != "phases"} for r in rows])
        print(f"[{i + 1}/{len(runs)}] {row['run']}: accuracy {row['accuracy_start']:.3f} -> "
              f"{row['accuracy_final']:.3f} "
              f"at {a.budget:g} s ({row['steps']} steps, load {row['load_mean']:.1f}, "
              f"{time.perf_counter() - t0:.0f} s elapsed)", flush=True)
    return rows


def study_notes(table: list[dict], rows: list[dict], start: dict, target: float, *, budget: float, evals: int,
                model_dir: Path, info: dict, elapsed_s: float) -> list[str]:
    """The lines under the study's table: the verdicts, each arm's time to ``target``, the
    phase split, the start model, the load during the runs and what the study cost."""
    return verdicts(table) + [
        f"time to accuracy {target:.2f} (first evaluation point at or above it; points every "
        f"{budget / evals:g} s): " + ", ".join(
            f"{t['config']} {t['time to target (s)']:.0f} s ({t['reached']} seeds)"
            if t["time to target (s)"] is not None
            else f"{t['config']} not reached ({t['reached']})" for t in table),
        *why_notes(table),
        f"start model: {model_dir} (held-out accuracy {start['accuracy']:.3f} on {start['problems']} problems; "
        f"warm-up {info.get('sft_steps', '?')} SFT steps)",
        f"load average during the runs (includes the run's own processes): mean "
        f"{statistics.mean(r['load_mean'] for r in rows):.1f}, max {max(r['load_max'] for r in rows):.1f}",
        f"the runs took {sum(r['wall_s'] for r in rows) / 60:.0f} min of wall time in all (each: Ray and worker "
        f"start-up, the budget, the step in progress at its end); this command {elapsed_s:.0f} s",
    ]


def report_study(a: argparse.Namespace, rows: list[dict], start: dict, marks: list[float], *, title: str,
                 params: dict, model_dir: Path, out: Path, t0: float) -> None:
    """The study's table (one row per arm, with its time to the target accuracy), its notes
    and plot, written to ``out`` as ``study_verl.{json,md,png}`` and printed."""
    from ..integrations.verl.cpu.prepare import start_model_info

    table, _ = summarize(rows)
    for t in table:
        t["kind"] = "rl"
    target = a.target if a.target is not None else default_target(start["accuracy"], table)
    enrich(table, rows, target)
    notes = study_notes(table, rows, start, target, budget=a.budget, evals=a.evals, model_dir=model_dir,
                        info=start_model_info(model_dir) or {}, elapsed_s=time.perf_counter() - t0)
    report = Report(
        name="study_verl",
        title=title,
        params={**params, "target": target, "order": [r["run"] for r in rows]},
        columns=["config", "seeds", "final acc (mean)", "seed spread (sd)", "eval stderr", "time to target (s)",
                 "reached", "steps", "prompts", "trained", "gen tokens/step", "s/step", "gen share", "load (mean)"],
        rows=table,
        notes=notes,
        extras={"runs": rows, "start": start, "marks": marks},
        plot=lambda fig: _plot(fig, rows, table, target),
    )
    publish(report, out, plot=not a.no_plot)
    print(f"per-run rows: {out / 'study.csv'}")
