"""bench speedup: GRPO (P = 0) and CPPO at several pruning rates, side by side in one run.

All runs start from the same warm-started weights with the same seed. Their steps are
interleaved (A B C ... then C B A ..., for --repeats rounds) so drift of a shared machine
hits every run alike; per-step figures are medians. Per rate and allocation setting:

- seconds per prompt processed (the paper's epoch time, normalised by prompts), and the
  speedup against P = 0;
- per-phase seconds per prompt;
- the bound S_max(P) = (T_gen + T_rest) / (T_gen + (1 - P) T_rest), with T_gen (rollout +
  reward) and T_rest (old-policy + reference + update) per prompt from this run's GRPO
  steps, and the fraction of the bound achieved.

GRPO at the same generation batch: with allocation CPPO draws B / (1 - P) prompts a step, so
it generates 1/(1 - P) times GRPO's batch; a GRPO run with that many prompts (training all of
their completions) gets whatever a larger rollout batch saves too. Each allocation rate adds
that run (``p0_batch_of_pP``; ``--no-same-batch`` leaves them out), and the allocation rows
report their speedup against it with its own bound (S_max from that run's phase split): the
gain of pruning alone. The same-batch GRPO row's own speedup against GRPO is the batching gain.

With ``--selective`` each rate also runs with selective rollout (``cppo.selective.enabled``:
prompts whose recent groups all had equal rewards are skipped before generation and
replaced). Its time per prompt counts every prompt the run consumed from the data set,
skipped ones included: S_max assumes each prompt consumed is generated, so a skipped
prompt is where such a run can go beyond the bound. The history needs repeats: give a
small ``task.train_size`` and ``--warmup-steps`` (unrecorded steps that build it).

With ``--early-stop`` each rate also runs with early stopping inside the engine
(``cppo.early_stop``: completions the predictor expects in their group's majority are stopped
at a segment boundary, docs/early_stopping.md): generation itself shrinks, which S_max(P) does
not model, so this is where a run can go beyond the bound. The predictor learns from earlier
steps: give ``--warmup-steps`` so it is fitted before the measured steps (it stops nothing
until it has seen ``cppo.early_stop.min_examples`` completions of each outcome).

  cppo-megatron bench speedup recipes/tiny_cpu.yaml --rates 0,0.5,0.75,0.875,0.9375
  cppo-megatron bench speedup recipes/tiny_cpu.yaml task.train_size=256 --rates 0.875 --allocation on \
      --selective --warmup-steps 8
  cppo-megatron bench speedup recipes/worked_cpu.yaml --rates 0.875 --allocation on --early-stop --warmup-steps 4
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from ..recipes import arg_type as recipe_arg
from ..trainer.config import replace_recipe
from ..trainer.metrics import GEN_PHASES, PASS_PHASES, PHASES
from .bound import fraction_of_bound, speedup, speedup_bound
from .report import Report, median

# the trainer's one phase list (cppo_megatron/trainer/metrics.py), for both backends
REST_PHASES = PASS_PHASES
ALL_PHASES = PHASES


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", type=recipe_arg("train"), help="recipe YAML (e.g. recipes/tiny_cpu.yaml)")
    parser.add_argument("overrides", nargs="*", help="recipe overrides key=value (applied to every run)")
    parser.add_argument("--rates", default="0,0.5,0.75,0.875,0.9375", help="comma-separated P values (0 is added)")
    parser.add_argument("--allocation", choices=["on", "off", "both"], default="both")
    parser.add_argument("--steps", type=int, default=4, help="steps per run per round (default 4)")
    parser.add_argument("--repeats", type=int, default=2, help="interleaved rounds (default 2)")
    parser.add_argument("--selective", action="store_true",
                        help="also run each rate with selective rollout (cppo.selective.enabled); its time per prompt "
                             "counts skipped prompts as consumed (see --warmup-steps)")
    parser.add_argument("--early-stop", action="store_true",
                        help="also run each rate with early stopping inside the engine (cppo.early_stop); give "
                             "--warmup-steps so its predictor is fitted before the measured steps")
    parser.add_argument("--warmup-steps", type=int, default=0,
                        help="unrecorded steps per run before the measured ones (default 0); with --selective they "
                             "build the per-prompt history (use a small task.train_size so prompts repeat)")
    parser.add_argument("--warmup-checkpoint", default=None,
                        help="start weights; default: the recipe's init_checkpoint, else run its warm-up once")
    parser.add_argument("--no-same-batch", action="store_true",
                        help="leave out GRPO at each allocation rate's prompts per step (the equal-batch baseline)")


def _rates(text: str) -> list[float]:
    try:
        rates = sorted({0.0, *(float(x) for x in text.split(",") if x.strip())})
    except ValueError as exc:
        raise ValueError(f"--rates must be comma-separated numbers, got {text!r}") from exc
    bad = [p for p in rates if not 0.0 <= p < 1.0]
    if bad:
        raise ValueError(f"--rates must be in [0, 1), got {bad}")
    return rates


def warm_start(recipe, out: Path, explicit: str | None) -> Path:
    """The weights every run starts from: given, the recipe's, or one warm-up run now."""
    from ..trainer import Trainer

    if explicit:
        return Path(explicit)
    if recipe.init_checkpoint:
        return Path(recipe.init_checkpoint)
    path = out / "warmup" / "warmup.pt"
    if path.exists():
        return path
    if not recipe.warmup.enabled:
        raise ValueError("the recipe has no init_checkpoint and no warm-up: pass --warmup-checkpoint")
    print(f"bench: warm-up once, shared by every run -> {path}")
    warm = replace_recipe(recipe, out_dir=str(path.parent), **{"train.steps": 0})
    t = Trainer(warm)
    t.prepare(initial_eval=False)
    t.main_logger.close()
    return path


