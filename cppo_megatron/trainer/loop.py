"""The embedded GRPO/CPPO trainer: one process, CPU by default, CUDA when present.

A step, each phase timed (``time/<phase>`` in metrics.jsonl):

    rollout      G completions for each drawn prompt (HF generate or vLLM)
    reward       the task's verifiable reward (correctness + format)
    cppo         full-group advantages -> survivors -> allocation accounting -> micro-batches
    old_logprob  behaviour-policy log-probs of the survivors (only when mu > 1)
    ref_logprob  reference log-probs of the survivors (only when beta > 0)
    update       mu optimizer steps on the survivors
    sync         weights to the rollout engine (free when it shares the policy)

With ``cppo.pruning_rate: 0`` every completion survives: plain GRPO through the same code.
"""

from __future__ import annotations

import copy
import dataclasses
import resource
import signal
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch

from ..core import AllocationPlanner, PromptSampler, prune
from ..rollout import SamplingParams, build_engine, mix_seed
from ..tasks import Task, build_task, combine_reward
from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint, set_rng_state
from .config import Recipe, recipe_to_dict
from .evaluate import evaluate
from .logger import MetricsLogger
from .models import build_model, resolve_device
from .policy import HFPolicy, KeptBatch, micro_batches
from .report import write_report
from .sft import sft_warmup


