"""``backend: megatron``: the policy as megatron-core TP / PP shards (``MegatronActor``),
one process per rank under torchrun.

``place`` moves the survivors between data-parallel ranks (``distributed.exchange_kept``:
the decision is the pipeline's, made once and identically on every rank; the plan evens
out the ranks' workloads); the passes run on the rows each rank received. TP / PP peers
hold the same rows and receive the same survivors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ...distributed import GlobalMetadata, exchange_kept
from ..policy import lr_factor
from .base import PassResult, TrainRows, UpdateResult

__all__ = ["MegatronBackend"]


class MegatronBackend:
    """Builds this rank's ``MegatronActor`` shard from full HF weights (every rank passes the same)."""

    name = "megatron"

    def __init__(self, recipe, hf_config, hf_weights: dict, *, comm_device: torch.device) -> None:
        from ...megatron import ActorConfig, MegatronActor, PolicyLossConfig

        r, t = recipe, recipe.train
        self.r = recipe
        self.comm_device = comm_device
        loss = PolicyLossConfig(clip_low=t.clip_low, clip_high=t.clip_high, kl_coef=t.beta, kl_kind=t.kl_type,
                                loss_agg_mode=t.loss_agg, temperature=1.0)  # untempered, as the hf backend
        cfg = ActorConfig(tp=r.megatron.tp, pp=r.megatron.pp, lr=t.lr, weight_decay=t.weight_decay,
                          adam_betas=(t.adam_beta1, t.adam_beta2), clip_grad=t.grad_clip, mu=t.mu,
                          max_tokens_per_micro_batch=t.micro_batch_tokens, loss=loss, seed=r.seed,
                          timeout_minutes=max(1, math.ceil(r.megatron.collective_timeout_s / 60)),
                          dtype=r.model.dtype, distributed_optimizer=r.megatron.distributed_optimizer)
        self.actor = MegatronActor(hf_config, hf_weights, cfg)
        from megatron.core import parallel_state as ps

        self.dp_group = ps.get_data_parallel_group()
        self.mp_group = ps.get_model_parallel_group()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.dp_rank, self.dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()

    def start(self) -> None:
        pass  # the actor built its reference with the policy

    def needs_old_logprobs(self, mu: int) -> bool:
        return True  # Megatron's update takes the behaviour log-probs as an input

    def place(self, batch, kept: torch.Tensor, advantages: torch.Tensor) -> TrainRows:
        # the exchange's global order is rank-major (rank 0's rows, then rank 1's); a rank's
        # rows in ascending draw order are exactly its local rows
        order = torch.sort(batch.owner, stable=True).indices
        counts = torch.bincount(batch.owner, minlength=self.dp).tolist()
        meta = GlobalMetadata(counts, batch.rewards.double()[order], batch.group_ids[order], batch.lengths[order])
        position = torch.empty_like(order)
        position[order] = torch.arange(order.numel())
        seqs = [torch.tensor(p + c, dtype=torch.int64) for p, c in zip(batch.prompts, batch.completions, strict=True)]
        masks = [_loss_mask(len(p), len(c)) for p, c in zip(batch.prompts, batch.completions, strict=True)]
        fields = {"tokens": seqs, "mask": masks, "row": batch.local_rows.clone(),
                  "prompt_len": torch.tensor([len(p) for p in batch.prompts], dtype=torch.int64)}
        if batch.sampler_logprobs is not None:
            fields["sampler_lp"] = [lp.float() for lp in batch.sampler_logprobs]
        moved, plan, _ = exchange_kept(fields, meta, torch.sort(position[kept]).values, self.r.cppo,
                                       group=self.dp_group, device=self.comm_device)
        toks = [t.cpu() for t in moved["tokens"]]
        plens = moved["prompt_len"].cpu().tolist()
        rows = moved["row"].cpu()
        placement = plan.metrics()
        return TrainRows(
            prompts=[t[:n].tolist() for t, n in zip(toks, plens, strict=True)],
            completions=[t[n:].tolist() for t, n in zip(toks, plens, strict=True)],
            advantages=advantages[rows],
            rows=rows,
            sampler_logprobs=None if "sampler_lp" not in moved else [x.cpu() for x in moved["sampler_lp"]],
            placement=placement,
            owned=int(batch.local_rows.numel()),
            payload=(toks, [m.cpu() for m in moved["mask"]], plens),
        )

    def logprobs(self, rows: TrainRows, *, reference: bool = False) -> PassResult:
        from ...megatron import ForwardCounter

        toks, _, plens = rows.payload
        counter = ForwardCounter()
        raw = self.actor.logprobs(toks, counter, reference=reference)
        return PassResult([lp[n - 1 :] for lp, n in zip(raw, plens, strict=True)], raw, counter.sequences,
                          counter.padded_tokens)

    def update(self, rows: TrainRows, old: PassResult | None, ref: PassResult | None, *,
               step: int) -> UpdateResult:
        from ...megatron import ForwardCounter

        if old is None:
            raise ValueError("MegatronBackend.update needs the old-policy log-probs (needs_old_logprobs is True)")
        toks, masks, _ = rows.payload
        t, mu = self.r.train, self.r.train.mu
        # the same schedule as the hf backend's LambdaLR: one factor per optimizer step
        lrs = [t.lr * lr_factor(step * mu + it, t, t.steps) for it in range(mu)]
        counter = ForwardCounter()
        its = self.actor.update(toks, masks, rows.advantages, old.raw, None if ref is None else ref.raw, lrs=lrs,
                                counter=counter, weights=rows.weights, full_denominators=rows.full_denominators)
        return UpdateResult(its, None, lrs[-1], its[-1]["num_tokens"], its[-1]["num_seqs"],
                            counter.micro_batches // mu, counter.sequences, counter.padded_tokens)

    def export_weights(self, dst_ranks: Sequence[int] | None = None) -> dict:
        """Full HF tensors on every rank, or only on ``dst_ranks`` (``{}`` elsewhere); a collective:
        TP shards gathered, PP parts sent to the ranks that keep them."""
        return self.actor.hf_state_dict(dst_ranks)

    def state_dict(self) -> dict:
        return self.actor.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.actor.load_state_dict(state)


def _loss_mask(prompt_len: int, completion_len: int) -> torch.Tensor:
    """[L - 1]: 1 where target token t + 1 is a completion token."""
    m = torch.zeros(prompt_len + completion_len - 1)
    m[prompt_len - 1 :] = 1.0
    return m
