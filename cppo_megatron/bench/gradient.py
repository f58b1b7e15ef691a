"""bench gradient: how much of the full-batch policy gradient each kept set preserves.

On real batches of a training run of RECIPE (its model, task, rollout and loss), at a few
points of training (after the warm-up, then after N RL steps of the recipe's own CPPO
training), per batch:

- the full-batch gradient g: the recipe's loss over ALL completions (every completion
  trained, GRPO), summed over micro-batches;
- for each kept set S (CPPO smallest / largest / random at several P, importance, and
  keep_mass): the gradient g_S of the loss the trainer would run on S - the kept-set
  denominators for the deterministic metrics (as CPPO trains), the full batch's
  denominators and 1/pi weights for importance (the unbiased HT estimate);
- cosine(g_S, g), relative norm error |g_S - g| / |g| and norm ratio |g_S| / |g|, and the
  seconds per prompt of the kept set's forward + backward.

With ``--early-stop`` (cppo.early_stop, docs/early_stopping.md), at the recipe's pruning rate: the
kept set of CPPO + early stopping as the engine would have formed it on these completions
(``core.replay_early_stop``: boundary by boundary, the predictor's stops; the survivors chosen
among the finished ones by ``core.early_stop_prune``) with each estimator (impute, finished), and
an upper bound labelled ``oracle``: a predictor that knows each completion's outcome. The
predictor is fitted at each point on ``--es-train-batches`` batches sampled before the measured
ones (as the trainer fits it on earlier steps). ``tokens_share``: tokens generated over the full
batch's (1 without early stopping); ``predictor_auc``: its AUC over the measured batches' prefixes.

With ``--two-wave K`` (cppo.two_wave, docs/early_stopping.md "Two waves"): the kept set of two waves
with a first wave of K, as the trainer would have formed it on these completions (each group's
first K completions stand for its first wave; ``core.two_wave_advantages``): a group whose first K
agree is left out, the others keep all G (``P=0``: GRPO + two waves) or CPPO's survivors at each
rate of --rates. ``tokens_share``: the first waves' tokens plus the finished groups' second waves,
over the full batch's.

Mean +- sd over batches per (training point, kept set). Batches without any learning
signal (every group of equal rewards: g = 0) are skipped and counted.

  cppo-megatron bench gradient recipes/tiny_cpu.yaml --points 0,20,60 --batches 4
  cppo-megatron bench gradient recipes/worked_cpu.yaml --early-stop --rates 0.875
  cppo-megatron bench gradient recipes/tiny_cpu.yaml --two-wave 4 --rates 0.875 --points 0
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..recipes import arg_type as recipe_arg
from .report import Report

__all__ = ["KeptSet", "compare", "configure", "early_stop_sets", "kept_sets", "policy_gradient", "run",
           "two_wave_sets"]

DEFAULT_RATES = "0.5,0.75,0.875,0.9375"
DEFAULT_KEEP_MASS = "0.5,0.8,0.9,0.95"


@dataclass(frozen=True)
class KeptSet:
    """One selection rule to compare: a label and the ``CPPOConfig`` fields it sets; ``early_stop``:
    the estimator of an early-stopping set (``"impute"`` / ``"finished"``), ``oracle``: its predictor
    knows the outcome (an upper bound); ``two_wave``: the first wave's size k of a two-wave set."""

    label: str
    metric: str
    pruning_rate: float | None = None
    keep_mass: float | None = None
    early_stop: str | None = None
    oracle: bool = False
    two_wave: int | None = None


def early_stop_sets(rate: float) -> list[KeptSet]:
    """The early-stopping kept sets at pruning rate ``rate``: each estimator, and the oracle bound."""
    return [KeptSet(f"early_stop impute P={rate:g}", "smallest", pruning_rate=rate, early_stop="impute"),
            KeptSet(f"early_stop finished P={rate:g}", "smallest", pruning_rate=rate, early_stop="finished"),
            KeptSet(f"early_stop oracle P={rate:g} (upper bound)", "smallest", pruning_rate=rate,
                    early_stop="impute", oracle=True)]


