"""``backend: hf``: the policy is an HF causal LM in this process (``policy.HFPolicy``)."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch

from ...distributed import GlobalMetadata, make_plan
from ..policy import HFPolicy, KeptBatch, micro_batches
from .base import PassResult, TrainRows, UpdateResult

__all__ = ["HFBackend"]


class HFBackend:
    """One process holds every row; ``place`` only picks the survivors (the placement
    metrics are those of a one-rank plan: nothing moves)."""

    name = "hf"

    def __init__(self, model, *, device: torch.device, pad_id: int, recipe) -> None:
        self.r = recipe
        self.model = model
        self.hf = HFPolicy(model, device=device, pad_id=pad_id, train_cfg=recipe.train,
                           total_steps=recipe.train.steps)
        self.ref_model: torch.nn.Module | None = None

    @property
    def rows_seen(self) -> dict:
        """Rows that entered each pass since the start (``old_logprob``, ``ref_logprob``, ``update``)."""
        return self.hf.rows_seen

    def start(self) -> None:
        """The frozen reference: the policy as RL starts (after warm-up / init_checkpoint)."""
        if self.r.train.beta > 0 and self.ref_model is None:
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)

    def needs_old_logprobs(self, mu: int) -> bool:
        return mu > 1  # with mu = 1 the first update pass is the behaviour policy

    def place(self, batch, kept: torch.Tensor, advantages: torch.Tensor) -> TrainRows:
        if not torch.equal(batch.local_rows, torch.arange(batch.num_rows)):
            raise ValueError("HFBackend: this process must hold every row of the step")
        meta = GlobalMetadata([batch.num_rows], batch.rewards.double(), batch.group_ids, batch.lengths)
        plan = make_plan(meta, kept, self.r.cppo)
        idx = kept.tolist()
        prompts = [batch.prompts[i] for i in idx]
        completions = [batch.completions[i] for i in idx]
        kb = KeptBatch(prompts, completions)
        lp = None if batch.sampler_logprobs is None else [batch.sampler_logprobs[i] for i in idx]
        return TrainRows(prompts, completions, advantages[kept], kept.clone(), lp, plan.metrics(),
                         owned=batch.num_rows, payload=(kb, micro_batches(kb, self.r.train.micro_batch_tokens)))

    def logprobs(self, rows: TrainRows, *, reference: bool = False) -> PassResult:
        kb, mbs = rows.payload
        model = None
        if reference:
            if self.ref_model is None:
                raise RuntimeError("reference log-probs need train.beta > 0 (HFBackend.start builds the reference)")
            model = self.ref_model
        out = self.hf.logprobs(kb, mbs, counter="ref_logprob" if reference else "old_logprob", model=model)
        return PassResult(_per_row(out, kb), out, len(kb), _padded(kb, mbs))

    def update(self, rows: TrainRows, old: PassResult | None, ref: PassResult | None, *,
               step: int) -> UpdateResult:
        kb, mbs = rows.payload
        full = rows.full_denominators
        res = self.hf.update(kb, mbs, rows.advantages, None if old is None else old.raw,
                             None if ref is None else ref.raw, norm_constant=float(self.r.rollout.max_new_tokens),
                             weights=rows.weights, num_tokens=None if full is None else full[0],
                             num_seqs=None if full is None else full[1])
        mu = self.r.train.mu
        return UpdateResult(res.iterations, _per_row(res.first_pass, kb), res.lr, res.tokens, res.sequences,
                            len(mbs), mu * len(kb), mu * _padded(kb, mbs))

    def export_weights(self, dst_ranks: Sequence[int] | None = None) -> dict:
        """The model's state dict (one process: ``dst_ranks`` has nothing to choose)."""
        return self.model.state_dict()

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), **self.hf.state_dict(),
                "ref_model": None if self.ref_model is None else self.ref_model.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.hf.load_state_dict(state)
        if state.get("ref_model") is not None:
            self.ref_model = copy.deepcopy(self.model)
            self.ref_model.load_state_dict(state["ref_model"])
            self.ref_model.eval().requires_grad_(False)


def _per_row(values: torch.Tensor, kb: KeptBatch) -> list:
    return [values[i, : len(c)].clone() for i, c in enumerate(kb.completions)]


def _padded(kb: KeptBatch, mbs: list) -> int:
    counts = kb.token_counts
    return sum(len(mb) * max(counts[i] for i in mb) for mb in mbs)
