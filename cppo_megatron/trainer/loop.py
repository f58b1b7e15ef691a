"""The embedded GRPO/CPPO trainer: one step pipeline over two policy backends.

A step, each phase timed (``time/<phase>`` in metrics.jsonl, ``metrics.PHASES``):

    rollout      G completions for each drawn prompt (HF generate or vLLM)
    reward       the task's verifiable reward (correctness + format)
    cppo         full-group advantages -> survivors -> allocation accounting -> placement
                 of the survivors on the ranks that train them
    old_logprob  behaviour-policy log-probs of the survivors (hf: only when mu > 1)
    ref_logprob  reference log-probs of the survivors (only when beta > 0)
    update       mu optimizer steps on the survivors
    sync         weights to the rollout engine (free when it shares the policy)

``backend: hf`` runs it in one process (``HFBackend``, ``LocalRollout``); ``backend:
megatron`` on every rank of a torchrun job (``MegatronBackend``, ``ModelParallelRollout``;
``cppo-megatron train RECIPE --nproc N``). With ``cppo.pruning_rate: 0`` every completion
survives: plain GRPO through the same code.

Signals (``interrupts.py``): SIGINT / SIGTERM during a step let the step finish (every rank
agrees at the step boundary), then write a checkpoint and the report and return
``interrupted`` (the CLI exits 130). A further signal more than ``REPEAT_WINDOW_S`` later
abandons the step: with the hf backend, before the update the step's drawn prompts are put
back (sampler, planner and RNG as at the step's start) and the checkpoint is written;
during the update no checkpoint is written (resume continues from the previous one).

Elsewhere: the step record (``record.step_record``), checkpoints and resume
(``checkpoint``), the phases before the passes (``step``), the backends (``backends/``),
selective rollout (``selective``: ``cppo.selective.enabled`` skips prompts before the rollout).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch

from ..core import AllocationPlanner, PromptSampler
from ..rollout import build_engine
from ..rollout.base import RolloutEngine
from ..tasks import Task, build_task
from . import faults
from .backends import HFBackend, PolicyBackend
from .checkpoint import checkpoints, filesystem_peers, find_checkpoint, rng_state, save_checkpoint, set_rng_state
from .config import Recipe, recipe_to_dict
from .distribution import LocalRollout, ModelParallelRollout
from .early_stop import STATE_KEY as EARLY_STOP_STATE_KEY
from .early_stop import EarlyStopping
from .evaluate import evaluate
from .interrupts import INTERRUPTED_MARKER, REPEAT_WINDOW_S, StopRequest
from .logger import MetricsLogger
from .models import build_model, resolve_device
from .record import step_record
from .report import write_report
from .selective import STATE_KEY as SELECTIVE_STATE_KEY
from .selective import SelectiveRollout
from .sft import sft_warmup
from .step import PhaseTimer, collect_groups, select_survivors
from .two_wave import STATE_KEY as TWO_WAVE_STATE_KEY
from .two_wave import TwoWaves

__all__ = ["INTERRUPTED_MARKER", "REPEAT_WINDOW_S", "Trainer", "load_weights"]

_StopRequest = StopRequest  # the name this module used before interrupts.py held it


class Trainer:
    """One process (``backend: hf``) or one torchrun rank (``backend: megatron``) of a GRPO/CPPO
    run: a recipe in, a trained policy, ``metrics.jsonl``, checkpoints and a report in
    ``recipe.out_dir`` out.

    ``run()`` = ``prepare()`` (warm-up or ``init_checkpoint``, first evaluation, reference
    model), then ``step_once()`` until ``train.steps`` or ``train.max_time_s``, evaluations
    every ``eval.every`` steps, checkpoints every ``log.checkpoint_every``; returns the
    summary (``accuracy_before``, ``accuracy_after``, ``steps``, ``rl_wall_s``, ...).
    ``cppo-megatron train`` checks the recipe's inputs first (``trainer.preflight``).

    Example (2 RL steps of a tiny model on the CPU: about 8 s of CPU time here)::

        from cppo_megatron.trainer import Trainer
        from cppo_megatron.trainer.config import load_recipe

        recipe = load_recipe(None, [  # the schema's defaults, shrunk to a 2-step run
            "out_dir=/tmp/cppo-trainer-example", "model.hidden_size=32", "model.num_layers=2",
            "model.num_heads=2", "model.num_kv_heads=2", "model.intermediate_size=64",
            "task.train_size=400", "task.test_size=50", "rollout.group_size=4", "train.capacity=16",
            "train.steps=2", "eval.num_problems=20", "warmup.enabled=false", "log.progress=false",
        ])
        summary = Trainer(recipe).run()
        print(summary["steps"], summary["accuracy_before"], summary["accuracy_after"])

    Args:
        recipe: a validated ``Recipe`` (``load_recipe``).
        resume: continue from the newest readable checkpoint in ``out_dir`` (same data order,
            RNG and prompt accounting).
        task: replaces the recipe's task (bring your own problems and scorer).
    """

    def __init__(self, recipe: Recipe, *, resume: bool = False, task: Task | None = None) -> None:
        self.r = recipe
        self.out = Path(recipe.out_dir)
        self.distributed = recipe.backend == "megatron"
        self._setup_threads()
        torch.manual_seed(recipe.seed)
        self.device = self._device()
        self._setup_model(task)
        self._setup_rollout()
        self._setup_data()
        # megatron shards are built in prepare(), from the warmed-up weights
        self.policy: PolicyBackend | None = None if self.distributed else HFBackend(
            self.model, device=self.device, pad_id=self.tok.pad_id, recipe=recipe)
        self._setup_run_state()
        if self.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
        if resume:
            self._resume()
        self.logger = MetricsLogger(self.out, tensorboard=recipe.log.tensorboard,
                                    resume_step=self.step if resume else None) if self.is_main else None

    # ------------------------------------------------------------------ setup steps (in __init__'s order)
    def _setup_threads(self) -> None:
        """torch threads: under torchrun rank 0 warms up and evaluates with every thread of the
        machine (``main_threads``) while the passes split them (``rank_threads``)."""
        import torch.distributed as dist

        r = self.r
        if self.distributed and not dist.is_initialized():
            raise ValueError(f"backend={r.backend!r} runs under torchrun: `cppo-megatron train RECIPE --nproc N` "
                             "(docs/integrations/megatron.md)")
        if self.distributed:
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
            self.main_threads = r.threads or os.cpu_count() or 1
            self.rank_threads = max(1, self.main_threads // local_world)
            torch.set_num_threads(self.rank_threads)
        else:
            if r.threads:
                torch.set_num_threads(r.threads)
            self.main_threads = self.rank_threads = torch.get_num_threads()

    def _setup_model(self, task: Task | None) -> None:
        """The task (the recipe's, or ``task``) and the policy model with its tokenizer, on the device."""
        self.task = task if task is not None else build_task(self.r.task)
        self.model, self.tok = build_model(self.r.model, self.task.alphabet, self.r.seed)
        self.model.to(self.device)

    def _setup_rollout(self) -> None:
        """The rollout (its engine; which rank is the main one), and (``cppo.early_stop.enabled``)
        the early stopping it runs (trainer/early_stop.py) or (``cppo.two_wave.enabled``) its two
        waves (trainer/two_wave.py)."""
        r = self.r
        self.early_stop = EarlyStopping(r.cppo, group_size=r.rollout.group_size,
                                        max_new_tokens=r.rollout.max_new_tokens,
                                        audit_path=self.out / "early_stop.jsonl") \
            if r.cppo.early_stop.enabled else None
        self.two_wave = TwoWaves(r.cppo, group_size=r.rollout.group_size, audit_path=self.out / "two_wave.jsonl") \
            if r.cppo.two_wave.enabled else None
        self.rollout = self._build_rollout()
        self.engine = self.rollout.engine
        self.is_main = self.rollout.is_main

    def _setup_data(self) -> None:
        """Prompt sampler, allocation planner and (``cppo.selective.enabled``) selective rollout."""
        r, G = self.r, self.r.rollout.group_size
        self.planner = AllocationPlanner.from_config(r.cppo, capacity=r.train.capacity, group_size=G)
        self.sampler = PromptSampler(len(self.task.train), seed=r.seed)
        # skip prompts before generation (GRESO; trainer/selective.py); its warnings on the main rank only
        self.selective = SelectiveRollout(
            r.cppo, group_size=G, num_prompts=len(self.task.train),
            **({} if self.is_main else {"warn": None})) if r.cppo.selective.enabled else None

    def _setup_run_state(self) -> None:
        """What a run carries from step to step (and a checkpoint restores)."""
        self.step = 0
        self.elapsed = 0.0  # RL wall time, carried across resumes
        self.phase = "setup"  # the step phase running now (interrupts, failure messages)
        self._last_acc = 0.0
        self._rl_started = False
        self._open_step: tuple | None = None  # (sampler, planner, rng, selective) as the running step began
        self.resumed_from: Path | None = None
        self._fs_peers: list[int] | None = None  # ranks sharing this rank's out_dir (first checkpoint)
        self._resume_policy: dict | None = None

    @property
    def main_logger(self) -> MetricsLogger:
        """The metrics logger: the main rank's (the other ranks have none, ``logger`` is None)."""
        if self.logger is None:
            raise RuntimeError("only the main rank logs metrics: this rank has no logger")
        return self.logger

    @property
    def backend(self) -> PolicyBackend:
        """The policy backend: HF from the start, Megatron's shards once ``prepare()`` built them."""
        if self.policy is None:
            raise RuntimeError("the Megatron policy is built by Trainer.prepare(): call it first")
        return self.policy

    # ------------------------------------------------------------------ construction
    def _device(self) -> torch.device:
        if not self.distributed:
            return resolve_device(self.r.device)
        if torch.cuda.is_available():  # pragma: no cover - CUDA only; the launcher hides CUDA for device=cpu
            dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(dev)
            return dev
        return torch.device("cpu")

    def _build_rollout(self):
        r = self.r
        if not self.distributed:
            return LocalRollout(build_engine(r.rollout.engine, **self._engine_kwargs()), self.task, self.tok, r,
                                early_stop=self.early_stop, two_wave=self.two_wave)
        if self.early_stop is not None:
            raise ValueError("cppo.early_stop runs with backend=hf (one process); backend=megatron does not support "
                             "it yet: set cppo.early_stop.enabled=false or backend=hf")
        if self.two_wave is not None:
            raise ValueError("cppo.two_wave runs with backend=hf (one process); backend=megatron does not support "
                             "it yet: set cppo.two_wave.enabled=false or backend=hf")
        from ..rollout import HFEngine

        # the HF copy holds the current policy (final.pt, warm-up) and generates when engine=hf
        hf_engine = HFEngine(self.model, pad_id=self.tok.pad_id, eos_id=self.tok.eos_id, device=self.device,
                             max_batch_sequences=r.rollout.max_batch_sequences, shared=False)
        engine: RolloutEngine = hf_engine
        if r.rollout.engine == "vllm":
            from ..rollout.vllm import VLLMEngine

            # built by every rank at this same point: vLLM creates its groups collectively
            engine = VLLMEngine(self.model, eos_id=self.tok.eos_id, seed=r.seed, kv_cache_gb=r.rollout.vllm_kv_cache_gb,
                                gpu_memory_utilization=r.rollout.vllm_gpu_memory_utilization,
                                sync_via_disk=r.rollout.vllm_sync_via_disk, join_process_group=True,
                                tensor_parallel_size=r.rollout.vllm_tp)
        return ModelParallelRollout(hf_engine, engine, self.task, self.tok, r, self.device)

    def _engine_kwargs(self) -> dict:
        r = self.r
        if r.rollout.engine == "hf":
            return dict(model=self.model, pad_id=self.tok.pad_id, eos_id=self.tok.eos_id, device=self.device,
                        max_batch_sequences=r.rollout.max_batch_sequences)
        return dict(model=self.model, eos_id=self.tok.eos_id, seed=r.seed, kv_cache_gb=r.rollout.vllm_kv_cache_gb,
                    gpu_memory_utilization=r.rollout.vllm_gpu_memory_utilization,
                    sync_via_disk=r.rollout.vllm_sync_via_disk)

    def _comm_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    def _build_policy(self) -> None:
        if self.policy is not None:
            return
        from .backends.megatron import MegatronBackend

        weights = {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
        self.policy = policy = MegatronBackend(self.r, self.model.config, weights, comm_device=self._comm_device())
        del weights
        self.rollout.attach(dp_group=policy.dp_group, mp_group=policy.mp_group, tp_group=policy.tp_group)
        if self.rollout.hf_engine is None:  # no HF generation or evaluation here: the shards are all it needs
            self.model = None
            self.engine = self.rollout.engine

    # ------------------------------------------------------------------ run
    def prepare(self, *, initial_eval: bool = True) -> None:
        """Start weights (init_checkpoint, or the supervised warm-up on the main rank,
        broadcast to all), the first evaluation, the policy backend and its reference. A
        resumed run has all of these in its checkpoint."""
        r = self.r
        if self.is_main:
            (self.out / "recipe.yaml").write_text(_to_yaml(recipe_to_dict(r)))
        if self.resumed_from is None:
            if r.init_checkpoint:
                self.model.load_state_dict(load_weights(r.init_checkpoint))
            elif r.warmup.enabled:
                if self.is_main:
                    with _threads(self.main_threads, restore=self.rank_threads):
                        sft_warmup(
                            self.model, self.tok, self.task, r.warmup, device=self.device, seed=r.seed,
                            prompt_template=r.task.prompt_template, evaluate_fn=self._evaluate,
                            log_fn=lambda rec: self.main_logger.log({"kind": "warmup", **rec}),
                            progress=r.log.progress,
                        )
                    torch.save(self.model.state_dict(), self.out / "warmup.pt")
                self.rollout.broadcast_module(self.model)
            if initial_eval:
                self._log_eval()
        self._build_policy()
        if self._resume_policy is not None:
            self.backend.load_state_dict(self._resume_policy)
            set_rng_state(self._resume_policy["rng"])  # last: building the shards reseeds torch
            self._resume_policy = None
        self.backend.start()
        self._sync_engine()  # warm-up, init_checkpoint or resume changed the weights after the engine started
        self._rl_started = True

    def step_once(self) -> dict:
        """One RL step with its bookkeeping; returns the step's metrics record."""
        self._open_step = (self.sampler.state_dict(), self.planner.state_dict(), rng_state(),
                           None if self.selective is None else self.selective.state_dict())
        t0 = time.perf_counter()
        rec = self._rl_step()
        self.elapsed += time.perf_counter() - t0
        self.step += 1
        self._open_step = None
        self.phase = "between steps"
        rec.update(step=self.step, wall=self.elapsed, kind="step")
        return rec

    def run(self) -> dict:
        r = self.r
        marker = self.out / INTERRUPTED_MARKER
        if self.is_main and marker.exists():
            marker.unlink()
        self.prepare()
        bar = self._progress()
        stop = StopRequest()
        interrupted = checkpoint_ok = False
        try:
            with stop:
                while self.step < r.train.steps:
                    # one decision for every rank: the slowest rank's wall time, any rank's signal
                    agreed = self.rollout.reduce_max(torch.tensor([self.elapsed, float(stop.requested)],
                                                                  dtype=torch.float64))
                    self.elapsed = float(agreed[0])
                    if agreed[1] > 0:
                        interrupted = checkpoint_ok = True
                        break
                    if self._time_up():
                        break
                    rec = self.step_once()
                    if self.is_main:
                        self.main_logger.log(rec, self.step)
                    if r.eval.every and self.step % r.eval.every == 0 and self.step < r.train.steps:
                        self._log_eval()
                    if r.log.checkpoint_every and self.step % r.log.checkpoint_every == 0:
                        self._checkpoint()
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix(**self._postfix(rec))
        except KeyboardInterrupt:
            interrupted = True
            checkpoint_ok = self._abandon_step()
        finally:
            if bar is not None:
                bar.close()
        if interrupted:
            return self._interrupted(checkpoint_ok)
        final = self._log_eval()
        self._checkpoint()
        summary: dict = {}
        if self.is_main:
            torch.save(self.model.state_dict(), self.out / "final.pt")  # the synced policy, HF layout
            self.main_logger.close()
            summary = write_report(self.out, self._title(), plots=r.log.plots, balance=self.rollout.world > 1)
            summary["final_eval"] = final
        return summary

    def _title(self, suffix: str = "") -> str:
        title = f"{self.out.name}: {self.r.cppo.describe()}"
        if self.distributed:
            m = self.r.megatron
            title += f" (backend megatron, tp={m.tp} pp={m.pp} dp={self.rollout.dp})"
        return title + suffix

    def _interrupted(self, checkpoint_ok: bool) -> dict:
        path = self._checkpoint() if checkpoint_ok else None
        marker = self.out / INTERRUPTED_MARKER  # tells the torchrun launcher to exit 130
        if self.is_main:
            self.main_logger.close()
            write_report(self.out, self._title(f" (interrupted at step {self.step})"), plots=self.r.log.plots,
                         balance=self.rollout.world > 1)
            marker.write_text(json.dumps({"step": self.step, "checkpoint": None if path is None else str(path)}) + "\n")
            if path is not None:
                print(f"\ninterrupted: checkpoint saved to {path}; continue with --resume", file=sys.stderr)
            else:
                last = checkpoints(self.out)
                print(f"\ninterrupted during the {self.phase} of step {self.step + 1}: the weights had started to "
                      f"change, so no checkpoint was written; --resume continues from "
                      f"{last[0] if last else 'the start (no checkpoint yet)'}", file=sys.stderr)
        return {"interrupted": True, "step": self.step, "checkpoint": None if path is None else str(path)}

    def _abandon_step(self) -> bool:
        """After a KeyboardInterrupt inside a step: put the step's drawn prompts back (as if
        never drawn) when the weights have not changed yet. True when a checkpoint of the
        current state is consistent."""
        if self._open_step is None:
            return True
        if self.distributed or self.phase in ("update", "sync", "metrics"):
            return False  # weights moved (or peers are inside a collective): keep the last checkpoint
        sampler, planner, rng, selective = self._open_step
        self.sampler.load_state_dict(sampler)
        self.planner.load_state_dict(planner)
        set_rng_state(rng)
        if self.selective is not None:  # the step may have recorded its groups already
            self.selective.load_state_dict(selective)
        self._open_step = None
        return True

    def _time_up(self) -> bool:
        return bool(self.r.train.max_time_s) and self.elapsed >= self.r.train.max_time_s

    # ------------------------------------------------------------------ one step
    def _enter_phase(self, phase: str) -> None:
        self.phase = phase
        faults.maybe_inject(phase, self.step + 1, self.rollout.rank)

    def _rl_step(self) -> dict:
        r = self.r
        timer = PhaseTimer(self.device, on_enter=self._enter_phase)
        t_step = time.perf_counter()
        draw = None
        if self.selective is not None:
            self.selective.begin_step(self.step, self.sampler)
            draw = self._selective_draw
        if self.early_stop is not None:
            self.early_stop.begin_step(self.step)
        if self.two_wave is not None:
            self.two_wave.begin_step(self.step)
        batch = collect_groups(self.rollout, self.planner, self.sampler, group_size=r.rollout.group_size,
                               dynamic_sampling=r.cppo.dynamic_sampling, step=self.step, timer=timer,
                               cppo_cfg=r.cppo, draw=draw)
        with timer.phase("cppo"):
            selective = {} if self.selective is None else self.selective.end_step(
                batch.prompt_ids, batch.rewards, batch.correct, batch.completion_lengths)
            if self.selective is not None and self.rollout.world > 1:
                self._check_selective_agrees()
            # cppo.early_stop: the stopped rows' expected rewards, for the group statistics
            extra = {} if self.early_stop is None else {"moments": self.early_stop.moments()}
            surv = select_survivors(batch, r.cppo, self.planner, step=self.step, **extra)
            rows = self.backend.place(batch, surv.kept, surv.advantages)
            if surv.full_denominators is not None:  # importance: the weights travel with the placed rows
                assert surv.weights is not None  # select_survivors sets the weights of every row
                rows = dataclasses.replace(rows, weights=surv.weights[rows.rows],
                                           full_denominators=surv.full_denominators)
        old = ref = None
        if self.backend.needs_old_logprobs(r.train.mu):
            with timer.phase("old_logprob"):
                old = self.backend.logprobs(rows)
        if r.train.beta > 0:
            with timer.phase("ref_logprob"):
                ref = self.backend.logprobs(rows, reference=True)
        with timer.phase("update"):
            upd = self.backend.update(rows, old, ref, step=self.step)
        with timer.phase("sync"):
            self._sync_engine()
        self.phase = "metrics"
        rec = step_record(r, self.rollout, self.planner, self.sampler, batch, surv, rows, old, ref, upd,
                          timer.seconds, t_step)
        rec.update(selective)
        if self.two_wave is not None:
            rec.update(self.two_wave.end_step(batch, surv.kept))
        if self.early_stop is not None:  # last: it refits the predictor on this step's rewards
            rec.update(self.early_stop.end_step(batch, surv.kept))
        return rec

    def _check_selective_agrees(self) -> None:
        """Every rank must hold the same history (same draws, same global rewards): a
        divergence would make ranks generate different prompts, so stop at once."""
        assert self.selective is not None
        digests = self.rollout.gather(self.selective.fingerprint())
        if len(set(digests)) > 1:
            raise RuntimeError(f"step {self.step + 1}: the selective-rollout history differs between ranks "
                               f"(digests by rank: {digests}); the ranks drew or recorded different prompts")

    def _selective_draw(self, n: int) -> list[int]:
        assert self.selective is not None  # only passed to collect_groups with selective rollout on
        return self.selective.draw(self.sampler, n)

    # ------------------------------------------------------------------ eval, sync, checkpoints
    def _sync_engine(self) -> None:
        """Policy weights to the rollout engine(s) (a no-op for the HF engine of ``backend:
        hf``, which shares them; a collective under ``backend: megatron``). Both callers (``prepare``,
        after it built the policy, and the step) run with the policy built."""
        if self.distributed:  # full HF tensors only where an engine takes them
            self.rollout.sync(self.backend.export_weights(self.rollout.weight_ranks))
        else:
            self.rollout.sync(self.backend.export_weights())

    def _evaluate(self, n: int) -> dict:
        engine = self.rollout.eval_engine
        if not self._rl_started and engine is not getattr(self.rollout, "hf_engine", None):
            engine.update_weights(self.model.state_dict().items())  # the warm-up moved the weights
        problems = list(self.task.test[: min(n, len(self.task.test))])
        return evaluate(engine, self.tok, self.task, problems, self.r.rollout.max_new_tokens,
                        self.r.task.prompt_template)

    def _log_eval(self) -> dict | None:
        """Greedy held-out accuracy on the main rank (the others wait at a barrier)."""
        m = None
        if self.is_main:
            with _threads(self.main_threads, restore=self.rank_threads):
                m = self._evaluate(self.r.eval.num_problems)
            self._last_acc = m["eval/accuracy"]
            self.main_logger.log({"kind": "eval", "step": self.step, "wall": self.elapsed, **m}, self.step)
        self.rollout.barrier(slow=True)
        return m

    def _checkpoint(self) -> Path:
        state = None
        if self.is_main:
            state = {"sampler": self.sampler.state_dict(), "planner": self.planner.state_dict(),
                     "elapsed": self.elapsed, "last_acc": self._last_acc, "recipe": recipe_to_dict(self.r)}
            if self.selective is not None:
                state[SELECTIVE_STATE_KEY] = self.selective.state_dict()
            if self.early_stop is not None:
                state[EARLY_STOP_STATE_KEY] = self.early_stop.state_dict()
            if self.two_wave is not None:
                state[TWO_WAVE_STATE_KEY] = self.two_wave.state_dict()
        # the slow group: writing a large shard may take longer than a collective may wait
        barrier = lambda: self.rollout.barrier(slow=True)  # noqa: E731
        if self._fs_peers is None:  # which ranks write into the same directory (local disks per node)
            self._fs_peers = filesystem_peers(self.out, self.rollout.rank, gather=self.rollout.gather, barrier=barrier)
        if self.rollout.world > 1 and len(self._fs_peers) < self.rollout.world:
            state = self.rollout.gather(state)[0]  # each filesystem gets rank 0's trainer.pt
        return save_checkpoint(self.out, self.step, state, self.backend.state_dict(), rank=self.rollout.rank,
                               barrier=barrier, peers=self._fs_peers)

    def _resume(self) -> None:
        """The newest checkpoint every rank can read (``checkpoint.find_checkpoint``: a truncated
        or corrupt one is named and skipped)."""

        def any_rank_failed(failed: bool) -> bool:
            return float(self.rollout.reduce_max(torch.tensor([float(failed)], dtype=torch.float64))[0]) > 0

        def log(line: str) -> None:
            print(line, file=sys.stderr, flush=True)

        path, state, policy = find_checkpoint(self.out, self.rollout.rank, any_rank_failed=any_rank_failed,
                                              log=log if self.is_main else None, gather=self.rollout.gather)
        self.sampler.load_state_dict(state["sampler"])
        self.planner.load_state_dict(state["planner"])
        self.step = state["step"]
        self.elapsed = state["elapsed"]
        self._last_acc = state.get("last_acc", 0.0)
        self.resumed_from = path
        if self.selective is not None:
            if SELECTIVE_STATE_KEY in state:
                self.selective.load_state_dict(state[SELECTIVE_STATE_KEY])
            elif self.is_main:
                r = self.selective.rates
                log(f"--resume: checkpoint {path.name} has no selective-rollout state (written without "
                    f"cppo.selective.enabled): starting with an empty prompt history and p_easy={r.p_easy:g}, "
                    f"p_hard={r.p_hard:g}")
        if self.early_stop is not None:
            if EARLY_STOP_STATE_KEY in state:
                self.early_stop.load_state_dict(state[EARLY_STOP_STATE_KEY])
            else:  # backend=hf only (the recipe refuses early stopping on megatron): this is the main rank
                log(f"--resume: checkpoint {path.name} has no early-stopping state (written without "
                    "cppo.early_stop): the predictor starts untrained and stops nothing until it has "
                    f"{self.r.cppo.early_stop.min_examples} finished completions of each outcome")
        if self.two_wave is not None:
            if TWO_WAVE_STATE_KEY in state:
                self.two_wave.load_state_dict(state[TWO_WAVE_STATE_KEY])
            else:  # backend=hf only: this is the main rank
                log(f"--resume: checkpoint {path.name} has no two-wave state (written without cppo.two_wave): "
                    "the two_wave/total_* metrics count from this step")
        if self.policy is not None:  # hf: now; megatron: once prepare() built the shards
            self.policy.load_state_dict(policy)
            set_rng_state(policy["rng"])
        else:
            self._resume_policy = policy

    # ------------------------------------------------------------------ progress
    def _postfix(self, rec: dict) -> dict:
        out = dict(reward=f"{rec['reward/mean']:.3f}", acc=f"{self._last_acc:.3f}",
                   kept=f"{rec['cppo/kept_ratio']:.2f}", step_s=f"{rec['time/step']:.2f}")
        if self.rollout.world > 1:
            out["imbalance"] = f"{rec['cppo/exchange_imbalance']:.3f}"
        return out

    def _progress(self):
        if not self.r.log.progress or not self.is_main:
            return None
        from ..progress import progress

        return progress(self.r.train.steps, "RL", initial=self.step)

    def close(self) -> None:
        self.rollout.close()


class _threads:
    """Temporarily give this process ``n`` torch threads (rank 0 while the others wait)."""

    def __init__(self, n: int, restore: int | None = None) -> None:
        self.n, self.restore = n, restore

    def __enter__(self):
        self.prev = torch.get_num_threads()
        torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        torch.set_num_threads(self.restore or self.prev)


def load_weights(path: str) -> dict:
    """An HF state dict from ``path`` (``warmup.pt``, ``final.pt``, or a file with a ``model`` entry)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"init_checkpoint {path} does not exist")
    state = torch.load(p, map_location="cpu", weights_only=False)
    return state["model"] if isinstance(state, dict) and "model" in state else state


def _to_yaml(d: dict) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.create(d))