def two_wave_sets(first_waves: list[int], rates: list[float]) -> list[KeptSet]:
    """The two-wave kept sets: for each first wave k, GRPO + two waves (P = 0) and CPPO + two waves at
    each rate of ``rates``."""
    return [KeptSet(f"two_wave k={k} P={p:g}", "smallest", pruning_rate=p, two_wave=k)
            for k in first_waves for p in [0.0, *rates]]


def kept_sets(rates: list[float], keep_mass: list[float]) -> list[KeptSet]:
    out = []
    for metric in ("smallest", "largest", "random", "importance"):
        out += [KeptSet(f"{metric} P={p:g}", metric, pruning_rate=p) for p in rates]
    out += [KeptSet(f"keep_mass f={f:g}", "smallest", keep_mass=f) for f in keep_mass]
    out += [KeptSet(f"importance+keep_mass f={f:g}", "importance", keep_mass=f) for f in keep_mass[-1:]]
    return out


def policy_gradient(model, batch, advantages: torch.Tensor, train_cfg, *, pad_id: int, device,
                    weights: torch.Tensor | None = None, num_tokens: float | None = None,
                    num_seqs: float | None = None, norm_constant: float, ref_model=None) -> torch.Tensor:
    """[P] float32 flat gradient of the recipe's loss on ``batch`` (a ``KeptBatch``).

    Args:
        advantages: [K] one per sequence of ``batch``.
        weights: [K] optional per-sequence loss weights (importance).
        num_tokens, num_seqs: the loss denominators (default: the batch's own).
        norm_constant: Dr. GRPO's constant for ``seq-mean-token-sum-norm``.

    One policy iteration at the behaviour policy (ratio 1, as the first of mu updates),
    plus the KL term when the recipe's beta > 0 (``ref_model`` then required).
    """
    from ..core import aggregate_loss, clipped_surrogate, kl_penalty
    from ..trainer.policy import forward_logprobs, micro_batches

    if train_cfg.beta > 0 and ref_model is None:
        raise ValueError("beta > 0 needs the reference model")
    mask = batch.completion_mask()
    agg = dict(global_num_tokens=float(mask.sum()) if num_tokens is None else num_tokens,
               global_num_seqs=float(len(batch)) if num_seqs is None else num_seqs, norm_constant=norm_constant)
    params = [p for p in model.parameters() if p.requires_grad]
    model.zero_grad(set_to_none=True)
    was_training = model.training
    model.eval()  # no dropout: every kept set sees the same function
    try:
        for rows in micro_batches(batch, train_cfg.micro_batch_tokens):
            lp = forward_logprobs(model, batch, rows, pad_id, device)
            m = mask[rows, : lp.shape[1]].to(device)
            pg, _ = clipped_surrogate(lp, lp.detach(), advantages[rows].to(device),
                                      clip_low=train_cfg.clip_low, clip_high=train_cfg.clip_high)
            per_token = pg
            if train_cfg.beta > 0:
                with torch.no_grad():
                    ref = forward_logprobs(ref_model, batch, rows, pad_id, device)
                per_token = pg + train_cfg.beta * kl_penalty(lp, ref, train_cfg.kl_type)
            w = weights[rows] if weights is not None else None
            aggregate_loss(per_token, m, train_cfg.loss_agg, weights=w, **agg).backward()
    finally:
        model.train(was_training)
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().flatten().float().cpu()
                      for p in params])
    model.zero_grad(set_to_none=True)
    return flat


