"""Where a step's completions are generated, and the few collectives the loop needs.

Two strategies with one interface (``round``, ``sync``, ``gather``, ``reduce_dp``,
``reduce_max``, ``broadcast_module``, ``barrier``):

- ``LocalRollout``: one process generates, scores and trains every row (``backend: hf``).
  HF ``generate`` draws from the global torch RNG (checkpointed); vLLM from a seed per
  (run seed, step, refill round).
- ``ModelParallelRollout``: one process per rank under torchrun (``backend: megatron``).
  DP rank d takes the d-th contiguous slice of the prompts; the first rank of its
  model-parallel (TP x PP) group generates and scores them (seed per step, DP rank and
  round) and broadcasts the rows to its TP/PP peers, which must feed Megatron identical
  rows; rewards and lengths of all DP ranks are all-gathered, so every rank holds the
  same global view of the step. With ``rollout.engine: vllm`` and ``rollout.vllm_tp > 1``
  the first ``vllm_tp`` ranks of the group generate together.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..rollout import SamplingParams, mix_seed
from .step import PhaseTimer, RoundRows, score_completions

__all__ = ["LocalRollout", "ModelParallelRollout"]


class _Rollout:
    """Generation and scoring of a slice of prompts (what both strategies share)."""

    def __init__(self, engine, task, tok, recipe) -> None:
        self.engine = engine
        self.task, self.tok, self.r = task, tok, recipe

    @property
    def want_logprobs(self) -> bool:
        """Ask the engine for its sampling log-probs (vLLM: checked against the trainer's)."""
        return self.r.rollout.engine != "hf"

    def params(self, seed: int | None, n: int | None = None) -> SamplingParams:
        """Sampling parameters: ``n`` completions per prompt (default G)."""
        ro = self.r.rollout
        return SamplingParams(n=ro.group_size if n is None else n, temperature=ro.temperature, top_p=ro.top_p,
                              max_new_tokens=ro.max_new_tokens, logprobs=self.want_logprobs, seed=seed)

    def generate(self, problems: list, seed: int | None, timer: PhaseTimer, monitor=None, n: int | None = None) -> dict:
        """This rank's rows for ``problems``: prompts, completions, rewards (timed), ``n`` per prompt
        (default G; ``cppo.two_wave`` asks for each wave's). ``monitor``: the round's early-stopping
        ``StopMonitor``; the completions it stopped are not scored."""
        G = self.r.rollout.group_size if n is None else n
        empty: dict[str, Any] = dict(prompts=[], completions=[], rewards=[], correct=[], formatted=[], truncated=[],
                     logprobs=[] if self.want_logprobs else None, seconds=0.0, stopped=None)
        if not problems:
            return empty
        with timer.phase("rollout"):
            t0 = time.perf_counter()
            template = self.r.task.prompt_template
            p_ids = [self.tok.prompt_ids(template.format(question=p.question)) for p in problems]
            out = self.engine.generate(p_ids, self.params(seed, n), **({} if monitor is None else {"monitor": monitor}))
            seconds = time.perf_counter() - t0
        stopped = [r == "stopped" for r in out.finish_reasons]
        with timer.phase("reward"):
            rewards, correct, formatted = score_completions(self.task, self.tok, problems, out.tokens, G,
                                                            self.r.task.reward, skip=stopped)
        return dict(prompts=[p_ids[j // G] for j in range(len(out.tokens))], completions=[list(t) for t in out.tokens],
                    rewards=rewards, correct=correct, formatted=formatted,
                    truncated=[r == "length" for r in out.finish_reasons],
                    logprobs=None if out.logprobs is None else [lp.float() for lp in out.logprobs], seconds=seconds,
                    stopped=stopped if monitor is not None else None)


class LocalRollout(_Rollout):
    """One process: generates, scores and trains every row."""

    rank, world, dp_rank, dp, is_main = 0, 1, 0, 1, True

    def __init__(self, engine, task, tok, recipe, early_stop=None, two_wave=None) -> None:
        super().__init__(engine, task, tok, recipe)
        self.eval_engine = engine
        self.early_stop = early_stop  # trainer.early_stop.EarlyStopping (cppo.early_stop), or None
        self.two_wave = two_wave  # trainer.two_wave.TwoWaves (cppo.two_wave), or None

    def seed(self, step: int, round_: int, wave: int = 0) -> int | None:
        # vLLM: a seed per (run seed, step, round[, second wave]), so a resumed run samples what the
        # uninterrupted one did with no engine state; HF: the checkpointed global RNG
        if self.r.rollout.engine == "hf":
            return None
        return mix_seed(self.r.seed, step, round_) if wave == 0 else mix_seed(self.r.seed, step, round_, wave)

    def round(self, ids: list[int], *, step: int, round_: int, timer: PhaseTimer) -> RoundRows:
        problems = [self.task.train[i] for i in ids]
        if self.two_wave is not None:
            rows = self.two_wave.generate(self, problems, step=step, round_=round_, timer=timer)
        else:
            monitor = None if self.early_stop is None else self.early_stop.monitor(round_, len(ids))
            rows = self.generate(problems, self.seed(step, round_), timer, monitor)
        return _round_rows(rows, [rows], [0], local_start=0)

    def sync(self, weights: dict) -> None:
        """The policy's weights into the engine (a no-op for HF, which shares the model)."""
        self.engine.update_weights(weights.items())

    # single process: every collective is the identity
    def gather(self, obj) -> list:
        return [obj]

    def reduce_dp(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return t

    def reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def broadcast_module(self, module) -> None:
        pass

    def barrier(self, slow: bool = False) -> None:
        pass

    def close(self) -> None:
        self.engine.close()


class ModelParallelRollout(_Rollout):
    """One rank of a torchrun job (``torch.distributed`` initialised)."""

    def __init__(self, hf_engine, engine, task, tok, recipe, device: torch.device) -> None:
        super().__init__(engine, task, tok, recipe)
        if not dist.is_initialized():
            raise RuntimeError("ModelParallelRollout needs torch.distributed: start with "
                               "`cppo-megatron train --nproc N`")
        self.hf_engine = hf_engine
        self.device = device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.is_main = self.rank == 0
        # greedy evaluation runs on rank 0 alone: a vLLM engine sharded over several ranks
        # cannot, so rank 0 evaluates with its HF copy then (greedy outputs are the same)
        self.eval_engine = engine if recipe.rollout.vllm_tp == 1 else hf_engine
        # rank 0 warms up / evaluates while the others wait: those waits get their own
        # group with a long timeout; every other collective fails after the job's timeout
        self.slow_group = dist.new_group(backend="gloo", timeout=timedelta(hours=6))
        self.dp_group = self.mp_group = None
        self.dp_rank, self.dp, self.mp_src, self.generates = 0, 1, self.rank, True
        self.weight_ranks: list[int] | None = None  # known after attach(); None: every rank

    def attach(self, *, dp_group, mp_group, tp_group) -> None:
        """The data- and model-parallel groups, once the policy backend built them."""
        self.dp_group, self.mp_group = dp_group, mp_group
        self.dp_rank, self.dp = dist.get_rank(dp_group), dist.get_world_size(dp_group)
        self.mp_src = min(dist.get_process_group_ranks(mp_group))
        # ranks that call the engine: the model-parallel group's first rank (which broadcasts
        # the completions to its peers) and, with rollout.vllm_tp > 1, the rest of its vLLM TP
        # group (consecutive ranks, which must lie in that rank's Megatron TP group)
        vtp = self.r.rollout.vllm_tp
        self.generates = self.mp_src <= self.rank < self.mp_src + vtp
        if self.generates and not set(range(self.mp_src, self.mp_src + vtp)) <= set(
                dist.get_process_group_ranks(tp_group)):
            raise RuntimeError(f"rollout.vllm_tp={vtp}: vLLM's TP group of ranks "
                               f"{self.mp_src}..{self.mp_src + vtp - 1} is not inside one Megatron TP group; "
                               "use rollout.vllm_tp=1")
        # the HF copy serves HF generation, and on rank 0 evaluation and final.pt: any other rank
        # keeps no HF model, no HF engine and no weight copy, only its Megatron shards. (With vLLM
        # every rank holds a vLLM engine: its external launcher makes every process of the job a
        # vLLM worker, vllm/distributed/parallel_state.py init_distributed_environment; only the
        # generating ranks' engines are synced.)
        if not (self.rank == 0 or (self.generates and self.engine is self.hf_engine)):
            if self.engine is self.hf_engine:
                self.engine = self.eval_engine = None
            self.hf_engine = None
        flags = [None] * self.world
        dist.all_gather_object(flags, self.hf_engine is not None or self.generates)
        self.weight_ranks = [r for r, wants in enumerate(flags) if wants]  # who receives full HF weights

    def seed(self, step: int, round_: int) -> int:
        # one stream per (step, DP rank, round): reproducible and different across DP ranks
        return _mix(self.r.seed, step, self.dp_rank, round_)

    def round(self, ids: list[int], *, step: int, round_: int, timer: PhaseTimer) -> RoundRows:
        lo, hi = _slice(len(ids), self.dp, self.dp_rank)
        t0 = time.perf_counter()
        mine = None
        if self.generates:
            mine = self.generate([self.task.train[i] for i in ids[lo:hi]], self.seed(step, round_), timer)
        box: list[Any] = [mine]  # the generating rank's dict, on every rank after the broadcast
        dist.broadcast_object_list(box, src=self.mp_src, group=self.mp_group)
        mine = box[0]
        if not self.generates:
            timer.add("rollout", time.perf_counter() - t0)  # waiting for this group's generator
            mine = {**mine, "seconds": 0.0}
        with timer.phase("reward"):
            summary = {k: mine[k] for k in ("rewards", "correct", "formatted", "truncated")}
            summary["prompt_lengths"] = [len(p) for p in mine["prompts"]]
            summary["completion_lengths"] = [len(c) for c in mine["completions"]]
            everyone: list = [None] * self.dp
            dist.all_gather_object(everyone, summary, group=self.dp_group)
        G = self.r.rollout.group_size
        return _round_rows(mine, everyone, list(range(self.dp)), local_start=lo * G)

    def sync(self, weights: dict) -> None:
        """Full HF weights into this rank's HF copy (final.pt, evaluation, HF generation) and
        into the vLLM engines that generate (rank 0, which evaluates, is always one)."""
        if self.hf_engine is not None:
            self.hf_engine.update_weights(weights.items())
        if self.engine is not None and self.engine is not self.hf_engine and self.generates:
            self.engine.update_weights(weights.items())

    def gather(self, obj) -> list:
        out: list = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def reduce_dp(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Over the DP group (TP / PP peers hold the same rows)."""
        buf = t.to(self._comm_device())
        dist.all_reduce(buf, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=self.dp_group)
        return buf.cpu()

    def reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        buf = t.to(self._comm_device())
        dist.all_reduce(buf, op=dist.ReduceOp.MAX)
        return buf.cpu()

    def broadcast_module(self, module) -> None:
        """Rank 0's weights of ``module`` to every rank (after the warm-up; slow group)."""
        for v in module.state_dict().values():
            buf = v.detach().cpu().clone()
            dist.broadcast(buf, src=0, group=self.slow_group)
            if self.rank != 0:
                v.copy_(buf.to(v.device))

    def barrier(self, slow: bool = False) -> None:
        dist.barrier(group=self.slow_group if slow else None)

    def _comm_device(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


def _round_rows(mine: dict, everyone: list, owners: list, *, local_start: int) -> RoundRows:
    """``everyone``: the per-row summaries of each DP rank in order (their rows are
    consecutive in draw order); ``mine``: this rank's own rows."""
    def cat(key):
        return [x for part in everyone for x in part[key]]

    def lengths(part, key, src):
        return part[key] if key in part else [len(x) for x in part[src]]

    return RoundRows(
        rewards=cat("rewards"), correct=cat("correct"), formatted=cat("formatted"),
        prompt_lengths=[n for part in everyone for n in lengths(part, "prompt_lengths", "prompts")],
        completion_lengths=[n for part in everyone for n in lengths(part, "completion_lengths", "completions")],
        truncated=cat("truncated"),
        owner=[d for d, part in zip(owners, everyone, strict=True) for _ in part["rewards"]],
        local_start=local_start, prompts=mine["prompts"], completions=mine["completions"],
        logprobs=mine["logprobs"], seconds=mine["seconds"],
        stopped=None if mine.get("stopped") is None else cat("stopped"),
        absent=None if mine.get("absent") is None else cat("absent"),
    )


def _slice(n: int, parts: int, i: int) -> tuple[int, int]:
    """The i-th of ``parts`` contiguous, near-equal slices of range(n)."""
    return n * i // parts, n * (i + 1) // parts


def _mix(*xs: int) -> int:
    # the backend's own seed hash (not rollout.mix_seed): the runs in docs/records/megatron_runs.md
    # were sampled with it and reproduce only with it
    h = 0x9E3779B97F4A7C15
    for x in xs:
        h = (h ^ (int(x) + 0x632BE59BD9B4E019)) * 0xBF58476D1CE4E5B9 % (1 << 63)
    return h