def same_batch_capacity(recipe, rate: float) -> int:
    """Completions per step of GRPO at the prompts CPPO with allocation draws at ``rate``: the
    recipe's capacity / (survivors per prompt) prompts, G completions each, all trained."""
    from ..core.allocation import AllocationPlanner

    c = recipe.cppo
    planner = AllocationPlanner(recipe.train.capacity, recipe.rollout.group_size, pruning_rate=rate,
                                scope=c.scope, allocation=True)
    prompts = planner.prompts_per_step
    if prompts.denominator != 1:
        raise ValueError(f"at P={rate:g} allocation draws {float(prompts):g} prompts per step, not a whole number: "
                         "pass --no-same-batch, or a rate with G (1 - P) dividing train.capacity")
    return int(prompts) * recipe.rollout.group_size


def _run_name(key: tuple) -> str:
    if len(key) == 4:  # GRPO at the prompts of allocation at rate key[3]
        return f"p0_batch_of_p{key[3]:g}"
    return f"p{key[0]:g}_{'alloc' if key[1] else 'noalloc'}{'_' + key[2] if len(key) == 3 else ''}"


def _bench_recipe(recipe, out: Path, warm: Path, key: tuple):
    """The recipe of one run: key (P, allocation), (P, allocation, "selective" | "early_stop") or
    (0.0, True, "batch", P) for GRPO at the batch of allocation at P."""
    rate, allocation, variant = key[0], key[1], key[2] if len(key) == 3 else ""
    extra = {"train.capacity": same_batch_capacity(recipe, key[3])} if len(key) == 4 else {}
    return replace_recipe(
        recipe,
        out_dir=str(out / "runs" / _run_name(key)),
        init_checkpoint=str(warm),
        **{
            "cppo.pruning_rate": rate, "cppo.keep_per_group": None, "cppo.allocation": allocation,
            "cppo.selective.enabled": variant == "selective", "cppo.early_stop.enabled": variant == "early_stop",
            **extra,
            "warmup.enabled": False, "eval.every": 0, "log.progress": False, "log.tensorboard": False,
            "log.plots": False, "log.checkpoint_every": 0, "train.steps": 10**9, "train.max_time_s": 0.0,
        },
    )