def compare(g_set: torch.Tensor, g_full: torch.Tensor) -> dict[str, float]:
    """cosine, relative norm error and norm ratio of ``g_set`` against ``g_full`` ([P] each)."""
    nf = float(g_full.norm())
    if nf == 0:
        raise ValueError("the full-batch gradient is zero: no learning signal to compare against")
    ns = float(g_set.norm())
    cos = float(g_set @ g_full) / (ns * nf) if ns > 0 else 0.0
    return {"cosine": cos, "rel_error": float((g_set - g_full).norm()) / nf, "norm_ratio": ns / nf}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", type=recipe_arg("train"), help="recipe YAML (e.g. recipes/tiny_cpu.yaml)")
    parser.add_argument("overrides", nargs="*", help="recipe overrides key=value")
    parser.add_argument("--points", default="0,20,60",
                        help="RL steps (of the recipe's own training) at which to measure; 0 = right after "
                             "the warm-up (default 0,20,60)")
    parser.add_argument("--batches", type=int, default=4, help="batches measured per point (default 4)")
    parser.add_argument("--prompts", type=int, default=32, help="prompts per batch, G completions each (default 32)")
    parser.add_argument("--rates", default=DEFAULT_RATES, help=f"pruning rates P (default {DEFAULT_RATES})")
    parser.add_argument("--keep-mass", default=DEFAULT_KEEP_MASS,
                        help=f"keep_mass fractions f (default {DEFAULT_KEEP_MASS})")
    parser.add_argument("--warmup-checkpoint", default=None,
                        help="start weights; default: the recipe's init_checkpoint, else run its warm-up once")
    parser.add_argument("--early-stop", action="store_true",
                        help="also the kept sets of CPPO + early stopping (cppo.early_stop: each estimator, and an "
                             "oracle upper bound) at each pruning rate of --rates")
    parser.add_argument("--two-wave", default=None, metavar="K[,K...]",
                        help="also the kept sets of two waves (cppo.two_wave) with a first wave of K completions "
                             "per prompt: GRPO + two waves (P=0) and CPPO + two waves at each rate of --rates")
    parser.add_argument("--es-train-batches", type=int, default=2,
                        help="with --early-stop: batches sampled at each point, before the measured ones, to fit "
                             "the predictor on (default 2)")


def _floats(name: str, text: str, lo: float, hi: float, lo_open: bool = False, hi_open: bool = True) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{name} must be comma-separated numbers, got {text!r}") from None
    bad = [v for v in vals if (v <= lo if lo_open else v < lo) or (v >= hi if hi_open else v > hi)]
    if not vals or bad:
        raise ValueError(f"{name} must be numbers in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}, "
                         f"got {text!r}")
    return vals


def _first_waves(text: str, G: int) -> list[int]:
    """``--two-wave``'s first-wave sizes: comma-separated integers in [2, G)."""
    vals = _floats("--two-wave", text, 2, G, hi_open=True)
    if any(v != int(v) for v in vals):
        raise ValueError(f"--two-wave must be integers in [2, {G}) (completions per prompt), got {text!r}")
    return [int(v) for v in vals]


