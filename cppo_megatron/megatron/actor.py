"""A Megatron actor (no critic) that runs one CPPO step from rollouts held on each DP rank.

The pieces in ``passes`` and ``distributed`` composed in the order CPPO needs:

    prune + rebalance (all DP ranks)  ->  old log-probs  ->  reference log-probs
    ->  mu policy updates  ->  metrics (pruning, exchange balance, barrier waits, loss)

A trainer builds one ``MegatronActor`` per process after ``init_process_group`` and calls
``step`` with the rollouts this DP rank produced; ``hf_state_dict`` gives the updated
weights for the rollout engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..distributed import prune_and_exchange, rank_wait_metrics
from .convert import export_hf_weights, load_hf_weights
from .model import build_gpt_model, init_parallel
from .passes import (
    ForwardCounter,
    PolicyLossConfig,
    UpdateBatch,
    build_ddp_and_optimizer,
    compute_logprobs,
    policy_update,
)

__all__ = ["ActorConfig", "MegatronActor"]


@dataclass
class ActorConfig:
    """Parallel layout and update settings of a ``MegatronActor``.

    Attributes: tp, pp (model-parallel sizes; dp = world / (tp pp)), lr, weight_decay,
    adam_betas, clip_grad (0 disables), mu (policy updates per batch, the paper's 2),
    max_tokens_per_micro_batch (padded tokens per micro-batch), loss (``PolicyLossConfig``;
    ``kl_coef > 0`` builds a frozen reference model), seed.
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

    def __post_init__(self):
        if isinstance(self.mu, bool) or not isinstance(self.mu, int) or self.mu < 1:
            raise ValueError(f"mu must be an integer >= 1, got {self.mu!r}")
        if not (self.lr > 0):
            raise ValueError(f"lr must be > 0, got {self.lr!r}")


class MegatronActor:
    """Policy (and optional reference) as megatron-core models on this rank's TP/PP shard."""

    def __init__(self, hf_config: Any, hf_state_dict: dict, cfg: Optional[ActorConfig] = None):
        cfg = cfg if cfg is not None else ActorConfig()
        self.cfg = cfg
        self.hf_config = hf_config
        self.layout = init_parallel(cfg.tp, cfg.pp, seed=cfg.seed)
        model = build_gpt_model(hf_config)
        load_hf_weights(model, hf_state_dict, hf_config)
        self.model, self.optimizer = build_ddp_and_optimizer(model, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                                             adam_betas=tuple(cfg.adam_betas))
        self.last_exchange = None  # the last step's ExchangeResult (selection, plan, owners)
        self.last_counter: Optional[ForwardCounter] = None  # what the last step's passes saw
        self.ref = None
        if cfg.loss.kl_coef > 0:
            self.ref = build_gpt_model(hf_config)
            load_hf_weights(self.ref, hf_state_dict, hf_config)
            self.ref.eval().requires_grad_(False)

    @property
    def dp_group(self):
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_group()

    def logprobs(self, sequences, counter: Optional[ForwardCounter] = None) -> list:
        return compute_logprobs(self.model, sequences, max_tokens_per_micro_batch=self.cfg.max_tokens_per_micro_batch,
                                temperature=self.cfg.loss.temperature, counter=counter)

    def hf_state_dict(self) -> dict:
        """The current policy as a full HF state dict (float32, CPU), on every rank."""
        return export_hf_weights(self.model, self.hf_config)

    def step(self, sequences: list, loss_masks: list, rewards, group_ids, cppo_cfg: Any, *, step: int = 0,
             lengths=None, extra_fields: Optional[dict] = None) -> dict:
        """One CPPO step on this DP rank's rollouts.

        Args:
            sequences: n token-id tensors [L_i] (prompt + completion).
            loss_masks: n tensors [L_i - 1], 1 where target token t+1 is a response token.
            rewards, group_ids: [n] each (group ids global per prompt).
            cppo_cfg: a ``CPPOConfig``. lengths: [n] workload lengths (default L_i).
            extra_fields: more per-sequence fields to move with the survivors.

        Returns metrics (floats, identical on all ranks except ``*_self``). Per-phase seconds
        of this rank are under ``time/exchange``, ``time/old_logprob``, ``time/ref_logprob``
        and ``time/update``.
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
        ref = None
        if self.ref is not None:
            ref = compute_logprobs(self.ref, toks, max_tokens_per_micro_batch=self.cfg.max_tokens_per_micro_batch,
                                   temperature=self.cfg.loss.temperature, counter=counter)
        t_ref = time.perf_counter()
        batch = UpdateBatch(toks, masks, res.advantages, old, ref)
        if res.weighted:
            # importance: 1/pi weights and the full generated batch's denominators (HT loss)
            from ..distributed import global_sum

            full_tokens = global_sum(sum(float(torch.as_tensor(m).float().sum()) for m in loss_masks),
                                     group=self.dp_group)
            batch = UpdateBatch(toks, masks, res.advantages, old, ref, weights=res.weights,
                                full_denominators=(full_tokens, float(res.num_total)))
        metrics: dict = {}
        for _ in range(self.cfg.mu):
            upd = policy_update(self.model, self.optimizer, batch, self.cfg.loss,
                                max_tokens_per_micro_batch=self.cfg.max_tokens_per_micro_batch,
                                clip_grad=self.cfg.clip_grad, counter=counter)
        t2 = time.perf_counter()
        metrics.update({f"actor/{k}": float(v) for k, v in upd.items()})
        metrics.update(res.metrics)
        metrics.update(rank_wait_metrics(t2 - t1, group=self.dp_group))
        metrics["cppo/exchange_seconds"] = t1 - t0
        metrics.update({"time/exchange": t1 - t0, "time/old_logprob": t_old - t1, "time/ref_logprob": t_ref - t_old,
                        "time/update": t2 - t_ref})
        self.last_exchange, self.last_counter = res, counter
        self.last_old_logprobs = old  # the survivors' log-probs before the update (rollout consistency checks)
        metrics["cppo/forwarded_sequences_self"] = float(counter.sequences)
        metrics["cppo/padded_tokens_self"] = float(counter.padded_tokens)
        return metrics
