"""bench predictor: how well early stopping's predictor tells a prefix's outcome, per feature set.

The recipe's own training runs for ``--steps`` RL steps with early stopping recording but not
stopping (``cppo.early_stop`` with ``features=hidden``, every group explored): at every segment
boundary the engine hands out each completion's prefix, and the monitor keeps its features (the
sampled tokens' log-probs, their entropies, the decoder's last hidden state). Then, for each step
k >= 1, a predictor is fitted on the ``history_steps`` steps before k (as the trainer fits it) and
scored on step k's completions at every boundary, for each feature set:

- ``logprob``: the log-prob features (every engine, veRL included);
- ``entropy``: also the per-token entropies (the embedded HF engine);
- ``hidden``: also the policy's hidden state (the embedded HF engine);
- ``oracle feature (upper bound)``, task ``worked_arithmetic`` only: the log-prob features plus
  whether the prefix has already left the reference solution (the task's own intermediate check,
  ``tasks.worked.first_divergence``). A user's task has no such check: it bounds what a
  predictor could reach from the prefix, it is not a predictor early stopping may use.

Per feature set: AUC (mean and per step), Brier score and ECE on the held-out step, and AUC at
the first boundary alone.

  cppo-megatron bench predictor recipes/worked_cpu.yaml --steps 6 --warmup-checkpoint runs/worked_cpu/warmup.pt
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from ..recipes import arg_type as recipe_arg
from .report import Report

__all__ = ["FEATURE_SETS", "configure", "run"]

FEATURE_SETS = ("logprob", "entropy", "hidden", "oracle feature (upper bound)")
ORACLE = FEATURE_SETS[3]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", type=recipe_arg("train"), help="recipe YAML (e.g. recipes/worked_cpu.yaml)")
    parser.add_argument("overrides", nargs="*", help="recipe overrides key=value")
    parser.add_argument("--steps", type=int, default=6, help="RL steps recorded (default 6); steps 1.. are scored")
    parser.add_argument("--warmup-checkpoint", default=None,
                        help="start weights; default: the recipe's init_checkpoint, else run its warm-up once")


def _collect(trainer, batch, with_oracle: bool) -> dict:
    """The step's examples from its monitor: x [E, F], rows, boundary, first-boundary flag, labels, oracle."""
    (mon,) = trainer.early_stop.monitors
    es = trainer.r.cppo.early_stop
    y = (batch.rewards >= es.success_threshold).to(torch.float64)
    xs, ys, first, slipped = [], [], [], []
    for i, rec in enumerate(mon.records):
        rows = rec["rows"]
        xs.append(rec["x"])
        ys.append(y[rows])
        first.append(torch.full((rows.numel(),), i == 0))
        if with_oracle:
            slipped.append(torch.tensor([_slipped(trainer, batch, int(r), int(rec["boundary"])) for r in rows],
                                        dtype=torch.float64))
    return {"x": torch.cat(xs), "y": torch.cat(ys), "first": torch.cat(first),
            "slipped": torch.cat(slipped) if with_oracle else None, "r": batch.rewards.to(torch.float64)}


def _slipped(trainer, batch, row: int, boundary: int) -> float:
    from ..tasks.worked import first_divergence

    group = row // batch.group_size
    problem = trainer.task.train[int(batch.prompt_ids[group])]
    tokens = batch.completions[row][:boundary]
    return float(first_divergence(trainer.tok.decode(tokens), problem) is not None)


def _columns(name: str, x: torch.Tensor, slipped: torch.Tensor | None) -> torch.Tensor:
    from ..core.early_stop import ENTROPY_FEATURES, LOGPROB_FEATURES

    n_lp, n_ent = len(LOGPROB_FEATURES), len(LOGPROB_FEATURES) + len(ENTROPY_FEATURES)
    if name == "logprob":
        return x[:, :n_lp]
    if name == "entropy":
        return x[:, :n_ent]
    if name == "hidden":
        return x
    assert slipped is not None
    return torch.cat([x[:, :n_lp], slipped[:, None]], 1)


def _score(steps: list[dict], history: int, l2: float, with_oracle: bool) -> list[dict]:
    """Per held-out step k >= 1 and feature set: AUC, first-boundary AUC, Brier, ECE."""
    from ..core.early_stop import PrefixPredictor, calibration, roc_auc

    rows = []
    for k in range(1, len(steps)):
        train = steps[max(0, k - history):k]
        test = steps[k]
        for name in FEATURE_SETS if with_oracle else FEATURE_SETS[:3]:
            x = torch.cat([_columns(name, s["x"], s["slipped"]) for s in train])
            y = torch.cat([s["y"] for s in train])
            if y.numel() == 0 or y.min() == y.max():
                continue
            p = PrefixPredictor(l2).fit(x, y, torch.cat([torch.where(s["y"] > 0, 1.0, 0.0) for s in train]))
            q = p.predict(_columns(name, test["x"], test["slipped"]))
            brier, ece = calibration(q, test["y"])
            rows.append({"step": k, "features": name, "auc": roc_auc(q, test["y"]),
                         "auc_first": roc_auc(q[test["first"]], test["y"][test["first"]]), "brier": brier, "ece": ece,
                         "pairs": int(q.numel()), "success_share": float(test["y"].mean())})
    return rows


