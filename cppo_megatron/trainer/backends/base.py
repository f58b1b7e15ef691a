"""The policy-backend interface: what the step pipeline asks of a policy.

A backend receives the step's survivors (``Survivors`` over a ``RolloutBatch``) and runs
the expensive passes on them — it never sees a pruned row:

    place(batch, kept, advantages)  -> TrainRows   this rank's share of the survivors
    logprobs(rows, reference=...)   -> PassResult  old-policy or reference log-probs
    update(rows, old, ref, step=)   -> UpdateResult  mu optimizer steps
    start()                            RL begins: freeze the reference policy
    export_weights(dst_ranks=None)  -> full HF state dict (the rollout engine's weights)
    state_dict() / load_state_dict()   this rank's part of a checkpoint

Implementations: ``HFBackend`` (one process, an HF causal LM) and ``MegatronBackend``
(megatron-core TP / PP / DP shards; ``place`` redistributes the survivors over DP ranks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

__all__ = ["PassResult", "PolicyBackend", "TrainRows", "UpdateResult"]


@dataclass(frozen=True)
class TrainRows:
    """The survivors this rank trains on (m rows).

    prompts / completions: m token-id lists; advantages: [m] float32 full-group
    advantages; rows: [m] int64 row of each in the ``RolloutBatch`` (draw order);
    sampler_logprobs: m tensors [len(completion)] (vLLM) or None; placement: the
    ``cppo/exchange_*`` metrics of how survivors were spread over DP ranks; owned: rows
    this rank generated before pruning; payload: the backend's own prepared form.
    weights: [m] float32 loss weights (1/pi for ``metric=importance``) or None (all 1);
    full_denominators: (response tokens, rows) of the full generated batch, replacing the
    kept set's loss denominators (importance), or None.
    """

    prompts: list
    completions: list
    advantages: torch.Tensor
    rows: torch.Tensor
    sampler_logprobs: list | None
    placement: dict
    owned: int
    payload: Any = None
    weights: torch.Tensor | None = None
    full_denominators: tuple | None = None

    def __len__(self) -> int:
        return len(self.completions)


@dataclass(frozen=True)
class PassResult:
    """Log-probs of a forward-only pass. values: m tensors [len(completion_i)] float32
    (completion tokens only); raw: the backend's own layout for ``update``; forwarded /
    padded_tokens: rows and padded tokens that entered the pass on this rank."""

    values: list
    raw: Any
    forwarded: int
    padded_tokens: int


@dataclass(frozen=True)
class UpdateResult:
    """mu optimizer steps. iterations: one dict per step with ``loss``, ``pg_loss``, ``kl``,
    ``clipfrac``, ``ratio_max``, ``grad_norm`` (global over DP ranks); behaviour: m
    tensors [len(completion_i)] of the first pass's log-probs (the behaviour policy when no
    old-policy pass ran) or None; lr: of the last step; tokens / sequences: the kept set's
    response tokens and rows over all ranks; micro_batches: per optimizer step."""

    iterations: list
    behaviour: list | None
    lr: float
    tokens: float
    sequences: float
    micro_batches: int
    forwarded: int
    padded_tokens: int
    extra: dict = field(default_factory=dict)


class PolicyBackend(Protocol):
    name: str

    def needs_old_logprobs(self, mu: int) -> bool: ...

    def place(self, batch, kept: torch.Tensor, advantages: torch.Tensor) -> TrainRows: ...

    def logprobs(self, rows: TrainRows, *, reference: bool = False) -> PassResult: ...

    def update(self, rows: TrainRows, old: PassResult | None, ref: PassResult | None, *,
               step: int) -> UpdateResult: ...

    def start(self) -> None: ...

    def export_weights(self, dst_ranks: Sequence[int] | None = None) -> dict: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...