def _sample_batch(trainer, sampler, prompts: int):
    """Prompts from the train split, G completions each, rewards: (prompt_ids, completions, rewards)."""
    from ..rollout import SamplingParams
    from ..tasks import combine_reward

    r = trainer.r
    G = r.rollout.group_size
    problems = [trainer.task.train[i] for i in sampler.draw(prompts)]
    p_ids = [trainer.tok.prompt_ids(r.task.prompt_template.format(question=p.question)) for p in problems]
    params = SamplingParams(n=G, temperature=r.rollout.temperature, top_p=r.rollout.top_p,
                            max_new_tokens=r.rollout.max_new_tokens, logprobs=True, logprobs_mode="raw")
    out = trainer.engine.generate(p_ids, params)
    rewards = []
    for j, toks in enumerate(out.tokens):
        s = trainer.task.score(trainer.tok.decode(toks), problems[j // G])
        rewards.append(combine_reward(s, r.task.reward.correct, r.task.reward.format, r.task.reward.step))
    prompts_rep = [p_ids[j // G] for j in range(len(out.tokens))]
    assert out.logprobs is not None  # asked for
    width = max(len(t) for t in out.tokens)
    logp = torch.zeros(len(out.tokens), max(width, 1))
    for i, lp in enumerate(out.logprobs):
        logp[i, : lp.numel()] = lp
    ended = torch.tensor([why == "stop" for why in out.finish_reasons])
    _LAST_GENERATION.update(logprobs=logp, ended=ended)
    return prompts_rep, list(out.tokens), torch.tensor(rewards, dtype=torch.float32)


# the last sampled batch's per-token log-probs and EOS flags (early stopping's replay reads them)
_LAST_GENERATION: dict = {}


def measure_batch(trainer, prompts_rep, completions, rewards, sets: list[KeptSet], step: int,
                  early: dict | None = None) -> dict:
    """Full-batch gradient and every kept set's gradient on one batch: {label: metrics}. ``early``:
    what the early-stopping sets need (``predictor``, ``logprobs``, ``ended``)."""
    from ..core import prune
    from ..trainer.policy import KeptBatch

    r = trainer.r
    G = r.rollout.group_size
    gids = torch.arange(rewards.numel()) // G
    full_batch = KeptBatch(prompts_rep, completions)
    n_prompts = rewards.numel() // G
    common = dict(pad_id=trainer.tok.pad_id, device=trainer.device, norm_constant=float(r.rollout.max_new_tokens),
                  ref_model=getattr(trainer.policy, "ref_model", None))
    full_res = prune(rewards, gids, replace(r.cppo, pruning_rate=0.0, keep_per_group=None, keep_mass=None,
                                            metric="smallest"), step=step)
    t0 = time.perf_counter()
    g_full = policy_gradient(trainer.model, full_batch, full_res.advantages, r.train, **common)
    out = {"full": {"cosine": 1.0, "rel_error": 0.0, "norm_ratio": 1.0, "kept_ratio": 1.0,
                    "s_per_prompt": (time.perf_counter() - t0) / n_prompts}}
    if float(g_full.norm()) == 0:
        return {}
    full_tokens = float(full_batch.completion_mask().sum())
    for ks in sets:
        cfg = replace(r.cppo, metric=ks.metric, pruning_rate=ks.pruning_rate, keep_per_group=None,
                      keep_mass=ks.keep_mass)
        t0 = time.perf_counter()
        share, extra = 1.0, {}
        weights = None
        if ks.two_wave is not None:
            kept_rows, kept_adv, share, extra = _two_wave_set(ks, cfg, rewards, completions, G, step)
        else:
            if ks.early_stop is not None:
                if early is None:
                    continue
                res, share, extra = _early_stop_set(trainer, ks, cfg, rewards, gids, completions, early, step)
            else:
                res = prune(rewards, gids, cfg, step=step)
            kept_rows, kept_adv = res.selection.kept, res.kept_advantages
            weights = res.selection.weights if res.selection.weighted else None
        kept = kept_rows.tolist()
        if not kept:
            g = torch.zeros_like(g_full)
        else:
            kb = KeptBatch([prompts_rep[i] for i in kept], [completions[i] for i in kept])
            if weights is not None:  # HT: weights and the full batch's denominators
                g = policy_gradient(trainer.model, kb, kept_adv, r.train, weights=weights,
                                    num_tokens=full_tokens, num_seqs=float(rewards.numel()), **common)
            else:
                g = policy_gradient(trainer.model, kb, kept_adv, r.train, **common)
        row = compare(g, g_full)
        row["kept_ratio"] = len(kept) / rewards.numel()
        row["s_per_prompt"] = (time.perf_counter() - t0) / n_prompts
        row["tokens_share"] = share
        row.update(extra)
        out[ks.label] = row
    out["full"]["tokens_share"] = 1.0
    return out


def _two_wave_set(ks: KeptSet, cfg, rewards, completions, G: int, step: int):
    """(kept rows [K] int64 in batch order, their advantages [K], tokens share, extra metrics) of a
    two-wave kept set on a batch generated in full: the finished groups (``core.two_wave_advantages``
    on the first ``ks.two_wave`` columns), then CPPO's selection among their rows at ``cfg``'s rate."""
    from ..core import prune
    from ..core.two_wave import two_wave_advantages

    assert ks.two_wave is not None  # only two-wave sets come here
    k = ks.two_wave
    adv, finish = two_wave_advantages(rewards.reshape(-1, G), k, cfg)
    lengths = torch.tensor([len(c) for c in completions], dtype=torch.float64).reshape(-1, G)
    made = float(lengths[:, :k].sum() + lengths[finish, k:].sum())
    share = made / max(float(lengths.sum()), 1.0)
    rows = (finish.nonzero().squeeze(1)[:, None] * G + torch.arange(G)).reshape(-1)
    extra = {"finished_share": float(finish.float().mean())}
    if rows.numel() == 0:  # no group finished: nothing trains
        return rows, adv[:0], share, extra
    res = prune(rewards[rows], torch.arange(rows.numel()) // G, cfg, step=step)
    return rows[res.selection.kept], res.kept_advantages, share, extra


def _early_stop_set(trainer, ks: KeptSet, cfg, rewards, gids, completions, early: dict, step: int):
    """(PruneResult, tokens share, extra metrics) of an early-stopping kept set on a batch generated
    in full: the stops ``replay_early_stop`` names, then ``early_stop_prune``."""
    from ..core import PruneResult
    from ..core.early_stop import early_stop_prune, imputed_moments, replay_early_stop

    r = trainer.r
    G = r.rollout.group_size
    es = replace(cfg.early_stop, enabled=True, estimator=ks.early_stop)
    cfg = replace(cfg, early_stop=es)
    success = rewards.to(torch.float64) >= es.success_threshold
    predictor = early["predictor"]
    lengths = torch.tensor([len(c) for c in completions])
    # the oracle knows each completion's outcome (q 0.98 / 0.02) and the batch's class means
    known = torch.where(success, 0.98, 0.02) if ks.oracle else None
    rep = replay_early_stop(predictor, early["logprobs"], lengths, early["ended"], gids, cfg=es, group_size=G,
                            keep=cfg.keep_for_group(G), max_new_tokens=r.rollout.max_new_tokens, seed=cfg.seed,
                            step=step, known_q=known)
    means = predictor.class_means
    if ks.oracle and bool(success.any()) and bool((~success).any()):
        means = (float(rewards[~success].mean()), float(rewards[success].mean()))
    mu, sq = imputed_moments(torch.nan_to_num(rep.q_last, nan=0.5), means)
    es_res = early_stop_prune(rewards, rep.stopped, gids, cfg, expected=mu, expected_sq=sq, step=step)
    made = torch.where(rep.stopped, rep.stopped_at, lengths).sum()
    res = PruneResult(es_res.advantages.to(torch.float32), es_res.stats, es_res.selection)
    return res, float(made) / float(lengths.sum()), {"stopped_share": float(rep.stopped.float().mean())}


def _mean_sd(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return m, sd


def run(args: argparse.Namespace) -> Report:
    from ..core import PromptSampler
    from ..trainer import Trainer
    from ..trainer.config import load_recipe, replace_recipe
    from .speedup import warm_start

    points = sorted({int(x) for x in _floats("--points", args.points, 0, float("inf"))})
    rates = _floats("--rates", args.rates, 0.0, 1.0, lo_open=True)
    masses = _floats("--keep-mass", args.keep_mass, 0.0, 1.0, lo_open=True, hi_open=False)
    if args.batches < 1 or args.prompts < 1:
        raise ValueError(f"--batches and --prompts must be >= 1, got {args.batches}, {args.prompts}")
    recipe = load_recipe(args.recipe, args.overrides)
    if recipe.backend != "hf":
        raise ValueError(f"bench gradient measures gradients of the HF policy in one process; got backend="
                         f"{recipe.backend}: run it with backend=hf (the kept sets are the same on both backends)")
    first_waves = _first_waves(args.two_wave, recipe.rollout.group_size) if getattr(args, "two_wave", None) else []
    out = Path(args.out)
    t_start = time.perf_counter()
    warm = warm_start(recipe, out, args.warmup_checkpoint)
    run_recipe = replace_recipe(recipe, out_dir=str(out / "gradient_run"), init_checkpoint=str(warm), **{
        "warmup.enabled": False, "eval.every": 0, "log.progress": False, "log.tensorboard": False,
        "log.plots": False, "log.checkpoint_every": 0, "train.steps": 10**9, "train.max_time_s": 0.0})
    trainer = Trainer(run_recipe)
    trainer.prepare(initial_eval=False)
    sets = kept_sets(rates, masses) + two_wave_sets(first_waves, rates)
    if args.early_stop:
        sets += [ks for rate in rates for ks in early_stop_sets(rate)]
    labels = ["full"] + [s.label for s in sets]
    per_point: dict[int, dict[str, list[dict]]] = {}
    skipped: dict[int, int] = {}
    bar = _bar(len(points) * args.batches, recipe.log.progress)
    for point in points:
        while trainer.step < point:
            trainer.step_once()
        # an own prompt stream per point: measuring does not change what training draws
        sampler = PromptSampler(len(trainer.task.train), seed=recipe.seed + 7919 * (point + 1))
        acc: dict[str, list[dict]] = {k: [] for k in labels}
        skipped[point] = 0
        predictor = _fit_predictor(trainer, sampler, args) if args.early_stop else None
        for b in range(args.batches):
            prompts_rep, completions, rewards = _sample_batch(trainer, sampler, args.prompts)
            early = None if predictor is None else {"predictor": predictor, **_LAST_GENERATION}
            res = measure_batch(trainer, prompts_rep, completions, rewards, sets, step=1000 * point + b, early=early)
            if not res:
                skipped[point] += 1
            for k, v in res.items():
                acc[k].append(v)
            if bar is not None:
                bar.update(1)
        per_point[point] = acc
    if bar is not None:
        bar.close()
    trainer.main_logger.close()
    rows = _summary_rows(per_point, labels)
    if not rows:
        raise ValueError("every batch had zero reward variance (no gradient): warm the model up first")
    G = recipe.rollout.group_size
    notes = [
        f"{args.batches} batches of {args.prompts} prompts x G={G} per point; points = RL steps of the recipe's own "
        f"training ({recipe.cppo.describe()}) after the warm-up; skipped batches without signal: {skipped}.",
        "full = the recipe's loss over every completion. Deterministic kept sets use the kept set's own "
        "denominators (what CPPO trains); importance uses 1/pi weights and the full batch's denominators "
        "(the unbiased HT estimate).",
        "cosine and rel_error = |g_S - g| / |g| against the full-batch gradient; norm_ratio = |g_S| / |g|; "
        "mean and sd over batches; ms_per_prompt = selection + forward + backward of the kept set per prompt.",
        f"total bench time {time.perf_counter() - t_start:.0f} s",
    ]
    return Report(
        name="gradient",
        title=f"Gradient fidelity of kept sets, {Path(args.recipe).name}",
        params={"recipe": args.recipe, "overrides": args.overrides, "points": points, "batches": args.batches,
                "prompts": args.prompts, "rates": rates, "keep_mass": masses, "warm_start": str(warm)},
        columns=["rl_step", "kept_set", "batches", "kept_ratio", "tokens_share", "cosine", "cosine_sd", "rel_error",
                 "rel_error_sd", "norm_ratio", "ms_per_prompt"],
        rows=rows,
        notes=notes,
        extras={"skipped_batches": skipped},
        plot=lambda fig: _plot(fig, rows, points),
    )


def _summary_rows(per_point: dict[int, dict[str, list[dict]]], labels: list[str]) -> list[dict]:
    """One row per (training point, kept set) that has batches: mean and sd of each figure."""
    rows = []
    for point, acc in per_point.items():
        for label in labels:
            recs = acc[label]
            if not recs:
                continue
            row = {"rl_step": point, "kept_set": label, "batches": len(recs)}
            for key in ("kept_ratio", "cosine", "rel_error", "norm_ratio", "tokens_share"):
                m, sd = _mean_sd([r[key] for r in recs])
                row[key] = m
                row[f"{key}_sd"] = sd
            row["ms_per_prompt"] = 1e3 * _mean_sd([r["s_per_prompt"] for r in recs])[0]
            rows.append(row)
    return rows


def _fit_predictor(trainer, sampler, args):
    """The early-stopping predictor of a point: features of every boundary of ``--es-train-batches``
    batches (``replay_early_stop`` without a predictor), their outcomes; ``core.PrefixPredictor``."""
    from ..core.early_stop import PrefixPredictor, replay_early_stop

    r = trainer.r
    G = r.rollout.group_size
    es = r.cppo.early_stop
    xs, ys, rs = [], [], []
    for _ in range(max(args.es_train_batches, 1)):
        _, completions, rewards = _sample_batch(trainer, sampler, args.prompts)
        lengths = torch.tensor([len(c) for c in completions])
        gids = torch.arange(len(completions)) // G
        rep = replay_early_stop(None, _LAST_GENERATION["logprobs"], lengths, _LAST_GENERATION["ended"], gids, cfg=es,
                                group_size=G, keep=max(1, G // 8), max_new_tokens=r.rollout.max_new_tokens)
        x, rows = rep.examples
        xs.append(x)
        ys.append((rewards[rows] >= es.success_threshold).to(torch.float64))
        rs.append(rewards[rows].to(torch.float64))
    y = torch.cat(ys)
    if y.numel() == 0 or y.min() == y.max():
        raise ValueError("bench gradient --early-stop: the predictor's training batches hold one outcome only "
                         "(every completion succeeded or every one failed); warm the model up further or raise "
                         "--es-train-batches")
    return PrefixPredictor(es.l2).fit(torch.cat(xs), y, torch.cat(rs))


def _bar(total: int, enabled: bool):
    if not enabled:
        return None
    from ..progress import progress

    return progress(total, "bench gradient")


def _plot(fig, rows: list[dict], points: list[int]) -> None:
    colors = {"smallest": "tab:blue", "largest": "tab:red", "random": "tab:gray", "importance": "tab:green",
              "keep_mass": "tab:purple", "importance+keep_mass": "tab:olive", "two_wave": "tab:orange"}
    styles = ["-", "--", ":", "-."]
    axes = [fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)]
    for key, ax, ylabel in ((("cosine", axes[0], "cosine to the full-batch gradient")),
                            ("rel_error", axes[1], "|g_S - g| / |g|")):
        for i, point in enumerate(points):
            for family, color in colors.items():
                sel = [r for r in rows if r["rl_step"] == point and r["kept_set"].split(" ")[0] == family]
                if not sel:
                    continue
                sel.sort(key=lambda r: r["kept_ratio"])
                ax.errorbar([r["kept_ratio"] for r in sel], [r[key] for r in sel], yerr=[r[f"{key}_sd"] for r in sel],
                            color=color, linestyle=styles[i % len(styles)], marker="o", ms=3, capsize=2,
                            label=f"{family} @ step {point}")
        ax.set(xlabel="fraction of completions kept", ylabel=ylabel)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=6, ncol=2)
