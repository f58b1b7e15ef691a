"""A Megatron actor (no critic) that runs one CPPO step from rollouts held on each DP rank.

The pieces in ``passes`` and ``distributed`` composed in the order CPPO needs:

    prune + rebalance (all DP ranks)  ->  old log-probs  ->  reference log-probs
    ->  mu policy updates  ->  metrics (pruning, exchange balance, barrier waits, loss)

A pipeline builds one ``MegatronActor`` per process after ``init_process_group`` and calls
``step`` with the rollouts this DP rank produced (or, when it decides the survivors itself,
``logprobs`` and ``update`` on them); ``hf_state_dict`` gives the updated weights for the
rollout engine and ``state_dict`` this rank's shards for a checkpoint. Every method returns
its results; nothing is left on the actor to read afterwards.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..distributed import prune_and_exchange, rank_wait_metrics
from .convert import export_hf_weights, load_hf_weights, unwrap_model
from .cpu_mode import cpu_mode
from .model import build_gpt_model, init_parallel, transformer_config_from_hf
from .optimizer import build_ddp_and_optimizer
from .passes import (
    ForwardCounter,
    PolicyLossConfig,
    UpdateBatch,
    compute_logprobs,
    policy_update,
)

__all__ = ["ActorConfig", "ActorStepResult", "DTYPES", "MegatronActor"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# what a checkpoint shard written before these keys existed was built with
DEFAULT_STATE = {"dtype": "float32", "distributed_optimizer": False}


@dataclass
class ActorConfig:
    """Parallel layout and update settings of a ``MegatronActor``.

    Attributes: tp, pp (model-parallel sizes; dp = world / (tp pp)), lr, weight_decay,
    adam_betas, clip_grad (0 disables), mu (policy updates per batch, the paper's 2),
    max_tokens_per_micro_batch (padded tokens per micro-batch), loss (``PolicyLossConfig``;
    ``kl_coef > 0`` builds a frozen reference model), seed, timeout_minutes (of the
    model-parallel process groups' collectives), dtype (of the policy and reference shards:
    ``float32``, ``bfloat16`` or ``float16``; half precision keeps float32 master weights in the
    optimizer, megatron's ``Float16OptimizerWithFloat16Params``), distributed_optimizer
    (megatron's ``DistributedOptimizer``: master weights and Adam moments sharded over the DP
    ranks instead of held whole by each).
    """

    tp: int = 1
    pp: int = 1
    lr: float = 1e-6
    weight_decay: float = 0.0
    adam_betas: tuple = (0.9, 0.999)
    clip_grad: float = 1.0
    mu: int = 1
    max_tokens_per_micro_batch: int = 4096
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    seed: int = 0
    timeout_minutes: int = 30  # megatron's process groups: a collective waiting longer fails
    dtype: str = "float32"
    distributed_optimizer: bool = False

    def __post_init__(self):
        if isinstance(self.dtype, torch.dtype):
            self.dtype = str(self.dtype).removeprefix("torch.")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if isinstance(self.mu, bool) or not isinstance(self.mu, int) or self.mu < 1:
            raise ValueError(f"mu must be an integer >= 1, got {self.mu!r}")
        if not (self.lr > 0):
            raise ValueError(f"lr must be > 0, got {self.lr!r}")


@dataclass(frozen=True)
class ActorStepResult:
    """What ``MegatronActor.step`` did on this rank.

    Attributes:
        metrics: floats, identical on all ranks except ``*_self`` and ``time/*`` (this rank's).
        exchange: the ``ExchangeResult`` (survivors this rank trained, plan, pruning).
        old_logprobs: m tensors [L_i - 1], the survivors' log-probs before the update.
        counter: what entered this rank's forward passes.
    """

    metrics: dict
    exchange: Any
    old_logprobs: list
    counter: ForwardCounter


def _host_copy(obj: Any) -> Any:
    """``obj`` with every tensor copied to CPU memory (dicts, lists and tuples rebuilt)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _host_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_host_copy(v) for v in obj)
    return obj


class MegatronActor:
    """Policy (and optional reference) as megatron-core models on this rank's TP/PP shard."""

    def __init__(self, hf_config: Any, hf_state_dict: dict, cfg: ActorConfig | None = None):
        cfg = cfg if cfg is not None else ActorConfig()
        self.cfg = cfg
        self.hf_config = hf_config
        self.layout = init_parallel(cfg.tp, cfg.pp, seed=cfg.seed, timeout_minutes=cfg.timeout_minutes)
        dtype = DTYPES[cfg.dtype]

        def build():
            config = transformer_config_from_hf(hf_config, tp=cfg.tp, pp=cfg.pp, params_dtype=dtype)
            shard = build_gpt_model(hf_config, config=config)
            load_hf_weights(shard, hf_state_dict, hf_config)
            return shard

        self.model, self.optimizer = build_ddp_and_optimizer(build(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                                             adam_betas=tuple(cfg.adam_betas),
                                                             use_distributed_optimizer=cfg.distributed_optimizer)
        self.ref = None
        if cfg.loss.kl_coef > 0:
            self.ref = build()
            self.ref.eval().requires_grad_(False)

    @property
    def dp_group(self):
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_group()

    def logprobs(self, sequences, counter: ForwardCounter | None = None, *, reference: bool = False) -> list:
        """m tensors [L_i - 1] of per-token log-probs under the policy (or the frozen reference)."""
        if reference and self.ref is None:
            raise ValueError("reference log-probs need a reference model: build the actor with loss.kl_coef > 0")
        model = self.ref if reference else self.model
        return compute_logprobs(model, sequences, max_tokens_per_micro_batch=self.cfg.max_tokens_per_micro_batch,
                                temperature=self.cfg.loss.temperature, counter=counter)

    def update(self, sequences: list, loss_masks: list, advantages, old_logprobs: list,
               ref_logprobs: list | None = None, *, lrs: Sequence[float] | None = None,
               counter: ForwardCounter | None = None, weights=None,
               full_denominators: tuple | None = None) -> list[dict]:
        """``cfg.mu`` optimizer steps on this rank's survivors (a collective over DP).

        Args:
            sequences: m token-id tensors [L_i]; loss_masks: m tensors [L_i - 1].
            advantages: [m] float full-group advantages; old_logprobs / ref_logprobs: m
                tensors [L_i - 1] (ref needed when ``loss.kl_coef > 0``).
            lrs: the learning rate of each of the mu steps (default: unchanged).
            weights: [m] optional per-sequence loss weights (``ExchangeResult.weights``, 1/pi
                for ``metric=importance``); full_denominators: (response tokens, sequences)
                of the full generated batch on all DP ranks, replacing the kept set's.

        Returns one metrics dict per optimizer step (``policy_update``'s global metrics).
        """
        if lrs is not None and len(lrs) != self.cfg.mu:
            raise ValueError(f"lrs has {len(lrs)} entries for mu={self.cfg.mu} optimizer steps")
        batch = UpdateBatch(sequences, loss_masks, advantages, old_logprobs, ref_logprobs, weights=weights,
                            full_denominators=full_denominators)
        out = []
        for it in range(self.cfg.mu):
            if lrs is not None:
                for group in self.optimizer.param_groups:
                    group["lr"] = float(lrs[it])
            out.append(policy_update(self.model, self.optimizer, batch, self.cfg.loss,
                                     max_tokens_per_micro_batch=self.cfg.max_tokens_per_micro_batch,
                                     clip_grad=self.cfg.clip_grad, counter=counter))
        return out

    def hf_state_dict(self, dst_ranks=None) -> dict:
        """The current policy as a full HF state dict (float32, CPU), on every rank or only on
        ``dst_ranks`` (global ranks, e.g. those that generate; the others get ``{}``). A
        collective: every rank calls it."""
        return export_hf_weights(self.model, self.hf_config, dst_ranks=dst_ranks)

    def _layout_key(self) -> tuple:
        lay = self.layout
        key = (lay.tp, lay.pp, lay.dp, lay.tp_rank, lay.pp_rank)
        # the distributed optimizer's shard also depends on this rank's DP index
        return (*key, lay.dp_rank) if self.cfg.distributed_optimizer else key

    def state_dict(self) -> dict:
        """This rank's shards: policy, optimizer (Adam moments; with the distributed optimizer
        only this DP rank's slice of them and of the master weights) and reference (a
        checkpoint per rank; resume needs the same tp / pp / dp layout, dtype and optimizer)."""
        return {
            "layout": self._layout_key(),
            "dtype": self.cfg.dtype,
            "distributed_optimizer": self.cfg.distributed_optimizer,
            "model": {k: v.detach().clone() for k, v in unwrap_model(self.model).state_dict().items()
                      if isinstance(v, torch.Tensor)},
            "optimizer": self._optimizer_state(),
            "ref": None if self.ref is None else {k: v.detach().clone()
                                                   for k, v in unwrap_model(self.ref).state_dict().items()
                                                   if isinstance(v, torch.Tensor)},
        }

    def _optimizer_state(self) -> dict | None:
        if not self.cfg.distributed_optimizer:
            # a copy, as for the weights: the optimizer's state_dict holds its live moment tensors, which
            # the next step changes in place (a kept shard would silently follow the run); in host memory,
            # where torch.save would put them anyway (load_state_dict moves them back to the parameters)
            return _host_copy(self.optimizer.state_dict())
        opt = self._distributed_optimizer()
        if not opt.optimizer.state:  # no step yet: nothing beyond the initial weights
            return None
        # megatron keeps the parameter-dependent state out of state_dict() (its
        # save_parameter_state gathers it to one DP rank); here each rank keeps its own slice
        shards = {name: {k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                         for k, v in opt._get_main_param_and_optimizer_states(p).items()}
                  for name, p in unwrap_model(self.model).named_parameters() if p in opt.model_param_group_index_map}
        return {"common": opt.state_dict(), "shards": shards}

    def _distributed_optimizer(self):
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        opts = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        if len(opts) != 1 or not isinstance(opts[0], DistributedOptimizer):
            raise TypeError(f"expected one megatron DistributedOptimizer, got {[type(o).__name__ for o in opts]}")
        return opts[0]

    def load_state_dict(self, state: dict) -> None:
        mine = self._layout_key()
        if tuple(state["layout"]) != mine:
            raise ValueError(f"checkpoint shard is for layout (tp, pp, dp, tp_rank, pp_rank[, dp_rank]) = "
                             f"{tuple(state['layout'])}, this rank is {mine}: resume with the same megatron.tp / "
                             "megatron.pp, --nproc and megatron.distributed_optimizer")
        for key, have in (("dtype", self.cfg.dtype), ("distributed_optimizer", self.cfg.distributed_optimizer)):
            if state.get(key, DEFAULT_STATE[key]) != have:
                raise ValueError(f"checkpoint shard was written with {key}={state.get(key, DEFAULT_STATE[key])!r}, "
                                 f"this run has {key}={have!r}: resume with the same setting")
        with torch.no_grad():
            params = unwrap_model(self.model).state_dict()
            for k, v in state["model"].items():
                params[k].copy_(v)
            if self.ref is not None and state.get("ref") is not None:
                ref = unwrap_model(self.ref).state_dict()
                for k, v in state["ref"].items():
                    ref[k].copy_(v)
        if not self.cfg.distributed_optimizer:
            self.optimizer.load_state_dict(state["optimizer"])
            return
        saved = state["optimizer"]
        opt = self._distributed_optimizer()
        if saved is None:  # written before the first step: copy the loaded weights into the master shards
            opt.reload_model_params()
            return
        with cpu_mode():  # it allocates the inner state on torch.cuda.current_device() (distrib_optimizer.py:791)
            opt.load_state_dict(saved["common"])  # (megatron: then load_parameter_state)
        # without Apex / Transformer Engine (CPU), megatron-core 0.16 gives every parameter's state ONE shared
        # `step` tensor (distrib_optimizer.py:817-826), which torch's AdamW then increments once per
        # parameter: Adam's bias correction after a resume would count #params steps per step
        for param_state in opt.optimizer.state.values():
            # no branch: a state without a `step` tensor exists only with Apex / Transformer Engine (CUDA), whose
            # FusedAdam keeps it in the param group (distrib_optimizer.py:818 sets it only without HAVE_APEX_OR_TE)
            if isinstance(param_state.get("step"), torch.Tensor):  # pragma: no branch
                param_state["step"] = param_state["step"].clone()
        by_name = dict(unwrap_model(self.model).named_parameters())
        with torch.no_grad():
            for name, tensors in saved["shards"].items():
                opt._set_main_param_and_optimizer_states(by_name[name], tensors)

    def step(self, sequences: list, loss_masks: list, rewards, group_ids, cppo_cfg: Any, *, step: int = 0,
             lengths=None, extra_fields: dict | None = None) -> ActorStepResult:
        """One CPPO step on this DP rank's rollouts: prune over all DP ranks, rebalance, old
        (and reference) log-probs and ``mu`` updates on the survivors.

        Args:
            sequences: n token-id tensors [L_i] (prompt + completion).
            loss_masks: n tensors [L_i - 1], 1 where target token t+1 is a response token.
            rewards, group_ids: [n] each (group ids global per prompt).
            cppo_cfg: a ``CPPOConfig``. lengths: [n] workload lengths (default L_i).
            extra_fields: more per-sequence fields to move with the survivors.

        Returns an ``ActorStepResult``; its metrics carry ``train/*`` (the last optimizer
        step's), ``cppo/*`` and this rank's seconds under ``time/exchange``,
        ``time/old_logprob``, ``time/ref_logprob``, ``time/update``.
        """
        n = len(sequences)
        if len(loss_masks) != n:
            raise ValueError(f"loss_masks has {len(loss_masks)} rows for {n} sequences")
        if lengths is None:
            lengths = torch.tensor([int(s.numel()) for s in sequences], dtype=torch.int64)
        fields = {"tokens": list(sequences), "mask": list(loss_masks), **(extra_fields or {})}
        t0 = time.perf_counter()
        res = prune_and_exchange(fields, rewards, group_ids, lengths, cppo_cfg, step=step, group=self.dp_group)
        t1 = time.perf_counter()
        toks, masks = res.fields["tokens"], res.fields["mask"]
        counter = ForwardCounter()
        old = self.logprobs(toks, counter)
        t_old = time.perf_counter()
        ref = self.logprobs(toks, counter, reference=True) if self.ref is not None else None
        t_ref = time.perf_counter()
        weighting: dict[str, Any] = {}  # weights, full_denominators: the keyword arguments of update
        if res.weighted:
            # importance: 1/pi weights and the full generated batch's denominators (HT loss)
            from ..distributed import global_sum

            full_tokens = global_sum(sum(float(torch.as_tensor(m).float().sum()) for m in loss_masks),
                                     group=self.dp_group)
            weighting = dict(weights=res.weights, full_denominators=(full_tokens, float(res.num_total)))
        upd = self.update(toks, masks, res.advantages, old, ref, counter=counter, **weighting)[-1]
        t2 = time.perf_counter()
        metrics: dict = {f"train/{k}": float(v) for k, v in upd.items()}
        metrics.update(res.metrics)
        metrics.update(rank_wait_metrics(t2 - t1, group=self.dp_group))
        metrics["cppo/exchange_seconds"] = t1 - t0
        metrics.update({"time/exchange": t1 - t0, "time/old_logprob": t_old - t1, "time/ref_logprob": t_ref - t_old,
                        "time/update": t2 - t_ref})
        metrics["cppo/forwarded_sequences_self"] = float(counter.sequences)
        metrics["cppo/padded_tokens_self"] = float(counter.padded_tokens)
        return ActorStepResult(metrics, res, old, counter)