def measure(recipe, rates: list[float], allocations: list[bool], steps: int, repeats: int, warm: Path,
            out: Path, progress: bool = True, warmup_steps: int = 0,
            selective: bool = False, same_batch: bool = False, early_stop: bool = False) -> dict[tuple, list[dict]]:
    """Interleave the runs' steps; return every step record per (rate, allocation), per
    (rate, allocation, "selective") / (rate, allocation, "early_stop") for the runs ``selective``
    and ``early_stop`` add (early stopping: rates > 0 only), and per
    (0.0, True, "batch", rate) for GRPO at the prompts of allocation at each rate > 0 that
    ``same_batch`` adds.

    ``warmup_steps`` unrecorded steps per run come first (on a GPU the first steps pay for
    kernel selection and allocator growth at each run's batch shape; with selective rollout
    they build the history)."""
    from ..trainer import Trainer

    plain = [(p, a) for a in allocations for p in rates if not (p == 0.0 and a != allocations[0])]
    keys: list[tuple] = plain + ([(p, a, "selective") for p, a in plain] if selective else []) + (
        [(p, a, "early_stop") for p, a in plain if p > 0] if early_stop else [])
    if same_batch and True in allocations:
        keys += [(0.0, True, "batch", p) for p in rates if p > 0]
    trainers = {}
    for key in keys:
        t = Trainer(_bench_recipe(recipe, out, warm, key))
        t.prepare(initial_eval=False)
        trainers[key] = t
    for k in keys:
        for _ in range(warmup_steps):
            trainers[k].step_once()
    records: dict = {k: [] for k in keys}
    total = len(keys) * steps * repeats
    bar = None
    if progress:
        from ..progress import progress as progress_bar

        bar = progress_bar(total, "bench speedup")
    for rep in range(repeats):
        order = keys if rep % 2 == 0 else keys[::-1]  # A B C, C B A: linear drift cancels
        for k in order:
            for _ in range(steps):
                records[k].append(trainers[k].step_once())
                if bar is not None:
                    bar.update(1)
    if bar is not None:
        bar.close()
    for t in trainers.values():
        t.main_logger.close()
    return records


def per_prompt(recs: list[dict], key: str) -> float:
    """Median over steps of ``key`` per prompt consumed from the data set: every prompt drawn,
    including those selective rollout skipped (``selective/prompts_drawn``)."""
    return median(r[key] / r.get("selective/prompts_drawn", r["alloc/prompts_drawn"]) for r in recs)


def phase_split(recs: list[dict]) -> dict:
    """A GRPO run's split per prompt: T_gen (rollout + reward), T_rest (the passes), the step."""
    return {"t_gen_per_prompt_s": sum(per_prompt(recs, f"time/{ph}") for ph in GEN_PHASES),
            "t_rest_per_prompt_s": sum(per_prompt(recs, f"time/{ph}") for ph in REST_PHASES),
            "t_step_per_prompt_s": per_prompt(recs, "time/step")}


def _row(recs: list[dict], p: float, allocation: bool, variant: str, base: dict, name: str) -> dict:
    t = per_prompt(recs, "time/step")
    s = speedup(base["t_step_per_prompt_s"], t)
    bound = speedup_bound(p, base["t_gen_per_prompt_s"], base["t_rest_per_prompt_s"])
    row = {
        "run": name, "P": p, "allocation": allocation, "selective": variant == "selective",
        "early_stop": variant == "early_stop",
        "prompts/step": median(r.get("selective/prompts_drawn", r["alloc/prompts_drawn"]) for r in recs),
        "generated/step": median(r["alloc/prompts_drawn"] for r in recs),
        "trained/step": median(r["cppo/num_kept"] for r in recs),
        "ms/prompt": 1e3 * t, "speedup": s, "bound": bound, "of bound": fraction_of_bound(s, bound),
        "speedup same batch": None, "bound same batch": None, "of bound same batch": None,
    }
    for ph in ALL_PHASES:
        row[f"ms/prompt {ph}"] = 1e3 * per_prompt(recs, f"time/{ph}")
    drawn = [r.get("selective/prompts_drawn", r["alloc/prompts_drawn"]) for r in recs]
    row["tokens/prompt"] = median(r.get("rollout/tokens", 0.0) / d for r, d in zip(recs, drawn, strict=True))
    row["stopped share"] = median(r.get("early_stop/stopped_share", 0.0) for r in recs)
    row["steps measured"] = len(recs)
    return row


def same_batch_splits(records: dict) -> dict[float, dict]:
    """P -> the phase split of GRPO at allocation's batch at P (the runs ``same_batch`` adds)."""
    return {k[3]: phase_split(v) for k, v in records.items() if len(k) == 4}


def _against_same_batch(row: dict, split: dict) -> None:
    """Fill the row's speedup against GRPO at its generation batch, with that run's own bound."""
    s = speedup(split["t_step_per_prompt_s"], row["ms/prompt"] / 1e3)
    bound = speedup_bound(row["P"], split["t_gen_per_prompt_s"], split["t_rest_per_prompt_s"])
    row.update({"speedup same batch": s, "bound same batch": bound, "of bound same batch": fraction_of_bound(s, bound)})