def run(args: argparse.Namespace) -> Report:
    from ..trainer import Trainer
    from ..trainer.config import load_recipe, replace_recipe
    from .speedup import warm_start

    if args.steps < 2:
        raise ValueError(f"--steps must be >= 2 (step 0 only trains the first predictor), got {args.steps}")
    recipe = load_recipe(args.recipe, args.overrides)
    if recipe.backend != "hf" or recipe.rollout.engine != "hf":
        raise ValueError("bench predictor reads the hidden state from the embedded HF engine: backend=hf, "
                         "rollout.engine=hf")
    out = Path(args.out)
    t0 = time.perf_counter()
    warm = warm_start(recipe, out, args.warmup_checkpoint)
    rate = recipe.cppo.pruning_rate if recipe.cppo.pruning_rate else 0.875
    r = replace_recipe(recipe, out_dir=str(out / "predictor_run"), init_checkpoint=str(warm), **{
        "warmup.enabled": False, "eval.every": 0, "log.progress": False, "log.tensorboard": False, "log.plots": False,
        "log.checkpoint_every": 0, "train.steps": 10**9, "train.max_time_s": 0.0, "cppo.pruning_rate": rate,
        "cppo.keep_per_group": None, "cppo.early_stop.enabled": True, "cppo.early_stop.features": "hidden",
        "cppo.early_stop.explore_share": 1.0, "cppo.early_stop.min_examples": 10**9})
    with_oracle = r.task.name == "worked_arithmetic"
    trainer = Trainer(r)
    trainer.prepare(initial_eval=False)
    steps = []
    es = trainer.early_stop
    assert es is not None  # the recipe above turns it on
    original, seen = es.end_step, {}

    def keep_batch(batch, kept):  # the step's batch: its completions' text, for the oracle feature
        seen["batch"] = batch
        return original(batch, kept)

    es.end_step = keep_batch  # type: ignore[method-assign]
    for _ in range(args.steps):
        trainer.step_once()
        steps.append(_collect(trainer, seen["batch"], with_oracle))
    trainer.main_logger.close()
    rows = _score(steps, r.cppo.early_stop.history_steps, r.cppo.early_stop.l2, with_oracle)
    if not rows:
        raise ValueError("every recorded step held one outcome only: warm the model up further")
    table = []
    for name in dict.fromkeys(row["features"] for row in rows):
        sel = [row for row in rows if row["features"] == name]
        table.append({"features": name, "steps scored": len(sel),
                      **{key: sum(row[key] for row in sel) / len(sel) for key in ("auc", "auc_first", "brier", "ece")},
                      "auc per step": [round(row["auc"], 3) for row in sel]})
    return Report(
        name="predictor",
        title=f"Early stopping's predictor by feature set, {Path(args.recipe).name} ({args.steps} steps)",
        params={"recipe": args.recipe, "overrides": args.overrides, "steps": args.steps, "warm_start": str(warm)},
        columns=["features", "steps scored", "auc", "auc_first", "brier", "ece", "auc per step"],
        rows=table,
        notes=[f"fitted on the previous {r.cppo.early_stop.history_steps} steps, scored on the next one at every "
               f"boundary of every completion (segments of {r.cppo.early_stop.segment_tokens} tokens); the recipe's "
               f"CPPO trains meanwhile (P={rate:g}); nothing is stopped",
               *([f"'{ORACLE}': the task's own check of the prefix (worked_arithmetic: has it left the reference "
                  "solution?), which no user's task has: a bound, not a predictor to use"] if with_oracle else []),
               f"total bench time {time.perf_counter() - t0:.0f} s"],
        extras={"per_step": rows},
        plot=lambda fig: _plot(fig, rows),
    )


def _plot(fig, rows: list[dict]) -> None:
    ax = fig.add_subplot(1, 1, 1)
    for name in dict.fromkeys(row["features"] for row in rows):
        sel = [row for row in rows if row["features"] == name]
        ax.plot([row["step"] for row in sel], [row["auc"] for row in sel], "o-", label=name)
    ax.axhline(0.5, color="k", ls=":", lw=1)
    ax.set(xlabel="held-out RL step", ylabel="AUC (every boundary)", title="early stopping's predictor")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