class Trainer:
    def __init__(self, recipe: Recipe, *, resume: bool = False, task: Optional[Task] = None) -> None:
        """``task`` replaces the recipe's task (bring your own problems and scorer)."""
        if recipe.backend != "hf":
            raise ValueError(
                f"backend={recipe.backend!r} runs under torchrun: `cppo-megatron train RECIPE --nproc N` "
                "(docs/integrations/megatron.md)"
            )
        self.r = recipe
        self.out = Path(recipe.out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        if recipe.threads:
            torch.set_num_threads(recipe.threads)
        torch.manual_seed(recipe.seed)
        self.device = resolve_device(recipe.device)
        self.task = task if task is not None else build_task(recipe.task)
        self.model, self.tok = build_model(recipe.model, self.task.alphabet, recipe.seed)
        self.model.to(self.device)
        G = recipe.rollout.group_size
        self.engine = build_engine(
            recipe.rollout.engine,
            **self._engine_kwargs(),
        )
        self.planner = AllocationPlanner.from_config(recipe.cppo, capacity=recipe.train.capacity, group_size=G)
        self.sampler = PromptSampler(len(self.task.train), seed=recipe.seed)
        self.policy = HFPolicy(
            self.model, device=self.device, pad_id=self.tok.pad_id, train_cfg=recipe.train,
            total_steps=recipe.train.steps,
        )
        self.ref_model = None
        self.step = 0
        self.elapsed = 0.0  # RL wall time, carried across resumes
        self.resumed_from: Optional[Path] = None
        if resume:
            ckpt = latest_checkpoint(self.out)
            if ckpt is None:
                raise FileNotFoundError(f"--resume: no checkpoint under {self.out / 'checkpoints'}")
            self._restore(load_checkpoint(ckpt))
            self.resumed_from = ckpt
        self.logger = MetricsLogger(self.out, tensorboard=recipe.log.tensorboard,
                                    resume_step=self.step if resume else None)
        self._stop_requested = False

    def _engine_kwargs(self) -> dict:
        r = self.r
        if r.rollout.engine == "hf":
            return dict(model=self.model, pad_id=self.tok.pad_id, eos_id=self.tok.eos_id, device=self.device,
                        max_batch_sequences=r.rollout.max_batch_sequences)
        return dict(model=self.model, eos_id=self.tok.eos_id, seed=r.seed, kv_cache_gb=r.rollout.vllm_kv_cache_gb,
                    gpu_memory_utilization=r.rollout.vllm_gpu_memory_utilization,
                    sync_via_disk=r.rollout.vllm_sync_via_disk)

    # ------------------------------------------------------------------ run
    def prepare(self, *, initial_eval: bool = True) -> None:
        """Start weights (init_checkpoint or the supervised warm-up), the first evaluation and
        the reference model. A resumed run has all of these in its checkpoint."""
        r = self.r
        (self.out / "recipe.yaml").write_text(_to_yaml(recipe_to_dict(r)))
        if self.resumed_from is None:
            if r.init_checkpoint:
                self.model.load_state_dict(_load_weights(r.init_checkpoint))
            elif r.warmup.enabled:
                sft_warmup(
                    self.model, self.tok, self.task, r.warmup, device=self.device, seed=r.seed,
                    prompt_template=r.task.prompt_template,
                    evaluate_fn=lambda n: self._evaluate(n),
                    log_fn=lambda rec: self.logger.log({"kind": "warmup", **rec}),
                    progress=r.log.progress,
                )
                torch.save(self.model.state_dict(), self.out / "warmup.pt")
            if initial_eval:
                self._log_eval()
        if r.train.beta > 0 and self.ref_model is None:
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        self._sync_engine()  # warm-up, init_checkpoint or resume changed the weights after the engine started

    def step_once(self) -> dict:
        """One RL step with its bookkeeping; returns the step's metrics record."""
        t0 = time.perf_counter()
        rec = self._rl_step()
        self.elapsed += time.perf_counter() - t0
        self.step += 1
        rec.update(step=self.step, wall=self.elapsed, kind="step")
        return rec

    def run(self) -> dict:
        r = self.r
        self.prepare()
        bar = self._progress()
        interrupted = False
        try:
            with _sigterm_as_interrupt():
                while self.step < r.train.steps and not self._time_up():
                    rec = self.step_once()
                    self.logger.log(rec, self.step)
                    if r.eval.every and self.step % r.eval.every == 0 and self.step < r.train.steps:
                        self._log_eval()
                    if r.log.checkpoint_every and self.step % r.log.checkpoint_every == 0:
                        self._checkpoint()
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix(
                            reward=f"{rec['reward/mean']:.3f}", acc=f"{self._last_acc:.3f}",
                            kept=f"{rec['cppo/kept_ratio']:.2f}", step_s=f"{rec['time/step']:.2f}",
                        )
        except KeyboardInterrupt:
            interrupted = True
        finally:
            if bar is not None:
                bar.close()
        if interrupted:
            path = self._checkpoint()
            self.logger.close()
            write_report(self.out, f"{self.out.name} (interrupted at step {self.step})", plots=r.log.plots)
            print(f"\ninterrupted: checkpoint saved to {path}; continue with --resume")
            return {"interrupted": True, "step": self.step, "checkpoint": str(path)}
        final = self._log_eval()
        self._checkpoint()
        self.logger.close()
        summary = write_report(self.out, f"{self.out.name}: {r.cppo.describe()}", plots=r.log.plots)
        summary["final_eval"] = final
        return summary

    def _time_up(self) -> bool:
        return bool(self.r.train.max_time_s) and self.elapsed >= self.r.train.max_time_s

    # ------------------------------------------------------------------ one step
    def _rl_step(self) -> dict:
        r = self.r
        G = r.rollout.group_size
        times = {p: 0.0 for p in ("rollout", "reward", "cppo", "old_logprob", "ref_logprob", "update", "sync")}
        t_step = time.perf_counter()
        params = SamplingParams(n=G, temperature=r.rollout.temperature, top_p=r.rollout.top_p,
                                max_new_tokens=r.rollout.max_new_tokens, logprobs=self._want_sampler_logprobs())

        # rollout + reward, with dynamic-sampling refill rounds when enabled
        prompts: list[list[int]] = []
        completions: list[list[int]] = []
        sampler_lp: list[torch.Tensor] = []
        rewards: list[float] = []
        correct: list[float] = []
        formatted: list[float] = []
        valid_groups: list[int] = []  # indices (in draw order) of groups that go to selection
        dropped_prompts = 0
        rollout_metrics: dict = {}
        to_draw = self.planner.begin_step()
        rounds = 0
        while to_draw > 0:
            with _timed(times, "rollout", self.device):
                ids = self.sampler.draw(to_draw)
                problems = [self.task.train[i] for i in ids]
                p_ids = [self.tok.prompt_ids(r.task.prompt_template.format(question=p.question)) for p in problems]
                out = self.engine.generate(p_ids, self._round_params(params, rounds))
                rounds += 1
                self.planner.record_round(len(ids), len(out.tokens))
                rollout_metrics = out.metrics()
            with _timed(times, "reward", self.device):
                base = len(prompts) // G if prompts else 0
                for j, toks in enumerate(out.tokens):
                    p = problems[j // G]
                    s = self.task.score(self.tok.decode(toks), p)
                    rewards.append(combine_reward(s, r.task.reward.correct, r.task.reward.format))
                    correct.append(s.correct)
                    formatted.append(s.formatted)
                    prompts.append(p_ids[j // G])
                    completions.append(toks)
                    if out.logprobs is not None:
                        sampler_lp.append(out.logprobs[j])
                for g in range(len(ids)):
                    group = rewards[(base + g) * G : (base + g + 1) * G]
                    if r.cppo.dynamic_sampling and max(group) == min(group):
                        dropped_prompts += 1
                    else:
                        valid_groups.append(base + g)
                to_draw = self.planner.next_refill(len(valid_groups))
                if to_draw == 0 and self.planner.adaptive and valid_groups:
                    # keep_mass: survivors per prompt vary; draw until they fill the capacity
                    to_draw = self.planner.next_fill(self._num_kept(rewards, valid_groups, G))

        with _timed(times, "cppo", self.device):
            rows = torch.tensor([g * G + j for g in valid_groups for j in range(G)], dtype=torch.long)
            if rows.numel() == 0:
                raise RuntimeError(
                    "every group was dropped for zero reward variance; raise cppo.max_refill_rounds or "
                    "disable cppo.dynamic_sampling"
                )
            reward_t = torch.tensor(rewards, dtype=torch.float32)
            group_ids = torch.arange(len(rewards)) // G
            res = prune(reward_t[rows], group_ids[rows], r.cppo, step=self.step)
            alloc = self.planner.end_step(res.selection, dropped_prompts=dropped_prompts,
                                          dropped_completions=dropped_prompts * G)
            kept_rows = rows[res.selection.kept].tolist()
            if not kept_rows:  # keep_mass: every group had equal rewards
                raise RuntimeError(
                    "no completion survived (every group had equal rewards under cppo.keep_mass); enable "
                    "cppo.allocation so the planner draws more prompts, or cppo.dynamic_sampling"
                )
            batch = KeptBatch([prompts[i] for i in kept_rows], [completions[i] for i in kept_rows])
            mbs = micro_batches(batch, r.train.micro_batch_tokens)
            advantages = res.kept_advantages
            weighting = {}
            if res.selection.weighted:
                # importance: 1/pi weights and the full batch's denominators (unbiased HT loss)
                weighting = dict(weights=res.selection.weights, num_seqs=float(rows.numel()),
                                 num_tokens=float(sum(len(completions[i]) for i in rows.tolist())))

        old = ref = None
        if r.train.mu > 1:
            with _timed(times, "old_logprob", self.device):
                old = self.policy.logprobs(batch, mbs, counter="old_logprob")
        if r.train.beta > 0:
            with _timed(times, "ref_logprob", self.device):
                ref = self.policy.logprobs(batch, mbs, counter="ref_logprob", model=self.ref_model)
        with _timed(times, "update", self.device):
            train_metrics = self.policy.update(batch, mbs, advantages, old, ref,
                                               norm_constant=float(r.rollout.max_new_tokens), **weighting)
        with _timed(times, "sync", self.device):
            self._sync_engine()

        rec: dict = {f"time/{k}": v for k, v in times.items()}
        rec["time/step"] = time.perf_counter() - t_step
        rec["reward/mean"] = sum(rewards) / len(rewards)
        rec["reward/correct_rate"] = sum(correct) / len(correct)
        rec["reward/format_rate"] = sum(formatted) / len(formatted)
        rec["reward/mean_kept"] = float(reward_t[rows][res.selection.kept].mean())
        rec.update(res.metrics())
        rec.update(alloc)
        rec.update(self.planner.metrics())
        rec.update(rollout_metrics)
        rec.update(train_metrics)
        rec["train/micro_batches"] = float(len(mbs))
        if sampler_lp:
            # behaviour-policy log-probs: the old-policy pass (mu > 1) or the first update pass
            trainer_lp = old if old is not None else self.policy.first_pass_logprobs
            rec.update(self._logprob_diff(batch, [sampler_lp[i] for i in kept_rows], trainer_lp))
        rec["data/epoch"] = self.sampler.epochs_float
        rec["sys/peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        return rec

    def _num_kept(self, rewards: list[float], valid_groups: list[int], G: int) -> int:
        """Survivors of a selection over the valid groups drawn so far (keep_mass fill rounds)."""
        rows = torch.tensor([g * G + j for g in valid_groups for j in range(G)], dtype=torch.long)
        reward_t = torch.tensor(rewards, dtype=torch.float32)[rows]
        return prune(reward_t, rows // G, self.r.cppo, step=self.step).selection.num_kept

    def _round_params(self, params: SamplingParams, round_: int) -> SamplingParams:
        """vLLM samples from a seed per (run seed, step, refill round): a resumed run draws
        what the uninterrupted run would have, with no engine RNG in the checkpoint. The HF
        engine keeps drawing from the global torch RNG, which the checkpoint carries."""
        if self.r.rollout.engine == "hf":
            return params
        return dataclasses.replace(params, seed=mix_seed(self.r.seed, self.step, round_))

    def _want_sampler_logprobs(self) -> bool:
        return self.r.rollout.engine != "hf"

    def _logprob_diff(self, batch: KeptBatch, sampler_lp: list[torch.Tensor], old: torch.Tensor) -> dict:
        """Mean |engine log-prob - trainer log-prob| over the kept tokens, with the weights
        the completions were sampled with (old-policy pass when mu > 1, else the first
        update pass, which runs before any optimizer step)."""
        if old is None or old.shape != (len(batch), batch.max_completion):
            raise ValueError(f"logprob_diff: trainer log-probs of shape {None if old is None else tuple(old.shape)} "
                             f"for a kept batch of {len(batch)} x {batch.max_completion}")
        mask = batch.completion_mask()
        eng = torch.zeros_like(old)
        for i, lp in enumerate(sampler_lp):
            if lp.numel() != len(batch.completions[i]):
                raise ValueError(f"logprob_diff: {lp.numel()} sampler log-probs for completion {i} of "
                                 f"{len(batch.completions[i])} tokens")
            eng[i, : lp.numel()] = lp
        absdiff = (eng - old).abs() * mask
        diff = float(absdiff.sum() / mask.sum())
        if diff > self.r.rollout.logprob_warn_threshold:
            warnings.warn(f"rollout/logprob_diff={diff:.4f} exceeds {self.r.rollout.logprob_warn_threshold}: "
                          "the rollout engine and the trainer disagree", stacklevel=2)
        return {"rollout/logprob_diff": diff, "rollout/logprob_diff_max": float(absdiff.max())}

    # ------------------------------------------------------------------ eval, checkpoints
    _last_acc = 0.0

    def _sync_engine(self) -> None:
        """Policy weights to the rollout engine (a no-op for the HF engine, which shares them)."""
        self.engine.update_weights(self.model.state_dict().items())

    def _evaluate(self, n: int) -> dict:
        self._sync_engine()  # during the warm-up the weights move without an RL update
        problems = list(self.task.test[: min(n, len(self.task.test))])
        return evaluate(self.engine, self.tok, self.task, problems, self.r.rollout.max_new_tokens,
                        self.r.task.prompt_template)

    def _log_eval(self) -> dict:
        m = self._evaluate(self.r.eval.num_problems)
        self._last_acc = m["eval/accuracy"]
        self.logger.log({"kind": "eval", "step": self.step, "wall": self.elapsed, **m}, self.step)
        return m

    def _checkpoint(self) -> Path:
        payload = {
            "model": self.model.state_dict(),
            "policy": self.policy.state_dict(),
            "ref_model": self.ref_model.state_dict() if self.ref_model is not None else None,
            "sampler": self.sampler.state_dict(),
            "planner": self.planner.state_dict(),
            "elapsed": self.elapsed,
            "last_acc": self._last_acc,
            "recipe": recipe_to_dict(self.r),
        }
        return save_checkpoint(self.out, self.step, payload)

    def _restore(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.policy.load_state_dict(state["policy"])
        if state.get("ref_model") is not None:
            self.ref_model = copy.deepcopy(self.model)
            self.ref_model.load_state_dict(state["ref_model"])
            self.ref_model.eval().requires_grad_(False)
        self.sampler.load_state_dict(state["sampler"])
        self.planner.load_state_dict(state["planner"])
        self.step = state["step"]
        self.elapsed = state["elapsed"]
        self._last_acc = state.get("last_acc", 0.0)
        set_rng_state(state["rng"])

    def _progress(self):
        if not self.r.log.progress:
            return None
        try:
            from tqdm.auto import tqdm
        except ImportError:
            return None
        return tqdm(total=self.r.train.steps, initial=self.step, desc="RL", dynamic_ncols=True)


@contextmanager
def _timed(times: dict, phase: str, device: torch.device):
    t0 = time.perf_counter()
    try:
        yield
    finally:
        if device.type == "cuda":
            torch.cuda.synchronize()
        times[phase] += time.perf_counter() - t0


@contextmanager
def _sigterm_as_interrupt():
    """SIGTERM (a scheduler stopping the job) saves a checkpoint like Ctrl-C does."""
    def handler(signum, frame):
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _load_weights(path: str) -> dict:
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"init_checkpoint {path} does not exist")
    state = torch.load(p, map_location="cpu", weights_only=False)
    return state["model"] if isinstance(state, dict) and "model" in state else state


def _to_yaml(d: dict) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.create(d))
