"""study: pruning rates x metrics x allocation x seeds at equal time budgets, plus a
supervised control, on one recipe. Answers: does CPPO with allocation beat GRPO at equal
time, does the paper's ordering smallest > random > largest hold at this scale, and do
the beyond-the-paper selections (``importance``, ``keep_mass``) beat CPPO?

Every run is also read at equal prompts drawn (the paper's comparison: accuracy after the
same training data): each pruned run is evaluated once more when its prompts drawn reach
the final count of the same seed's GRPO run (``accuracy_at_grpo_prompts``).

Every run starts from the same warm-up weights and gets the same RL time budget
(``--budget`` seconds on ``--clock``: ``wall``, or ``cpu`` = this process's CPU time,
which a busy shared machine distorts less). Held-out accuracy is measured at fixed points
of the budget; evaluation time is not charged to the budget. The control continues
supervised training from the same weights for the same budget.

  cppo-megatron study recipes/tiny_cpu.yaml                  # default grid, ~45 min on 2 cores
  cppo-megatron study recipes/tiny_cpu.yaml --full           # every rate, metric, allocation
  cppo-megatron study recipes/tiny_cpu.yaml --seeds 1 --budget 20 --rates 0,0.875 --metrics smallest

With a veRL recipe the same command runs the study inside veRL (``bench/verl_study.py``):
GRPO, CPPO with and without allocation, each a real veRL run for the same wall-clock budget,
evaluated afterwards at fixed wall-clock points by one shared evaluator:

  cppo-megatron study recipes/verl/tiny_cpu_grpo.yaml --seeds 3 --budget 300 --evals 10
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from ..recipes import arg_type as recipe_arg
from ..trainer.config import replace_recipe
from .report import Report, publish
from .speedup import warm_start
from .study_table import (
    DEFAULT,
    FULL,
    GENERATION,
    METRIC_SETTINGS,
    add_time_to_target,
    default_target,
    grid,
    plot_auc,
    plot_curves,
    run_id,
    sd_or_zero,
    summarize,
    write_csv,
)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", type=recipe_arg("train", "verl"), help="recipe YAML (e.g. recipes/tiny_cpu.yaml)")
    parser.add_argument("overrides", nargs="*", help="recipe overrides key=value (applied to every run)")
    parser.add_argument("--rates", default=None, help=f"comma-separated P (default {DEFAULT['rates']})")
    parser.add_argument("--metrics", default=None,
                        help=f"comma-separated of {','.join(METRIC_SETTINGS)} (default {DEFAULT['metrics']}); "
                             "keep_mass runs once per seed with --keep-mass, not per P")
    parser.add_argument("--keep-mass", type=float, default=0.9, help="f of the keep_mass runs (default 0.9)")
    parser.add_argument("--allocation", choices=["on", "off", "both"], default=None, help="default on")
    parser.add_argument("--full", action="store_true", help=f"the full grid: {FULL}")
    parser.add_argument("--generation", default=None,
                        help="comma-separated of " + ",".join(GENERATION) + " (default all): what each arm generates; "
                             "selective = cppo.selective.enabled (GRESO: skip prompts whose recent groups all had "
                             "equal rewards), dapo = cppo.dynamic_sampling (drop zero-variance groups, refill), "
                             "early_stop = cppo.early_stop (P > 0 only), two_wave = cppo.two_wave (k completions "
                             "per prompt first, the rest only where they varied; at P=0 GRPO + two waves); "
                             "crossed with every rate, metric and allocation; with a veRL recipe every arm then runs "
                             "veRL's V1 loop (the one that filters and that selective rollout hooks)")
    parser.add_argument("--exclude", default=None,
                        help="comma-separated arms to leave out, by run name without the seed (e.g. "
                             "p0_grpo_alloc_selective: GRPO with selective rollout); an unknown name lists the arms")
    parser.add_argument("--seeds", type=int, default=3,
                        help="seeds per configuration (default 3); a winner is named only with >= 2 seeds and a "
                             "difference beyond the combined seed spread")
    parser.add_argument("--budget", type=float, default=100.0, help="RL seconds per run (default 100)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    parser.add_argument("--evals", type=int, default=5, help="evaluations spread over the budget (default 5)")
    parser.add_argument("--no-control", action="store_true", help="skip the supervised control runs")
    parser.add_argument("--warmup-checkpoint", default=None)
    parser.add_argument("--out", default="runs/study", help="output directory (default runs/study)")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
    verl = parser.add_argument_group(
        "veRL recipes", "with a veRL recipe (recipes/verl/*.yaml) the study runs veRL itself: one veRL process per arm "
        "and seed, each for --budget seconds of wall time, arms interleaved (default arms: --rates 0,0.875 "
        "--allocation both; docs/benchmarks.md)")
    verl.add_argument("--target", type=float, default=None,
                      help="held-out accuracy whose time to reach is reported per arm, in both studies (default: "
                           "halfway from the start to the lowest arm's mean accuracy at the budget)")
    verl.add_argument("--eval-problems", type=int, default=1000,
                      help="held-out problems of the shared evaluator (default 1000)")
    verl.add_argument("--reuse", action="store_true",
                      help="keep the runs in --out that finished (result.json) and run only the missing ones")
    verl.add_argument("--run-timeout", type=float, default=1800.0,
                      help="seconds a veRL run may take beyond --budget (start-up, the last step) before it is "
                           "stopped and reported as failed (default 1800)")


def _clock(name: str):
    return time.process_time if name == "cpu" else time.perf_counter


def run_rl(recipe, warm: Path, spec: dict, budget: float, clock_name: str, evals: int, out: Path,
           eval_at_prompts: float | None = None) -> dict:
    """One RL run for ``budget`` seconds; ``eval_at_prompts``: evaluate once more when the
    prompts drawn first reach this count (the equal-prompts reading)."""
    from ..trainer import Trainer

    metric, use_abs = METRIC_SETTINGS[spec["metric"]] if spec["metric"] != "grpo" else ("smallest", True)
    keep_mass = spec.get("keep_mass") if spec["metric"] == "keep_mass" else None
    r = replace_recipe(
        recipe,
        seed=spec["seed"],
        out_dir=str(out / "runs" / run_id(spec)),
        init_checkpoint=str(warm),
        **{
            "cppo.pruning_rate": spec["P"], "cppo.keep_per_group": None, "cppo.keep_mass": keep_mass,
            "cppo.metric": metric,
            "cppo.use_abs": use_abs, "cppo.allocation": spec["allocation"], "cppo.seed": spec["seed"],
            "warmup.enabled": False, "eval.every": 0, "log.progress": False, "log.tensorboard": False,
            "log.plots": False, "log.checkpoint_every": 0, "train.steps": 10**9, "train.max_time_s": 0.0,
            **GENERATION[spec.get("generation") or "all"][0],
        },
    )
    t = Trainer(r)
    t.prepare(initial_eval=False)
    clock = _clock(clock_name)
    curve = [(0.0, t._evaluate(r.eval.num_problems), 0.0)]
    used, next_eval = 0.0, budget / evals
    last = {}
    at_prompts = None
    tokens = 0.0  # generated, every round of every step
    stopped, auc = [], []  # early stopping: share stopped and the predictor's AUC per step
    while used < budget:
        c0 = clock()
        last = t.step_once()
        t.main_logger.log(last, t.step)
        used += clock() - c0
        tokens += float(last.get("rollout/tokens", 0.0))
        if "early_stop/stopped_share" in last:
            stopped.append(float(last["early_stop/stopped_share"]))
            auc.append([t.step, last.get("early_stop/predictor_auc")])
        drawn = float(last["alloc/total_prompts_drawn"])
        if at_prompts is None and eval_at_prompts is not None and drawn >= eval_at_prompts:
            at_prompts = (drawn, t._evaluate(r.eval.num_problems))
        if used >= next_eval or used >= budget:
            curve.append((used, t._evaluate(r.eval.num_problems), drawn))
            next_eval += budget / evals
    t.main_logger.close()
    row = _row(spec, curve, t.step, last)
    row["gen_tokens_per_step"] = tokens / max(t.step, 1)
    row["prompts_skipped"] = last.get("selective/total_prompts_skipped")
    row["stopped_share"] = sum(stopped) / len(stopped) if stopped else None
    row["auc_per_step"] = auc or None
    if at_prompts is not None:
        row["prompts_at_grpo_prompts"] = at_prompts[0]
        row["accuracy_at_grpo_prompts"] = at_prompts[1]["eval/accuracy"]
    return row


def run_control(recipe, warm: Path, spec: dict, budget: float, clock_name: str, out: Path) -> dict:
    import copy

    import torch

    from ..trainer import Trainer
    from ..trainer.sft import sft_warmup

    r = replace_recipe(recipe, seed=spec["seed"], out_dir=str(out / "runs" / run_id(spec)), init_checkpoint=str(warm),
                  **{"warmup.enabled": False, "log.progress": False, "log.tensorboard": False})
    t = Trainer(r)
    t.model.load_state_dict(torch.load(warm, map_location="cpu"))
    before = t._evaluate(r.eval.num_problems)
    wcfg = copy.deepcopy(r.warmup)
    wcfg.target_accuracy, wcfg.max_steps, wcfg.eval_every = 2.0, 10**9, 10**9
    info = sft_warmup(t.model, t.tok, t.task, wcfg, device=t.device, seed=spec["seed"],
                      prompt_template=r.task.prompt_template, evaluate_fn=lambda n: {"eval/accuracy": 0.0},
                      log_fn=lambda rec: None, progress=False, max_time_s=budget, clock=_clock(clock_name))
    after = t._evaluate(r.eval.num_problems)
    t.main_logger.close()
    return _row(spec, [(0.0, before, None), (budget, after, None)], int(info.get("warmup/steps", 0)), {})


def _row(spec: dict, curve: list, steps: int, last: dict) -> dict:
    final = curve[-1][1]
    return {
        "run": run_id(spec),
        **spec,
        "steps": steps,
        "accuracy_start": curve[0][1]["eval/accuracy"],
        "accuracy_final": final["eval/accuracy"],
        "eval_stderr": final["eval/stderr"],
        "prompts_drawn": last.get("alloc/total_prompts_drawn"),
        "completions_generated": last.get("alloc/total_completions_generated"),
        "completions_trained": last.get("alloc/total_completions_kept"),
        "accuracy_at_grpo_prompts": None,
        "prompts_at_grpo_prompts": None,
        "gen_tokens_per_step": None,
        "prompts_skipped": None,
        "stopped_share": None,
        "auc_per_step": None,
        # [time, accuracy, prompts drawn] per evaluation
        "curve": [[round(tm, 3), ev["eval/accuracy"], pr] for tm, ev, pr in curve],
    }


def run(args: argparse.Namespace) -> int:
    from ..trainer.config import load_recipe
    from .verl_study import is_verl_recipe

    if is_verl_recipe(args.recipe):  # the same study inside veRL (bench/verl_study.py)
        from .verl_study import run as run_verl

        return run_verl(args)
    if args.seeds < 1 or args.budget <= 0 or args.evals < 1:
        raise ValueError(f"--seeds, --budget, --evals must be positive, got {args.seeds}, {args.budget}, {args.evals}")
    recipe = load_recipe(args.recipe, args.overrides)
    runs = grid(args)  # before the warm-up: a bad --generation or --exclude costs nothing
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    warm = warm_start(recipe, out, args.warmup_checkpoint)
    print(f"study: {len(runs)} runs x {args.budget:g} s ({args.clock} clock) from {warm}")
    rows = []
    csv_path = out / "study.csv"
    t0 = time.perf_counter()
    grpo_prompts: dict[int, float] = {}  # seed -> prompts drawn by that seed's GRPO run
    for i, spec in enumerate(runs):
        if spec["kind"] == "control":
            row = run_control(recipe, warm, spec, args.budget, args.clock, out)
        else:
            row = run_rl(recipe, warm, spec, args.budget, args.clock, args.evals, out,
                         eval_at_prompts=grpo_prompts.get(spec["seed"]) if spec["P"] != 0 else None)
            if spec["P"] == 0 and row["prompts_drawn"]:
                grpo_prompts[spec["seed"]] = float(row["prompts_drawn"])
        rows.append(row)
        write_csv(csv_path, rows)
        print(f"[{i + 1}/{len(runs)}] {row['run']}: accuracy {row['accuracy_start']:.3f} -> "
              f"{row['accuracy_final']:.3f} "
              f"({row['steps']} steps, {time.perf_counter() - t0:.0f} s elapsed)", flush=True)
    table, findings = summarize(rows)
    rl = [r for r in rows if r["kind"] == "rl"]
    target = None
    if rl:  # the start is the shared warm-up checkpoint: every run's first evaluation
        start = statistics.mean(r["accuracy_start"] for r in rl)
        target = args.target if args.target is not None else default_target(
            start, [t for t in table if t["kind"] == "rl"])
        add_time_to_target(table, rows, target)
        findings.append(f"time to {target:.2f} held-out accuracy ({args.clock} seconds, seeds that reached it): "
                        + ", ".join(f"{t['config']} {t['time to target (s)']:.1f} s ({t['reached']})"
                                    if t["time to target (s)"] is not None else f"{t['config']} not reached"
                                    for t in table if t["kind"] == "rl"))
    report = Report(
        name="study",
        title=f"study on {Path(args.recipe).name}: {args.budget:g} s ({args.clock}) per run, {args.seeds} seed(s)",
        params={**{k: v for k, v in vars(args).items() if k != "func"}, "target": target},
        columns=["config", "seeds", "final acc (mean)", "seed spread (sd)", "eval stderr", "acc @ GRPO's prompts",
                 "time to target (s)", "reached", "steps", "prompts", "trained", "gen tokens/step"],
        rows=table,
        notes=findings + [f"total study time {time.perf_counter() - t0:.0f} s"],
        extras={"runs": rows},
        plot=lambda fig: _plot(fig, rows, table),
    )
    publish(report, out, plot=not args.no_plot)
    print(f"per-run rows: {csv_path}")
    return 0


def _plot(fig, rows: list[dict], table: list[dict]) -> None:
    aucs = [r for r in rows if r.get("auc_per_step")]
    cols = 3 if aucs else 2
    plot_curves(fig.add_subplot(1, cols, 1), rows)
    if aucs:
        plot_auc(fig.add_subplot(1, cols, 3), aucs)
    ax2 = fig.add_subplot(1, cols, 2)
    modes = list(GENERATION)
    series = sorted({(t["metric"], t["generation"]) for t in table if t["P"] is not None and t["metric"] != "grpo"},
                    key=lambda x: (x[0], modes.index(x[1])))
    for metric, gen in series:  # one line per metric and generation mode, each from its own GRPO point
        pts = sorted((t["P"], t["final acc (mean)"], sd_or_zero(t["seed spread (sd)"])) for t in table
                     if t["metric"] in (metric, "grpo") and t["generation"] == gen and t["allocation"] in (True, None))
        ax2.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts], fmt="o-", capsize=3,
                     label=metric + GENERATION[gen][1])
    ctrl = [t for t in table if t["metric"] == "sft"]
    if ctrl:
        ax2.axhline(ctrl[0]["final acc (mean)"], color="k", ls="--", label="SFT control")
    ax2.set(xlabel="pruning rate P", ylabel="final accuracy", title="final accuracy vs P (allocation on)")
    ax2.legend(fontsize=7)