def analyse(records: dict, rates: list[float], allocations: list[bool]) -> tuple[list[dict], dict]:
    """The table's rows and GRPO's phase split; rows of allocation at a rate whose same-batch GRPO
    ran (key ``(0.0, True, "batch", P)``) also hold the speedup against it and its bound, and that
    GRPO run gets a row of its own (its speedup against GRPO is the batching gain; no bound). GRPO
    has one row, whatever the allocations."""
    split = phase_split(records[(0.0, allocations[0])])
    same = same_batch_splits(records)
    rows = []
    for variant in ("", "selective", "early_stop"):
        for a in allocations:
            for p in rates:
                if p == 0.0 and a != allocations[0]:
                    continue  # GRPO once: allocation is moot at P = 0
                key: tuple = (p, a, variant) if variant else (p, a)
                if key not in records:
                    continue
                name = "GRPO" if p == 0.0 else f"CPPO P={p:g} {'alloc' if a else 'no-alloc'}"
                suffix = {"selective": " + selective", "early_stop": " + early stop"}.get(variant, "")
                row = _row(records[key], p, a, variant, split, name + suffix)
                if a and p in same:
                    _against_same_batch(row, same[p])
                rows.append(row)
    for p in same:
        recs = records[(0.0, True, "batch", p)]
        row = _row(recs, 0.0, True, "", split, f"GRPO at P={p:g}'s batch")
        row["bound"] = row["of bound"] = None  # a baseline: its speedup is the batching gain, no pruning bound
        rows.append(row)
    return rows, split


def run(args: argparse.Namespace) -> Report:
    """Measure; return the report (``cppo-megatron bench`` writes it into --out)."""
    from ..trainer.config import load_recipe

    rates = _rates(args.rates)
    if args.steps < 1 or args.repeats < 1 or args.warmup_steps < 0:
        raise ValueError(f"--steps and --repeats must be >= 1 and --warmup-steps >= 0, got {args.steps}, "
                         f"{args.repeats}, {args.warmup_steps}")
    allocations = {"on": [True], "off": [False], "both": [True, False]}[args.allocation]
    recipe = load_recipe(args.recipe, args.overrides)
    out = Path(args.out)
    t0 = time.perf_counter()
    warm = warm_start(recipe, out, args.warmup_checkpoint)
    records = measure(recipe, rates, allocations, args.steps, args.repeats, warm, out, recipe.log.progress,
                      warmup_steps=args.warmup_steps, selective=args.selective, same_batch=not args.no_same_batch,
                      early_stop=args.early_stop)
    rows, split = analyse(records, rates, allocations)
    report = Report(
        name="speedup",
        title=f"CPPO speedup vs GRPO, {Path(args.recipe).name} "
              f"({args.steps} steps x {args.repeats} interleaved rounds)",
        params={"recipe": args.recipe, "overrides": args.overrides, "rates": rates, "allocation": args.allocation,
                "steps": args.steps, "repeats": args.repeats, "warm_start": str(warm),
                "selective": args.selective, "early_stop": args.early_stop, "warmup_steps": args.warmup_steps,
                "same_batch": not args.no_same_batch},
        columns=["run", "prompts/step", "generated/step", "trained/step", "tokens/prompt", "stopped share",
                 "ms/prompt", "speedup", "bound",
                 "of bound", "speedup same batch", "bound same batch", "of bound same batch", "ms/prompt rollout",
                 "ms/prompt update"],
        rows=rows,
        notes=[
            f"GRPO phase split per prompt: T_gen (rollout + reward) {1e3 * split['t_gen_per_prompt_s']:.2f} ms, "
            f"T_rest (old + ref + update) {1e3 * split['t_rest_per_prompt_s']:.2f} ms",
            "bound S_max(P) = (T_gen + T_rest) / (T_gen + (1-P) T_rest); 'of bound' = speedup / S_max",
            "same batch: against GRPO drawing the prompts allocation draws at that P (the same generation batch), "
            "with S_max from that run's own phase split: the gain of pruning alone; that GRPO run's own 'speedup' "
            "against GRPO is the batching gain",
            *same_batch_notes(rows),
            *_selective_notes(rows),
            *_early_stop_notes(rows),
            f"total bench time {time.perf_counter() - t0:.0f} s",
        ],
        extras={"phase_split": split,
                "phase_split_same_batch": {f"{p:g}": v for p, v in same_batch_splits(records).items()}},
        plot=lambda fig: _plot(fig, rows, allocations),
    )
    return report


