"""The policy side of a GRPO step for an HF model: log-prob passes and the update.

Only the kept completions reach this module. Every pass counts the rows it saw
(``rows_seen``), so a test can prove that pruned completions never enter them.
Per-token tensors are laid out [N, T] over completion tokens (T = longest completion),
with ``mask`` marking real tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..core import aggregate_loss, clipped_surrogate, kl_penalty, pack_micro_batches


@dataclass
class KeptBatch:
    """Kept completions and their prompts (token ids), one row per completion."""

    prompts: list[list[int]]
    completions: list[list[int]]

    def __post_init__(self) -> None:
        if len(self.prompts) != len(self.completions):
            raise ValueError(f"{len(self.prompts)} prompts for {len(self.completions)} completions")
        for i, c in enumerate(self.completions):
            if not c:
                raise ValueError(f"completion {i} is empty: nothing to train on")

    def __len__(self) -> int:
        return len(self.completions)

    @property
    def token_counts(self) -> list[int]:
        return [len(p) + len(c) for p, c in zip(self.prompts, self.completions, strict=True)]

    @property
    def max_completion(self) -> int:
        return max(len(c) for c in self.completions)

    def completion_mask(self) -> torch.Tensor:
        """[N, T] 1.0 on real completion tokens."""
        mask = torch.zeros(len(self), self.max_completion)
        for i, c in enumerate(self.completions):
            mask[i, : len(c)] = 1.0
        return mask

    def collate(self, rows: Sequence[int], pad_id: int):
        """input_ids / attention_mask [B, L] (right-padded) and the index grid that picks each
        completion token's prediction out of the [B, L-1] next-token log-probs."""
        seqs = [self.prompts[r] + self.completions[r] for r in rows]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for b, s in enumerate(seqs):
            ids[b, : len(s)] = torch.tensor(s)
            attn[b, : len(s)] = 1
        t = self.max_completion
        pos = torch.zeros(len(rows), t, dtype=torch.long)
        for b, r in enumerate(rows):
            plen, clen = len(self.prompts[r]), len(self.completions[r])
            pos[b, :clen] = torch.arange(plen - 1, plen - 1 + clen)
        return ids, attn, pos


@dataclass(frozen=True)
class HFUpdate:
    """What ``HFPolicy.update`` did: per optimizer step ``loss``, ``pg_loss``, ``kl``,
    ``clipfrac``, ``ratio_max``, ``grad_norm``; ``first_pass`` [N, T] log-probs of the first
    update pass (before any optimizer step: the behaviour policy when mu = 1); ``lr`` of the
    last step; the kept set's ``tokens`` and ``sequences``."""

    iterations: list
    first_pass: torch.Tensor
    lr: float
    tokens: float
    sequences: float


def micro_batches(batch: KeptBatch, max_tokens: int) -> list[list[int]]:
    """Balanced micro-batches under the token budget (padding-free token counts)."""
    longest = max(batch.token_counts)
    return pack_micro_batches(torch.tensor(batch.token_counts, dtype=torch.float64), max(max_tokens, longest))


