"""bench verl: veRL GRPO and veRL + CPPO side by side, from veRL's own step timings.

Each variant is one real ``cppo-megatron verl RECIPE`` run (its own Ray session) from the
same start model, data and seed, one after the other in this command:

- ``grpo``: P = 0 through the same ``cppo`` estimator and hook (every completion kept; the
  advantages equal veRL's ``grpo`` estimator's, tests/integrations/verl/test_cpu_e2e.py), so
  the three runs differ only in P and allocation, and each logs its prompt count;
- ``cppo P alloc``: the ``cppo`` estimator at P with allocation (prompts per step x 1/(1-P));
- ``cppo P no-alloc``: the same P with the GRPO prompt count (mini-batches shrink by k/G);
- ``grpo same batch``: GRPO at the prompts allocation draws (``data.train_batch_size`` x G/k,
  one optimizer step over all of their completions, as the recipe's GRPO takes one over its
  batch): the same generation batch as ``cppo P alloc``, so that row also reports its speedup
  against this run with S_max from this run's split (``bench/samebatch.py``).

From each run's ``metrics.jsonl`` (veRL's ``timing_s/*``; the first ``--skip`` steps are
dropped, then medians): seconds per prompt of a whole step and per phase. With the GRPO
run's phase split, T_gen = ``timing_s/gen`` (rollout; rewards are computed inside veRL's
agent loop, so they are part of it) and T_rest = old-policy + reference + update
(``timing_s/old_log_prob``, ``ref``, ``update_actor``), the bound is
S_max(P) = (T_gen + T_rest) / (T_gen + (1 - P) T_rest) (``bench/bound.py``).

The loop defaults to the legacy ``RayPPOTrainer`` (``trainer.use_v1=false``): V1's
``timing_s/gen`` carries a ~2 s floor from its replay buffer's poll interval, which on a tiny
model would be most of the measured generation time.

With ``--early-stop`` (V1 only: ``--loop v1``) one more run: CPPO at P with allocation and early
stopping inside the rollout (``cppo.early_stop``, docs/early_stopping.md), which shrinks
generation itself, the phase S_max(P) leaves alone. Tokens per prompt come from the rows
(``early_stop/tokens_generated``, else ``signal/generated_tokens``).

  cppo-megatron bench verl recipes/verl/tiny_cpu_grpo.yaml --rate 0.875 --steps 6
  cppo-megatron bench verl recipes/verl/worked_cpu_grpo.yaml --rate 0.875 --steps 8 --loop v1 --early-stop
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from ..recipes import arg_type as recipe_arg
from .hostbench import check_args, compare, extras, notes, run_variants
from .report import Report, plot_step_split, seconds_per_prompt
from .samebatch import GRPO, SAME_BATCH, same_batch_prompts

GEN_KEYS = ("timing_s/gen",)
REST_KEYS = ("timing_s/old_log_prob", "timing_s/ref", "timing_s/update_actor")
PHASES = ("gen", "old_log_prob", "ref", "adv", "update_actor", "update_weights")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", type=recipe_arg("verl"),
                        help="a veRL CPU recipe (e.g. recipes/verl/tiny_cpu_grpo.yaml)")
    parser.add_argument("overrides", nargs="*", help="veRL/hydra overrides applied to every run")
    parser.add_argument("--rate", type=float, default=0.875, help="pruning rate P of the CPPO runs (default 0.875)")
    parser.add_argument("--allocation", choices=["on", "off", "both"], default="both")
    parser.add_argument("--steps", type=int, default=6, help="training steps per run (default 6)")
    parser.add_argument("--skip", type=int, default=1, help="first steps left out of the medians (default 1)")
    parser.add_argument("--loop", choices=["legacy", "v1"], default="legacy",
                        help="veRL loop (default legacy: no replay-buffer poll floor in timing_s/gen)")
    parser.add_argument("--early-stop", action="store_true",
                        help="also CPPO at --rate with allocation and early stopping inside the rollout "
                             "(cppo.early_stop; needs --loop v1)")
    parser.add_argument("--reuse", action="store_true",
                        help="reuse a variant whose run in --out already logged --steps steps (rerun only the others)")
    parser.add_argument("--no-same-batch", action="store_true",
                        help="leave out GRPO at allocation's prompts per step (the equal-batch baseline)")


def _variants(rate: float, allocation: str, same_batch: list[str] | None = None,
              early_stop: bool = False) -> list[tuple[str, list[str]]]:
    """(name, overrides) per run, in running order; ``same_batch``: the overrides of GRPO at
    allocation's batch (run right after CPPO with allocation), None to leave it out;
    ``early_stop``: CPPO with allocation and early stopping last."""
    grpo = ["algorithm.adv_estimator=cppo", "cppo.pruning_rate=0.0"]
    out = [(GRPO, grpo)]
    for alloc in ([True, False] if allocation == "both" else [allocation == "on"]):
        out.append((f"cppo P={rate:g} {'alloc' if alloc else 'no-alloc'}",
                    ["algorithm.adv_estimator=cppo", f"cppo.pruning_rate={rate}", f"cppo.allocation={alloc}"]))
        if alloc and same_batch is not None:
            out.append((SAME_BATCH, grpo + same_batch))
    if early_stop:
        out.append((f"cppo P={rate:g} alloc + early stop",
                    ["algorithm.adv_estimator=cppo", f"cppo.pruning_rate={rate}", "cppo.allocation=True",
                     "cppo.early_stop.enabled=true"]))
    return out


def same_batch_overrides(recipe: str, overrides: list[str], rate: float) -> list[str]:
    """The overrides of GRPO at the prompts allocation draws at ``rate``: train batch and the actor's
    mini-batch (one optimizer step per step, as the recipe's GRPO) grown by G/k."""
    from ..core.settings import keep_count
    from .verl_study import compose

    cfg = compose(recipe, overrides)
    b, g = int(cfg.data.train_batch_size), int(cfg.actor_rollout_ref.rollout.n)
    mini = int(cfg.actor_rollout_ref.actor.ppo_mini_batch_size)
    keep = keep_count(g, rate, None)
    big = same_batch_prompts(b, g, keep, "data.train_batch_size")
    return [f"data.train_batch_size={big}", f"actor_rollout_ref.actor.ppo_mini_batch_size={mini * big // b}"]


def read_metrics(path: Path) -> list[dict]:
    """veRL's file-logger lines -> [{step, **metrics}] in step order."""
    rows = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            rows.append({"step": rec["step"], **rec["data"]})
    return sorted(rows, key=lambda r: r["step"])


def summarize(rows: list[dict], skip: int) -> dict:
    """Median seconds per prompt (whole step and per phase) over the steps after ``skip``."""
    return seconds_per_prompt(rows, skip, step_key="timing_s/step", phase_prefix="timing_s/", phases=PHASES,
                              hint="was the run made with adv_estimator=cppo?")


def _run_one(recipe: str, overrides: list[str], run_dir: Path, steps: int, loop: str, log_path: Path) -> list[dict]:
    print(f"bench verl: running {' '.join(overrides)} ({steps} steps, {loop} loop; log {log_path})", flush=True)
    args = [sys.executable, "-m", "cppo_megatron.integrations.verl.main", recipe, *overrides,
            f"cppo_cpu.run_dir={run_dir}", f"trainer.total_training_steps={steps}",
            "trainer.val_before_train=false", "trainer.test_freq=-1", f"trainer.use_v1={loop == 'v1'}"]
    with open(log_path, "w") as log:
        proc = subprocess.run(args, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    if proc.returncode != 0:
        raise RuntimeError(f"bench verl: the run {' '.join(overrides)} failed (exit {proc.returncode}); "
                           f"log: {log_path}")
    return read_metrics(run_dir / "metrics.jsonl")


def run(args: argparse.Namespace) -> Report:
    check_args(args)
    if args.early_stop and args.loop != "v1":
        raise ValueError("--early-stop runs on veRL's V1 loop (the predictor rides in its checkpoints): pass --loop v1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    same = None if args.no_same_batch or args.allocation == "off" else same_batch_overrides(
        args.recipe, args.overrides, args.rate)

    def launch(slug: str, run_dir: Path, extra: list[str]) -> list[dict]:
        return _run_one(args.recipe, [*args.overrides, *extra], run_dir, args.steps, args.loop,
                        out / f"verl_{slug}.log")

    results = run_variants(_variants(args.rate, args.allocation, same, args.early_stop), host="verl",
                           runs_dir=out / "verl_runs", step_key="timing_s/step", steps=args.steps, skip=args.skip,
                           reuse=args.reuse, read=read_metrics, launch=launch, summarize=summarize)
    table, split = compare(results, args.rate, GEN_KEYS, REST_KEYS)
    for row in table:
        s = results[row["run"]][1]
        row.update({"tokens/prompt": s["tokens_per_prompt"], "stopped share": s["stopped_share"],
                    "ms/prompt gen": 1e3 * s["gen_s_per_prompt"],
                    "ms/prompt update": 1e3 * s["update_actor_s_per_prompt"], **{f"raw_{k}": v for k, v in s.items()}})
    t_gen, t_rest = split["t_gen_per_prompt_s"], split["t_rest_per_prompt_s"]
    return Report(
        name="verl_speedup",
        title=f"veRL {args.loop} loop: GRPO vs CPPO P={args.rate:g}, {Path(args.recipe).name} "
              f"({args.steps} steps per run, first {args.skip} skipped)",
        params={"recipe": args.recipe, "overrides": args.overrides, "rate": args.rate, "allocation": args.allocation,
                "steps": args.steps, "skip": args.skip, "loop": args.loop, "same_batch": same,
                "early_stop": args.early_stop},
        columns=["run", "prompts/step", "trained/step", "tokens/prompt", "stopped share", "ms/prompt", "speedup",
                 "bound", "of bound", "speedup same batch", "bound same batch", "of bound same batch", "ms/prompt gen",
                 "ms/prompt update"],
        rows=table,
        notes=notes(f"GRPO phase split per prompt: T_gen (timing_s/gen) {1e3 * t_gen:.2f} ms, "
                    f"T_rest (old_log_prob + ref + update_actor) {1e3 * t_rest:.2f} ms", table, "veRL processes", t0),
        extras=extras(split, results),
        plot=lambda fig: plot_step_split(fig, table, gen_label="timing_s/gen", title="veRL step time per prompt"),
    )