def same_batch_notes(rows: list[dict]) -> list[str]:
    """Per allocation rate with its same-batch GRPO: the batching gain, and pruning's gain over it."""
    base = {r["run"].split("=", 1)[1].split("'", 1)[0]: r for r in rows if r["run"].startswith("GRPO at P=")}
    out = []
    for r in rows:
        same = base.get(f"{r['P']:g}")
        if same is None or r["selective"] or r["early_stop"] or not r["allocation"] or r["speedup same batch"] is None:
            continue
        out.append(f"P={r['P']:g} with allocation: GRPO at its {same['prompts/step']:g} prompts a step runs "
                   f"{same['speedup']:.2f}x GRPO's per prompt (the batching gain); CPPO against that GRPO "
                   f"{r['speedup same batch']:.2f}x, bound {r['bound same batch']:.2f}x "
                   f"({r['of bound same batch']:.0%} of it: pruning alone)")
    return out


def _selective_notes(rows: list[dict]) -> list[str]:
    """Per selective-rollout row: prompts skipped per step, and whether it went beyond S_max."""
    out = []
    for r in rows:
        if r["selective"]:
            skipped = r["prompts/step"] - r["generated/step"]
            beyond = "beyond" if r["speedup"] > r["bound"] else "within"
            out.append(f"P={r['P']:g} {'with' if r['allocation'] else 'without'} allocation + selective rollout: "
                       f"{skipped:g} of {r['prompts/step']:g} prompts per step skipped (median), speedup "
                       f"{r['speedup']:.2f}x vs S_max {r['bound']:.2f}x: {beyond} the bound")
    return out


def _early_stop_notes(rows: list[dict]) -> list[str]:
    """Per early-stopping row: tokens per prompt against CPPO's at the same rate, and the bounds."""
    out = []
    plain = {(r["P"], r["allocation"]): r for r in rows
             if not r["selective"] and not r["early_stop"] and not r["run"].startswith("GRPO at")}
    for r in rows:
        if r["early_stop"]:
            base = plain.get((r["P"], r["allocation"]))
            tokens = f"{r['tokens/prompt']:.1f} tokens per prompt" + (
                f" (CPPO alone {base['tokens/prompt']:.1f}, speedup {base['speedup']:.2f}x)" if base else "")
            beyond = "beyond" if r["speedup"] > r["bound"] else "within"
            same = "" if r["speedup same batch"] is None else (
                f"; vs GRPO at the same batch {r['speedup same batch']:.2f}x, bound {r['bound same batch']:.2f}x")
            out.append(f"P={r['P']:g} {'with' if r['allocation'] else 'without'} allocation + early stopping: "
                       f"{r['stopped share']:.0%} of completions stopped (median), {tokens}; speedup "
                       f"{r['speedup']:.2f}x vs S_max {r['bound']:.2f}x: {beyond} the bound{same}")
    return out


def _plot(fig, rows: list[dict], allocations: list[bool]) -> None:
    ax = fig.add_subplot(1, 1, 1)
    mine = [r for r in rows if not r["run"].startswith("GRPO at")]  # the same-batch GRPO runs are baselines
    for variant, style in (("", "o-"), ("selective", "s--"), ("early_stop", "v-.")):
        for a in allocations:
            sel = [r for r in mine if (r["allocation"] == a or r["P"] == 0.0)
                   and r["selective"] == (variant == "selective") and r["early_stop"] == (variant == "early_stop")]
            if sel:
                ax.plot([r["P"] for r in sel], [r["speedup"] for r in sel], style,
                        label=f"measured, allocation {'on' if a else 'off'}{' + ' + variant if variant else ''}")
    same = [r for r in mine if r["speedup same batch"] is not None and not r["selective"] and not r["early_stop"]
            and r["P"] > 0]
    if same:
        ax.plot([r["P"] for r in same], [r["speedup same batch"] for r in same], "^-",
                label="allocation vs GRPO at the same batch")
        ax.plot([r["P"] for r in same], [r["bound same batch"] for r in same], "k:", label="its bound")
    sel = [r for r in mine if r["allocation"] == allocations[0] and not r["selective"] and not r["early_stop"]]
    ax.plot([r["P"] for r in sel], [r["bound"] for r in sel], "k--", label="bound S_max(P)")
    ax.set(xlabel="pruning rate P", ylabel="speedup vs GRPO (time per prompt)", title="CPPO speedup and its bound")
    ax.grid(alpha=0.3)
    ax.legend()
