"""``backend: megatron``: the embedded trainer as an SPMD program, one process per rank.

Started by ``cppo-megatron train RECIPE --nproc N`` (``launch.py``: torchrun underneath).
Every rank runs the same loop and decides the same things from the same seed:

    prompts     every rank builds the task, tokenizer and HF rollout model and draws the
                same prompt ids from a ``PromptSampler``; the ``AllocationPlanner`` sizes
                the step identically everywhere
    rollout     DP rank d takes the d-th contiguous slice of the prompts; the first rank of
                its model-parallel (TP x PP) group generates and rewards them and broadcasts
                the completions to its TP/PP peers, which must feed Megatron identical rows
                (one generation per DP rank instead of tp*pp identical ones, and no reliance
                on identical sampling across processes). The engine is HF ``generate`` or,
                with ``rollout.engine: vllm``, one in-process vLLM engine per rank on the
                job's process group (vLLM's external launcher); the sampling seed of a
                (step, DP rank, round) is derived from the run seed
    reward      the rewards of all DP ranks are all-gathered (dynamic-sampling decisions
                and the reward metrics need them)
    cppo        ``MegatronActor.step``: prune over all DP ranks, rebalance the survivors,
                old / reference log-probs and the update on the survivors only
    sync        Megatron -> full HF-layout weights (``hf_state_dict``: TP shards gathered,
                PP stages exchanged, in memory) into the HF model and the vLLM engines that
                generate or evaluate; vLLM's prefix cache is reset
    check       with vLLM, ``rollout/logprob_diff``: mean |sampler - Megatron| log-prob over
                the survivors' completion tokens (Megatron's pre-update pass), over all DP ranks

The supervised warm-up and the greedy evaluations run on rank 0 (with all the process's
CPU threads) and the warmed-up weights are broadcast to every rank before the actor is
built. Rank 0 writes metrics.jsonl, report.md and the progress lines.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from ..core import AllocationPlanner, PromptSampler
from ..rollout import HFEngine, SamplingParams
from ..tasks import build_task, combine_reward
from ..trainer.config import Recipe, load_recipe, recipe_to_dict
from ..trainer.evaluate import evaluate
from ..trainer.logger import MetricsLogger, read_metrics
from ..trainer.loop import _load_weights, _to_yaml
from ..trainer.models import build_model
from ..trainer.policy import lr_factor
from ..trainer.report import write_report
from ..trainer.sft import sft_warmup

__all__ = ["MegatronTrainer", "main"]

PHASES = ("rollout", "reward", "cppo", "old_logprob", "ref_logprob", "update", "sync")


class MegatronTrainer:
    """One rank of a ``backend: megatron`` run; ``torch.distributed`` must be initialised."""

    def __init__(self, recipe: Recipe) -> None:
        if not dist.is_initialized():
            raise RuntimeError("MegatronTrainer needs torch.distributed: start it with `cppo-megatron train --nproc N`")
        self.r = recipe
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        tp, pp = recipe.megatron.tp, recipe.megatron.pp
        if self.world % (tp * pp):
            raise ValueError(f"{self.world} processes are not divisible by megatron.tp * megatron.pp = {tp} * {pp}")
        self.is_main = self.rank == 0
        self.out = Path(recipe.out_dir)
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        self.main_threads = recipe.threads or os.cpu_count() or 1
        self.rank_threads = max(1, self.main_threads // local_world)
        torch.set_num_threads(self.rank_threads)
        if torch.cuda.is_available():
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        torch.manual_seed(recipe.seed)
        self.task = build_task(recipe.task)
        self.model, self.tok = build_model(recipe.model, self.task.alphabet, recipe.seed)
        self.model.to(self.device)
        # the HF copy holds the current policy (final.pt, the warm-up) and generates when engine=hf
        self.hf_engine = HFEngine(self.model, pad_id=self.tok.pad_id, eos_id=self.tok.eos_id, device=self.device,
                                  max_batch_sequences=recipe.rollout.max_batch_sequences, shared=False)
        self.engine = self.hf_engine
        self.use_vllm = recipe.rollout.engine == "vllm"
        if self.use_vllm:
            from ..rollout.vllm import VLLMEngine

            # built by every rank at this same point: vLLM creates its groups collectively
            self.engine = VLLMEngine(self.model, eos_id=self.tok.eos_id, seed=recipe.seed,
                                     kv_cache_gb=recipe.rollout.vllm_kv_cache_gb,
                                     gpu_memory_utilization=recipe.rollout.vllm_gpu_memory_utilization,
                                     sync_via_disk=recipe.rollout.vllm_sync_via_disk, join_process_group=True,
                                     tensor_parallel_size=recipe.rollout.vllm_tp)
        # greedy evaluation runs on rank 0 alone: a vLLM engine sharded over several ranks
        # cannot, so rank 0 evaluates with its HF copy then (greedy outputs are the same)
        self.eval_engine = self.engine if recipe.rollout.vllm_tp == 1 else self.hf_engine
        G = recipe.rollout.group_size
        self.planner = AllocationPlanner.from_config(recipe.cppo, capacity=recipe.train.capacity, group_size=G)
        self.sampler = PromptSampler(len(self.task.train), seed=recipe.seed)
        self.actor = None
        self.step = 0
        self.elapsed = 0.0
        self._last_acc = 0.0
        self.logger: Optional[MetricsLogger] = None
        if self.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            self.logger = MetricsLogger(self.out, tensorboard=recipe.log.tensorboard)

    # ------------------------------------------------------------------ setup
    def prepare(self) -> None:
        """Start weights (init_checkpoint, or the warm-up on rank 0 broadcast to all), the
        first evaluation, then the Megatron actor (policy + reference shards)."""
        from . import ActorConfig, MegatronActor, PolicyLossConfig

        r = self.r
        if self.is_main:
            (self.out / "recipe.yaml").write_text(_to_yaml(recipe_to_dict(r)))
        if r.init_checkpoint:
            self.model.load_state_dict(_load_weights(r.init_checkpoint))
        elif r.warmup.enabled:
            if self.is_main:
                with _threads(self.main_threads):
                    sft_warmup(
                        self.model, self.tok, self.task, r.warmup, device=self.device, seed=r.seed,
                        prompt_template=r.task.prompt_template, evaluate_fn=self._evaluate,
                        log_fn=lambda rec: self.logger.log({"kind": "warmup", **rec}),
                        progress=r.log.progress,
                    )
                torch.save(self.model.state_dict(), self.out / "warmup.pt")
            self._broadcast_weights(src=0)
        self._sync_from_model()
        self._log_eval()
        t = r.train
        loss = PolicyLossConfig(clip_low=t.clip_low, clip_high=t.clip_high, kl_coef=t.beta, kl_kind=t.kl_type,
                                loss_agg_mode=t.loss_agg, temperature=1.0)  # untempered, as the hf backend
        cfg = ActorConfig(tp=r.megatron.tp, pp=r.megatron.pp, lr=t.lr, weight_decay=t.weight_decay,
                          adam_betas=(t.adam_beta1, t.adam_beta2), clip_grad=t.grad_clip, mu=t.mu,
                          max_tokens_per_micro_batch=t.micro_batch_tokens, loss=loss, seed=r.seed)
        self.actor = MegatronActor(self.model.config, {k: v.detach().cpu() for k, v in self.model.state_dict().items()},
                                   cfg)
        from megatron.core import parallel_state as ps

        self.dp_rank, self.dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.dp_group = ps.get_data_parallel_group()
        self.mp_group = ps.get_model_parallel_group()
        self.mp_src = min(dist.get_process_group_ranks(self.mp_group))
        # ranks that call the engine: the model-parallel group's first rank (which broadcasts
        # the completions to its peers) and, with rollout.vllm_tp > 1, the rest of its vLLM TP
        # group (consecutive ranks, which must lie in that rank's Megatron TP group)
        vtp = r.rollout.vllm_tp  # 1 unless engine=vllm (validate_recipe)
        self.generates = self.mp_src <= self.rank < self.mp_src + vtp
        if self.generates and not set(range(self.mp_src, self.mp_src + vtp)) <= set(
                dist.get_process_group_ranks(ps.get_tensor_model_parallel_group())):
            raise RuntimeError(f"rollout.vllm_tp={vtp}: vLLM's TP group of ranks {self.mp_src}..{self.mp_src + vtp - 1} "
                               "is not inside one Megatron TP group; use rollout.vllm_tp=1")

    def _broadcast_weights(self, src: int) -> None:
        for v in self.model.state_dict().values():
            buf = v.detach().to(self._comm_device())
            dist.broadcast(buf, src=src)
            if self.rank != src:
                v.copy_(buf.to(v.device))

    def _sync_from_model(self) -> None:
        """The HF model's weights into this rank's vLLM engine (after the warm-up, its
        broadcast or an init_checkpoint; the HF engine generates with the model itself)."""
        if self.use_vllm:
            self.engine.update_weights(self.model.state_dict().items())

    def _sync_from_actor(self) -> None:
        """The updated Megatron policy as full HF tensors (a collective: every rank gathers)
        into the HF model, and into the vLLM engines that generate."""
        state = self.actor.hf_state_dict()
        self.hf_engine.update_weights(state.items())
        if self.use_vllm and self.generates:  # rank 0, which evaluates, is always one
            self.engine.update_weights(state.items())

    def close(self) -> None:
        self.engine.close()

    def _comm_device(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    # ------------------------------------------------------------------ run
    def run(self) -> dict:
        r = self.r
        self.prepare()
        while self.step < r.train.steps and not self._time_up():
            t0 = time.perf_counter()
            rec = self._rl_step()
            self.elapsed += time.perf_counter() - t0
            self.step += 1
            self.elapsed = _max_over_ranks(self.elapsed, self._comm_device())  # one stop decision
            if self.is_main:
                rec.update(step=self.step, wall=self.elapsed, kind="step")
                self.logger.log(rec, self.step)
            if r.eval.every and self.step % r.eval.every == 0 and self.step < r.train.steps:
                self._log_eval()
            if self.is_main and r.log.progress:
                print(_progress_line(rec, self.step, r.train.steps, self._last_acc), flush=True)
        final = self._log_eval()
        dist.barrier()  # nobody leaves while rank 0 still evaluates
        summary: dict = {}
        if self.is_main:
            torch.save(self.model.state_dict(), self.out / "final.pt")
            self.logger.close()
            title = f"{self.out.name}: {r.cppo.describe()} (backend megatron, {self._layout()})"
            summary = write_report(self.out, title, plots=r.log.plots)
            summary.update(balance_summary(read_metrics(self.out / "metrics.jsonl")))
            _append_balance(self.out / "report.md", summary)
            summary["final_eval"] = final
        return summary

    def _layout(self) -> str:
        return f"tp={self.r.megatron.tp} pp={self.r.megatron.pp} dp={self.dp}"

    def _time_up(self) -> bool:
        return bool(self.r.train.max_time_s) and self.elapsed >= self.r.train.max_time_s

    # ------------------------------------------------------------------ one step
    def _rl_step(self) -> dict:
        r = self.r
        G = r.rollout.group_size
        times = {p: 0.0 for p in PHASES}
        t_step = time.perf_counter()
        params = SamplingParams(n=G, temperature=r.rollout.temperature, top_p=r.rollout.top_p,
                                max_new_tokens=r.rollout.max_new_tokens, logprobs=self.use_vllm)
        seqs: list[torch.Tensor] = []  # this DP rank's completions, prompt + completion
        masks: list[torch.Tensor] = []
        sampler_lp: list[torch.Tensor] = []  # vLLM's log-probs, aligned with masks (0 on prompts)
        local_rewards: list[float] = []
        local_groups: list[int] = []  # global group index (draw order) of each local row
        all_rewards: list[float] = []  # every DP rank's rewards, in draw order
        all_correct: list[float] = []
        all_formatted: list[float] = []
        valid: set[int] = set()
        dropped = 0
        rounds = 0
        to_draw = self.planner.begin_step()
        while to_draw > 0:
            ids = self.sampler.draw(to_draw)  # identical on every rank
            lo, hi = _slice(len(ids), self.dp, self.dp_rank)
            base = len(all_rewards) // G
            t0 = time.perf_counter()
            payload = None
            if self.generates:
                problems = [self.task.train[i] for i in ids[lo:hi]]
                payload = self._generate(problems, params, step_round=rounds, times=times)
            box = [payload]
            dist.broadcast_object_list(box, src=self.mp_src, group=self.mp_group)
            prompts, completions, rewards, correct, formatted, logprobs = box[0]
            if not self.generates:
                times["rollout"] += time.perf_counter() - t0
            t1 = time.perf_counter()
            for j, (p, c) in enumerate(zip(prompts, completions)):
                seqs.append(torch.tensor(p + c, dtype=torch.int64))
                m = torch.zeros(len(p) + len(c) - 1)
                m[len(p) - 1 :] = 1.0  # targets t + 1 that are completion tokens
                masks.append(m)
                if logprobs is not None:
                    lp = torch.zeros(len(m))
                    lp[len(p) - 1 :] = torch.tensor(logprobs[j], dtype=torch.float32)
                    sampler_lp.append(lp)
                local_rewards.append(rewards[j])
                local_groups.append(base + lo + j // G)
            gathered = [None] * self.dp
            dist.all_gather_object(gathered, (rewards, correct, formatted), group=self.dp_group)
            for rw, co, fo in gathered:
                all_rewards += rw
                all_correct += co
                all_formatted += fo
            self.planner.record_round(len(ids), len(ids) * G)
            for g in range(base, base + len(ids)):
                group = all_rewards[g * G : (g + 1) * G]
                if r.cppo.dynamic_sampling and max(group) == min(group):
                    dropped += 1
                else:
                    valid.add(g)
            times["reward"] += time.perf_counter() - t1
            to_draw = self.planner.next_refill(len(valid))
            rounds += 1
        if not valid:
            raise RuntimeError("every group was dropped for zero reward variance; raise cppo.max_refill_rounds or "
                               "disable cppo.dynamic_sampling")
        rows = [i for i, g in enumerate(local_groups) if g in valid]
        lr = r.train.lr * lr_factor(self.step * r.train.mu, r.train, r.train.steps)
        for group in self.actor.optimizer.param_groups:
            group["lr"] = lr
        metrics = self.actor.step(
            [seqs[i] for i in rows], [masks[i] for i in rows],
            torch.tensor([local_rewards[i] for i in rows], dtype=torch.float32),
            torch.tensor([local_groups[i] for i in rows], dtype=torch.int64), r.cppo, step=self.step,
            extra_fields={"sampler_lp": [sampler_lp[i] for i in rows]} if self.use_vllm else None,
        )
        res = self.actor.last_exchange
        times["cppo"] = metrics["time/exchange"]
        for p in ("old_logprob", "ref_logprob", "update"):
            times[p] = metrics[f"time/{p}"]
        t0 = time.perf_counter()
        self._sync_from_actor()
        times["sync"] = time.perf_counter() - t0
        consistency = self._logprob_diff() if self.use_vllm else {}
        alloc = self.planner.end_step(res.prune.selection, dropped_prompts=dropped, dropped_completions=dropped * G)

        # every rank's view of the step, for the per-rank balance and forward-pass records
        passes = metrics["time/old_logprob"] + metrics["time/ref_logprob"] + metrics["time/update"]
        mine = {"pass_seconds": passes, "old_logprob_seconds": metrics["time/old_logprob"],
                "forwarded_sequences": metrics["cppo/forwarded_sequences_self"],
                "received": float(res.handle.num_received), "owned": float(len(rows)),
                "padded_tokens": metrics["cppo/padded_tokens_self"], "dp_rank": float(self.dp_rank)}
        ranks = [None] * self.world
        dist.all_gather_object(ranks, mine)
        if not self.is_main:
            return {}

        rec: dict = {f"time/{k}": v for k, v in times.items()}
        rec["time/step"] = time.perf_counter() - t_step
        n = len(all_rewards)
        rec["reward/mean"] = sum(all_rewards) / n
        rec["reward/correct_rate"] = sum(all_correct) / n
        rec["reward/format_rate"] = sum(all_formatted) / n
        rec["reward/mean_kept"] = float(res.meta.rewards[res.prune.selection.kept].mean())
        rec.update({k: v for k, v in metrics.items() if not k.endswith("_self") and not k.startswith("time/")})
        imb = metrics["cppo/exchange_imbalance"]
        rec["cppo/exchange_mean_load"] = metrics["cppo/exchange_max_load"] / imb if imb > 0 else 0.0
        slowest = max(x["pass_seconds"] for x in ranks)
        for key in ("pass_seconds", "old_logprob_seconds", "forwarded_sequences", "received", "owned",
                    "padded_tokens", "dp_rank"):
            rec[f"rank/{key}"] = [x[key] for x in ranks]
        rec["rank/wait_seconds"] = [slowest - x["pass_seconds"] for x in ranks]
        # The update ends in the DP gradient all-reduce, where a lighter rank idles until the
        # heaviest arrives: that hides the imbalance in pass_seconds. The old-policy pass has
        # no DP collective, so its spread is the measured cost of unequal workloads.
        old = [x["old_logprob_seconds"] for x in ranks]
        rec["rank/old_logprob_imbalance"] = max(old) / (sum(old) / len(old)) if sum(old) > 0 else 1.0
        rec["rank/old_logprob_wait_mean"] = sum(max(old) - t for t in old) / len(old)
        rec.update(alloc)
        rec.update(self.planner.metrics())
        rec.update(consistency)
        rec["train/lr"] = lr
        rec["data/epoch"] = self.sampler.epochs_float
        rec["sys/peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        return rec

    def _generate(self, problems, params: SamplingParams, *, step_round: int, times: dict):
        """This DP rank's completions and rewards (on the first rank of its model-parallel group)."""
        r = self.r
        t0 = time.perf_counter()
        if not problems:
            return [], [], [], [], [], ([] if params.logprobs else None)
        # one stream per (step, DP rank, round): reproducible and different across DP ranks
        params = dataclasses.replace(params, seed=_mix(r.seed, self.step, self.dp_rank, step_round))
        p_ids = [self.tok.prompt_ids(r.task.prompt_template.format(question=p.question)) for p in problems]
        out = self.engine.generate(p_ids, params)
        t1 = time.perf_counter()
        times["rollout"] += t1 - t0
        G = params.n
        prompts, rewards, correct, formatted = [], [], [], []
        for j, toks in enumerate(out.tokens):
            s = self.task.score(self.tok.decode(toks), problems[j // G])
            rewards.append(combine_reward(s, r.task.reward.correct, r.task.reward.format))
            correct.append(float(s.correct))
            formatted.append(float(s.formatted))
            prompts.append(p_ids[j // G])
        times["reward"] += time.perf_counter() - t1
        logprobs = None if out.logprobs is None else [lp.tolist() for lp in out.logprobs]
        return prompts, [list(t) for t in out.tokens], rewards, correct, formatted, logprobs

    def _logprob_diff(self) -> dict:
        """``rollout/logprob_diff``: mean |vLLM sampler - Megatron| log-prob over the survivors'
        completion tokens of all DP ranks, with the weights the completions were sampled with
        (the actor's pre-update pass); ``_max`` is the largest single-token difference."""
        res = self.actor.last_exchange
        total = torch.zeros(3, dtype=torch.float64)  # sum |diff|, tokens, max |diff|
        for lp, old, mask in zip(res.fields["sampler_lp"], self.actor.last_old_logprobs, res.fields["mask"]):
            d = (lp.float() - old.detach().float().cpu()).abs() * mask.float()
            total[0] += float(d.sum())
            total[1] += float(mask.sum())
            total[2] = max(float(total[2]), float(d.max()) if d.numel() else 0.0)
        dev = self._comm_device()
        sums, peak = total[:2].to(dev), total[2:].to(dev)
        dist.all_reduce(sums, group=self.dp_group)  # TP/PP peers hold the same rows: reduce over DP only
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=self.dp_group)
        diff = float(sums[0] / sums[1]) if float(sums[1]) > 0 else 0.0
        if self.is_main and diff > self.r.rollout.logprob_warn_threshold:
            warnings.warn(f"rollout/logprob_diff={diff:.4f} exceeds {self.r.rollout.logprob_warn_threshold}: "
                          "vLLM and the Megatron policy disagree", stacklevel=2)
        return {"rollout/logprob_diff": diff, "rollout/logprob_diff_max": float(peak[0])}

    # ------------------------------------------------------------------ evaluation
    def _evaluate(self, n: int) -> dict:
        if self.eval_engine is not self.hf_engine and self.actor is None:
            self._sync_from_model()  # during the warm-up the weights move without an RL update
        problems = list(self.task.test[: min(n, len(self.task.test))])
        return evaluate(self.eval_engine, self.tok, self.task, problems, self.r.rollout.max_new_tokens,
                        self.r.task.prompt_template)

    def _log_eval(self) -> Optional[dict]:
        """Greedy held-out accuracy on rank 0 (the other ranks go on to the next collective)."""
        if not self.is_main:
            return None
        with _threads(self.main_threads, restore=self.rank_threads):
            m = self._evaluate(self.r.eval.num_problems)
        self._last_acc = m["eval/accuracy"]
        self.logger.log({"kind": "eval", "step": self.step, "wall": self.elapsed, **m}, self.step)
        if self.r.log.progress:
            acc, err = m["eval/accuracy"], m["eval/stderr"]
            print(f"eval at step {self.step}: accuracy {acc:.3f} (± {err:.3f})", flush=True)
        return m


# ---------------------------------------------------------------------- helpers
def balance_summary(records: list[dict]) -> dict:
    """Mean over RL steps of the balance metrics (what the report and the docs quote)."""
    steps = [r for r in records if r.get("kind") == "step"]
    if not steps:
        return {}

    def mean(key):
        vals = [r[key] for r in steps if r.get(key) is not None]
        return sum(vals) / len(vals) if vals else float("nan")

    world = len(steps[0].get("rank/wait_seconds", []))
    return {
        "balance/imbalance": mean("cppo/exchange_imbalance"),
        "balance/imbalance_without": mean("cppo/exchange_imbalance_without"),
        "balance/max_load": mean("cppo/exchange_max_load"),
        "balance/max_load_without": mean("cppo/exchange_max_load_without"),
        "balance/mean_load": mean("cppo/exchange_mean_load"),
        "balance/moved_sequences": mean("cppo/exchange_moved_sequences"),
        "balance/rank_time_imbalance": mean("cppo/rank_time_imbalance"),
        "balance/rank_wait_mean": mean("cppo/rank_wait_mean"),
        "balance/rank_wait_max": mean("cppo/rank_wait_max"),
        "balance/rank_wait_fraction": mean("cppo/rank_wait_fraction"),
        "balance/old_logprob_imbalance": mean("rank/old_logprob_imbalance"),
        "balance/old_logprob_wait_mean": mean("rank/old_logprob_wait_mean"),
        "balance/rank_wait_per_rank": [sum(r["rank/wait_seconds"][i] for r in steps) / len(steps)
                                       for i in range(world)],
        "balance/pass_seconds_per_rank": [sum(r["rank/pass_seconds"][i] for r in steps) / len(steps)
                                          for i in range(world)],
    }


def _append_balance(report: Path, s: dict) -> None:
    if not s:
        return
    lines = [
        "", "## Rank balance (means over RL steps)", "",
        f"- workload max/mean over DP ranks: {s['balance/imbalance']:.4f} with redistribution, "
        f"{s['balance/imbalance_without']:.4f} if survivors had stayed on their rank "
        f"(max load {s['balance/max_load']:.0f} vs {s['balance/max_load_without']:.0f}, mean "
        f"{s['balance/mean_load']:.0f}; {s['balance/moved_sequences']:.1f} sequences moved per step)",
        f"- measured pass time max/mean: {s['balance/rank_time_imbalance']:.3f}; wait at the step barrier: mean "
        f"{s['balance/rank_wait_mean']:.3f} s, max {s['balance/rank_wait_max']:.3f} s "
        f"({s['balance/rank_wait_fraction']:.1%} of rank time)",
        f"- old-policy log-prob pass (no DP collective inside): time max/mean "
        f"{s['balance/old_logprob_imbalance']:.3f}, mean wait for the slowest "
        f"{s['balance/old_logprob_wait_mean']:.3f} s",
        "- per rank: wait " + ", ".join(f"{w:.3f}" for w in s["balance/rank_wait_per_rank"]) + " s; passes "
        + ", ".join(f"{w:.3f}" for w in s["balance/pass_seconds_per_rank"]) + " s",
    ]
    with report.open("a") as fh:
        fh.write("\n".join(lines) + "\n")


def _progress_line(rec: dict, step: int, total: int, acc: float) -> str:
    return (f"step {step}/{total}  reward {rec['reward/mean']:.3f}  kept {rec['cppo/kept_ratio']:.2f}  "
            f"acc {acc:.3f}  imbalance {rec['cppo/exchange_imbalance']:.3f} "
            f"(without {rec['cppo/exchange_imbalance_without']:.3f})  wait max {rec['cppo/rank_wait_max']:.2f} s  "
            f"step {rec['time/step']:.1f} s")


def _slice(n: int, parts: int, i: int) -> tuple[int, int]:
    """The i-th of ``parts`` contiguous, near-equal slices of range(n)."""
    return n * i // parts, n * (i + 1) // parts


def _mix(*xs: int) -> int:
    # the backend's own seed hash (not rollout.mix_seed): the runs in docs/integrations/megatron.md
    # were sampled with it and reproduce only with it
    h = 0x9E3779B97F4A7C15
    for x in xs:
        h = (h ^ (int(x) + 0x632BE59BD9B4E019)) * 0xBF58476D1CE4E5B9 % (1 << 63)
    return h


def _max_over_ranks(x: float, device) -> float:
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


class _threads:
    """Temporarily give this process ``n`` torch threads (rank 0 while the others wait)."""

    def __init__(self, n: int, restore: Optional[int] = None) -> None:
        self.n, self.restore = n, restore

    def __enter__(self):
        self.prev = torch.get_num_threads()
        torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        torch.set_num_threads(self.restore or self.prev)


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of every rank: ``python -m cppo_megatron.megatron.backend RECIPE [key=value ...]``."""
    parser = argparse.ArgumentParser(prog="cppo_megatron.megatron.backend")
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    # megatron-core warns about optional CUDA kernels (apex, TE) on every rank: keep the
    # console to rank 0's progress and its other warnings
    warnings.filterwarnings("ignore", module=r"megatron\.")
    if int(os.environ.get("RANK", 0)) != 0:
        warnings.simplefilter("ignore")
    recipe = load_recipe(args.recipe, args.overrides)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    # rank 0 runs the warm-up while the others wait in a broadcast: allow for it
    dist.init_process_group(backend, timeout=timedelta(hours=6))
    trainer = None
    try:
        trainer = MegatronTrainer(recipe)
        summary = trainer.run()
    finally:
        from .model import destroy_parallel

        destroy_parallel()
        if trainer is not None:
            trainer.close()
        if dist.is_initialized():  # vLLM's shutdown may already have taken the default group down
            dist.destroy_process_group()
    if summary:
        print(
            f"done: accuracy {summary['accuracy_before']:.3f} -> {summary['accuracy_after']:.3f}, "
            f"{summary['steps']} RL steps in {summary['rl_wall_s']:.0f} s; workload max/mean "
            f"{summary['balance/imbalance']:.3f} (without redistribution {summary['balance/imbalance_without']:.3f}); "
            f"report: {recipe.out_dir}/report.md", flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