def forward_logprobs(model, batch: KeptBatch, rows: Sequence[int], pad_id: int, device) -> torch.Tensor:
    """[len(rows), T] log-prob of each completion token under ``model`` (zeros past the end)."""
    ids, attn, pos = batch.collate(rows, pad_id)
    ids, attn, pos = ids.to(device), attn.to(device), pos.to(device)
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    targets = ids[:, 1:].gather(1, pos)
    picked = logits.gather(1, pos.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
    return torch.log_softmax(picked, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def lr_factor(i: int, train_cfg, total_steps: int) -> float:
    """Learning-rate multiplier at optimizer step ``i``: linear warm-up over
    ``lr_warmup_steps * mu`` steps, then constant or cosine down to 0.1 (both backends)."""
    total = max(1, total_steps * train_cfg.mu)
    warm = train_cfg.lr_warmup_steps * train_cfg.mu
    if warm and i < warm:
        return (i + 1) / warm
    if train_cfg.lr_schedule != "cosine":
        return 1.0
    progress = min(1.0, (i - warm) / max(1, total - warm))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


class HFPolicy:
    """Owns the optimizer and scheduler of an HF causal LM and runs the GRPO passes."""

    def __init__(self, model, *, device: torch.device, pad_id: int, train_cfg, total_steps: int) -> None:
        self.model = model
        self.device = device
        self.pad_id = pad_id
        self.cfg = train_cfg
        self.rows_seen = {"old_logprob": 0, "ref_logprob": 0, "update": 0}
        self.optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=train_cfg.lr,
            betas=(train_cfg.adam_beta1, train_cfg.adam_beta2),
            weight_decay=train_cfg.weight_decay,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda i: lr_factor(i, train_cfg, total_steps))

    @torch.no_grad()
    def logprobs(self, batch: KeptBatch, mbs: list[list[int]], *, counter: str, model=None) -> torch.Tensor:
        """[N, T] log-probs of every kept completion token, by micro-batch (no grad)."""
        model = model if model is not None else self.model
        was_training = model.training
        model.eval()
        out = torch.zeros(len(batch), batch.max_completion)
        try:
            for rows in mbs:
                lp = forward_logprobs(model, batch, rows, self.pad_id, self.device).cpu()
                out[rows, : lp.shape[1]] = lp
                self.rows_seen[counter] += len(rows)
        finally:
            model.train(was_training)
        return out

    def update(
        self,
        batch: KeptBatch,
        mbs: list[list[int]],
        advantages: torch.Tensor,
        old_logprobs: torch.Tensor | None,
        ref_logprobs: torch.Tensor | None,
        *,
        norm_constant: float,
        weights: torch.Tensor | None = None,
        num_tokens: float | None = None,
        num_seqs: float | None = None,
    ) -> HFUpdate:
        """mu optimizer steps on the kept batch. Denominators cover the whole kept set, so
        the micro-batch gradients add up to the gradient of the full-batch loss.

        advantages: [N] float; old_logprobs / ref_logprobs: [N, T] (T = longest completion).
        weights: [N] float per-sequence loss weights (``Selection.weights``, 1/pi for
        ``metric=importance``); num_tokens / num_seqs replace the kept set's denominators
        (importance passes the full batch's, for the unbiased HT loss).
        """
        cfg = self.cfg
        if cfg.mu > 1 and old_logprobs is None:
            raise ValueError("mu > 1 needs the old-policy log-probs")
        if cfg.beta > 0 and ref_logprobs is None:
            raise ValueError("beta > 0 needs the reference log-probs")
        if advantages.shape != (len(batch),):
            raise ValueError(f"advantages must be [N] = [{len(batch)}], got shape {tuple(advantages.shape)}")
        mask = batch.completion_mask()
        if weights is not None and weights.shape != (len(batch),):
            raise ValueError(f"weights {tuple(weights.shape)} must be [{len(batch)}], one per kept completion")
        num_tokens = float(mask.sum()) if num_tokens is None else float(num_tokens)
        num_seqs = float(len(batch)) if num_seqs is None else float(num_seqs)
        self.model.train()
        agg = dict(global_num_tokens=num_tokens, global_num_seqs=num_seqs, norm_constant=norm_constant)
        iterations = []
        first = torch.zeros(len(batch), batch.max_completion)
        lr = self.optimizer.param_groups[0]["lr"]
        for it in range(cfg.mu):
            self.optimizer.zero_grad(set_to_none=True)
            stats = {"loss": 0.0, "pg_loss": 0.0, "kl": 0.0, "clipfrac": 0.0, "ratio_max": 0.0}
            for rows in mbs:
                mb_agg = agg if weights is None else dict(agg, weights=weights[rows].to(self.device))
                lp = forward_logprobs(self.model, batch, rows, self.pad_id, self.device)
                if it == 0:
                    first[rows, : lp.shape[1]] = lp.detach().float().cpu()
                m = mask[rows, : lp.shape[1]].to(self.device)
                old = old_logprobs[rows, : lp.shape[1]].to(self.device) if old_logprobs is not None else lp.detach()
                pg, clipped = clipped_surrogate(
                    lp, old, advantages[rows].to(self.device), clip_low=cfg.clip_low, clip_high=cfg.clip_high
                )
                per_token = pg
                if cfg.beta > 0:
                    assert ref_logprobs is not None  # checked above: beta > 0 needs them
                    kl = kl_penalty(lp, ref_logprobs[rows, : lp.shape[1]].to(self.device), cfg.kl_type)
                    per_token = pg + cfg.beta * kl
                    stats["kl"] += float(aggregate_loss(kl.detach(), m, cfg.loss_agg, **mb_agg))
                loss = aggregate_loss(per_token, m, cfg.loss_agg, **mb_agg)
                loss.backward()
                self.rows_seen["update"] += len(rows)
                stats["loss"] += loss.item()
                stats["pg_loss"] += float(aggregate_loss(pg.detach(), m, cfg.loss_agg, **mb_agg))
                stats["clipfrac"] += float((clipped.float() * m).sum()) / num_tokens
                ratio = torch.exp(lp.detach() - old) * m
                stats["ratio_max"] = max(stats["ratio_max"], float(ratio.max()))
            clip = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
            stats["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip))
            lr = self.optimizer.param_groups[0]["lr"]
            self.optimizer.step()
            self.scheduler.step()
            iterations.append(stats)
        return HFUpdate(iterations, first, lr, num_tokens, num_seqs)

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
