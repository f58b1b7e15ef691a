"""The expensive passes on pruned, packed micro-batches: per-token log-probs and the update.

Inputs are this DP rank's survivors after ``prune_and_exchange`` (pruned rows never get
here). Sequences are packed into micro-batches whose padded size (rows x longest row)
stays under a token budget, longest first so similar lengths share a micro-batch; a
micro-batch is padded on the right, and causal attention keeps padding out of every real
token's context.

Every pass goes through megatron's ``get_forward_backward_func`` (no pipelining for
pp=1, 1F1B for pp>1) so the same code runs under TP, PP and DP. Log-probs come from
``tensor_parallel.vocab_parallel_cross_entropy`` on a copy of the vocab-parallel logits
(it edits its input in place) with the padded vocabulary masked out; they are computed on
the last pipeline stage and broadcast to the other stages, so every rank gets them.

Loss normalisation: each micro-batch contributes ``core.aggregate_loss`` with the
*global* denominators of the kept set (tokens or sequences summed over all DP ranks), the
schedule is told not to divide by the number of micro-batches and DDP to sum rather than
average, so gradient accumulation plus the DP all-reduce yields the gradient of the
global mean exactly — however unevenly the survivors are spread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist

from ..core import aggregate_loss, clipped_surrogate, kl_penalty
from ..core.loss import KL_KINDS, LOSS_AGG_MODES
from .convert import unwrap_model
from .cpu_mode import cpu_mode

__all__ = [
    "ForwardCounter",
    "PolicyLossConfig",
    "UpdateBatch",
    "compute_logprobs",
    "policy_loss",
    "policy_update",
]


@dataclass
class ForwardCounter:
    """What entered this rank's forward passes (to check that pruned rows never do)."""

    sequences: int = 0
    tokens: int = 0
    padded_tokens: int = 0  # rows x longest row, summed over micro-batches
    micro_batches: int = 0
    seen: list = field(default_factory=list)  # first token id and length of each sequence

    def add(self, seqs: Sequence[torch.Tensor]) -> None:
        self.sequences += len(seqs)
        self.tokens += sum(int(s.numel()) for s in seqs)
        self.padded_tokens += len(seqs) * max((int(s.numel()) for s in seqs), default=0)
        self.micro_batches += 1
        self.seen.extend((int(s[0]), int(s.numel())) for s in seqs)


def _check_sequences(sequences) -> list[torch.Tensor]:
    if not isinstance(sequences, (list, tuple)):
        raise ValueError(f"sequences must be a list of 1-D token id tensors, got {type(sequences).__name__}")
    out = []
    for i, s in enumerate(sequences):
        s = torch.as_tensor(s)
        if s.dim() != 1 or s.numel() < 2:
            raise ValueError(f"sequences[{i}] must be 1-D with at least 2 tokens, got shape {tuple(s.shape)}")
        if s.is_floating_point():
            raise ValueError(f"sequences[{i}] must hold integer token ids, got {s.dtype}")
        out.append(s.to(torch.int64))
    return out


def _pad(rows: Sequence[torch.Tensor], value, length: int) -> torch.Tensor:
    out = torch.full((len(rows), length), value, dtype=rows[0].dtype)
    for i, r in enumerate(rows):
        out[i, : r.numel()] = r
    return out


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _micro_batches(sequences, max_tokens: int, pp: int) -> list[list[int]]:
    """Micro-batches whose *padded* size (rows x longest row) stays within ``max_tokens``.

    The local layer spec has no padding-free (THD) attention, so a micro-batch costs
    rows x longest row. Sequences are taken longest first and a micro-batch is closed
    when one more row would exceed the budget: similar lengths share a micro-batch and
    padding stays small. Under PP at least ``pp`` micro-batches keep the stages busy.
    """
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens_per_micro_batch must be an integer >= 1, got {max_tokens!r}")
    lengths = [int(s.numel()) for s in sequences]
    for i, L in enumerate(lengths):
        if L > max_tokens:
            raise ValueError(
                f"sequence {i} has {L} tokens, more than max_tokens_per_micro_batch={max_tokens}: raise the budget"
            )
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= max_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    while len(batches) < min(pp, len(lengths)):  # split the largest until every stage has work
        j = max(range(len(batches)), key=lambda k: (len(batches[k]), -k))
        b = batches.pop(j)
        batches[j:j] = [b[: len(b) // 2], b[len(b) // 2 :]]
    return batches


def _masked_vocab_logprobs(model, logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """[b, T] log p(target) from vocab-parallel logits [b, T, V/tp], on a copy."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    x = logits.float() / temperature  # a new tensor: the CE kernel may overwrite it freely
    vocab = getattr(unwrap_model(model), "cppo_vocab_size", None)
    part = x.shape[-1]
    lo = ps.get_tensor_model_parallel_rank() * part
    if vocab is not None and lo + part > vocab:
        pad = torch.arange(lo, lo + part, device=x.device) >= vocab
        x = x.masked_fill(pad, float("-inf"))
    return -vocab_parallel_cross_entropy(x, targets)


def _run_schedule(model, batches: list[dict], loss_fn, *, forward_only: bool) -> list:
    """Run megatron's schedule over prepared micro-batches; returns the per-micro-batch
    outputs of ``loss_fn`` on the last stage (empty elsewhere)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, mdl):
        b = next(data_iterator)
        out = mdl(b["input_ids"], b["position_ids"], None)
        return out, partial(loss_fn, b)

    if not batches:
        return []
    seq = max(b["input_ids"].shape[1] for b in batches)
    mbs = max(b["input_ids"].shape[0] for b in batches)
    fb = get_forward_backward_func()
    with cpu_mode():
        store = fb(
            forward_step_func=forward_step,
            data_iterator=iter(batches),
            model=[model],
            num_microbatches=len(batches),
            seq_length=seq,
            micro_batch_size=mbs,
            forward_only=forward_only,
        )
    return store if ps.is_pipeline_last_stage() else []


def _broadcast_from_last_stage(values: torch.Tensor | None, numel: int) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        assert values is not None  # one stage: it is the last, which computed them
        return values
    if ps.is_pipeline_last_stage():
        assert values is not None  # the last stage computed them
        buf = values.contiguous()
    else:
        buf = torch.empty(numel, dtype=torch.float32, device=_device())
    dist.broadcast(buf, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group())
    return buf


def _prepare(sequences, order: list[list[int]], extra: dict | None = None) -> list[dict]:
    dev = _device()
    out = []
    for mb in order:
        rows = [sequences[i] for i in mb]
        T = max(r.numel() for r in rows)
        ids = _pad(rows, 0, T)
        b = {
            "index": mb,
            "lengths": torch.tensor([r.numel() for r in rows]),
            "input_ids": ids.to(dev),
            "position_ids": torch.arange(T).unsqueeze(0).expand(len(rows), T).contiguous().to(dev),
            # targets[t] = token t+1; the last column has no target and is masked
            "targets": torch.cat([ids[:, 1:], torch.zeros(len(rows), 1, dtype=ids.dtype)], 1).to(dev),
        }
        for name, per_seq in (extra or {}).items():
            if per_seq is None:
                continue
            first = per_seq[mb[0]]
            if first.dim() == 0:
                b[name] = torch.stack([per_seq[i] for i in mb]).to(dev)
            else:
                b[name] = _pad([per_seq[i] for i in mb], 0, T - 1).to(dev)
        out.append(b)
    return out


@torch.no_grad()
def compute_logprobs(
    model,
    sequences: Sequence[torch.Tensor],
    *,
    max_tokens_per_micro_batch: int = 4096,
    temperature: float = 1.0,
    counter: ForwardCounter | None = None,
) -> list[torch.Tensor]:
    """Per-token log-probs of this rank's sequences under ``model`` (a megatron ``GPTModel``,
    possibly DDP-wrapped), on every TP and PP rank.

    Args:
        sequences: m token-id tensors [L_i] (prompt + completion), any lengths >= 2.
        max_tokens_per_micro_batch: token budget of a packed micro-batch.
        temperature: the sampling temperature the rollout used (logits are divided by it).
        counter: records what entered the forward passes.

    Returns m tensors [L_i - 1]: entry t is log p(tokens[t+1] | tokens[:t+1]).
    """
    from megatron.core import parallel_state as ps

    seqs = _check_sequences(sequences)
    if not (isinstance(temperature, (int, float)) and temperature > 0):
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    if not seqs:
        return []
    order = _micro_batches(seqs, max_tokens_per_micro_batch, ps.get_pipeline_model_parallel_world_size())
    batches = _prepare(seqs, order)
    if counter is not None:
        for mb in order:
            counter.add([seqs[i] for i in mb])

    def loss_fn(b, output):
        logp = _masked_vocab_logprobs(model, output, b["targets"], temperature)
        return logp.sum() * 0.0, torch.tensor(1, dtype=torch.int), {"logp": logp.detach().float()}

    was_training = model.training
    model.eval()
    try:
        store = _run_schedule(model, batches, loss_fn, forward_only=True)
    finally:
        model.train(was_training)
    total = sum(b["input_ids"].numel() for b in batches)
    flat = torch.cat([s["logp"].reshape(-1) for s in store]) if store else None
    flat = _broadcast_from_last_stage(flat, total).cpu()
    out: list = [None] * len(seqs)
    pos = 0
    for b in batches:
        bs, T = b["input_ids"].shape
        block = flat[pos : pos + bs * T].reshape(bs, T)
        pos += bs * T
        for j, i in enumerate(b["index"]):
            out[i] = block[j, : int(b["lengths"][j]) - 1].clone()
    return out


# ----------------------------------------------------------------------------- update
@dataclass(frozen=True)
class PolicyLossConfig:
    """Clipped surrogate + KL, aggregated with ``core.aggregate_loss``.

    Attributes: clip_low / clip_high (ratio clip range, clip_high defaults to clip_low),
    kl_coef (0 disables the KL term and needs no reference log-probs), kl_kind (``k1``,
    ``k2``, ``k3``, ``low_var_kl``), loss_agg_mode (``token-mean`` TRL fork,
    ``seq-mean-token-mean`` veRL port, ...), temperature (the rollout's).
    """

    clip_low: float = 0.2
    clip_high: float | None = None
    kl_coef: float = 0.04
    kl_kind: str = "k3"
    loss_agg_mode: str = "token-mean"
    temperature: float = 1.0

    def __post_init__(self):
        if self.kl_kind not in KL_KINDS:
            raise ValueError(f"kl_kind must be one of {list(KL_KINDS)}, got {self.kl_kind!r}")
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"loss_agg_mode must be one of {list(LOSS_AGG_MODES)}, got {self.loss_agg_mode!r}")
        if not (self.kl_coef >= 0):
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef!r}")
        if not (self.temperature > 0):
            raise ValueError(f"temperature must be > 0, got {self.temperature!r}")


@dataclass
class UpdateBatch:
    """This rank's survivors for the policy update (after the exchange).

    Attributes:
        sequences: m token-id tensors [L_i].
        loss_mask: m tensors [L_i - 1] (bool / 0-1): 1 where the target token t+1 is a
            response token that counts in the loss.
        advantages: [m] full-group advantages (``ExchangeResult.advantages``).
        old_logprobs: m tensors [L_i - 1] from ``compute_logprobs`` with the behaviour policy.
        ref_logprobs: m tensors [L_i - 1] from the reference model (needed when kl_coef > 0).
        weights: [m] optional per-sequence loss weights (``ExchangeResult.weights``: 1/pi
            for ``metric=importance``).
        full_denominators: optional (response tokens, sequences) of the FULL generated
            batch on all DP ranks; replaces the kept set's denominators (importance: the
            unbiased Horvitz-Thompson loss, ``core.aggregate_loss``).
    """

    sequences: list
    loss_mask: list
    advantages: torch.Tensor
    old_logprobs: list
    ref_logprobs: list | None = None
    weights: torch.Tensor | None = None
    full_denominators: tuple | None = None

    def validate(self, need_ref: bool) -> None:
        m = len(self.sequences)
        adv = torch.as_tensor(self.advantages)
        if adv.shape != (m,):
            raise ValueError(f"advantages must be [m] = [{m}], got shape {tuple(adv.shape)}")
        if self.weights is not None and torch.as_tensor(self.weights).shape != (m,):
            raise ValueError(f"weights must be [m] = [{m}], got shape {tuple(torch.as_tensor(self.weights).shape)}")
        named = [("loss_mask", self.loss_mask), ("old_logprobs", self.old_logprobs)]
        if need_ref:
            if self.ref_logprobs is None:
                raise ValueError("kl_coef > 0 needs ref_logprobs (or set kl_coef=0)")
            named.append(("ref_logprobs", self.ref_logprobs))
        for name, rows in named:
            if len(rows) != m:
                raise ValueError(f"{name} has {len(rows)} rows for {m} sequences")
            for i, (r, s) in enumerate(zip(rows, self.sequences, strict=True)):
                if r.shape != (s.numel() - 1,):
                    raise ValueError(f"{name}[{i}] must be [L-1] = [{s.numel() - 1}], got {tuple(r.shape)}")


def _global_denominators(batch: UpdateBatch) -> tuple[float, float]:
    """Response tokens and sequences (with >= 1 response token) of the kept set on all DP ranks."""
    from megatron.core import parallel_state as ps

    tokens = sum(float(torch.as_tensor(m).float().sum()) for m in batch.loss_mask)
    seqs = sum(1.0 for m in batch.loss_mask if bool(torch.as_tensor(m).any()))
    t = torch.tensor([tokens, seqs], dtype=torch.float64, device=_device())
    if ps.get_data_parallel_world_size() > 1:
        dist.all_reduce(t, group=ps.get_data_parallel_group())
    return max(float(t[0]), 1.0), max(float(t[1]), 1.0)


def policy_loss(model, batch: UpdateBatch, cfg: PolicyLossConfig, *, max_tokens_per_micro_batch: int = 4096,
                counter: ForwardCounter | None = None, forward_only: bool = False) -> dict:
    """Run the forward (and, unless ``forward_only``, backward) passes of the CPPO loss.

    Gradients accumulate in the DDP buffers and are all-reduced (summed) over DP. Returns
    global metrics (identical on all ranks): ``loss``, ``pg_loss``, ``kl``, ``clipfrac``
    (share of response tokens whose ratio was clipped), ``ratio_max`` (largest
    new/old probability ratio over response tokens), ``num_tokens``, ``num_seqs``.
    """
    from megatron.core import parallel_state as ps

    seqs = _check_sequences(batch.sequences)
    need_ref = cfg.kl_coef > 0
    batch.validate(need_ref)
    if isinstance(model, torch.nn.Module) and not forward_only and not hasattr(model, "zero_grad_buffer"):
        raise ValueError("policy_loss with backward needs the Megatron DDP model from build_ddp_and_optimizer")
    n_tok, n_seq = _global_denominators(batch)
    if batch.full_denominators is not None:
        n_tok, n_seq = (max(float(v), 1.0) for v in batch.full_denominators)
    order = _micro_batches(seqs, max_tokens_per_micro_batch, ps.get_pipeline_model_parallel_world_size())
    adv = torch.as_tensor(batch.advantages, dtype=torch.float32)
    extra = {
        "mask": [torch.as_tensor(m).float() for m in batch.loss_mask],
        "old": [torch.as_tensor(x).float() for x in batch.old_logprobs],
        # batch.validate(need_ref) raised above when need_ref and no ref_logprobs
        "ref": [torch.as_tensor(x).float() for x in batch.ref_logprobs] if need_ref and batch.ref_logprobs else None,
        "adv": [adv[i] for i in range(len(seqs))],
        "w": ([w_i for w_i in torch.as_tensor(batch.weights, dtype=torch.float32)]
              if batch.weights is not None else None),
    }
    if counter is not None:
        for mb in order:
            counter.add([seqs[i] for i in mb])
    if not seqs and not forward_only:
        # A DP rank without survivors must still join the gradient all-reduce inside the
        # schedule: one 2-token row whose loss mask is 0 contributes exactly nothing.
        seqs, order = [torch.zeros(2, dtype=torch.int64)], [[0]]
        zero = torch.zeros(1)
        extra = {"mask": [zero], "old": [zero], "ref": [zero] if need_ref else None, "adv": [torch.zeros(())],
                 "w": [torch.ones(())] if batch.weights is not None else None}
    batches = _prepare(seqs, order, extra)
    agg = partial(aggregate_loss, mode=cfg.loss_agg_mode, global_num_tokens=n_tok, global_num_seqs=n_seq)

    def loss_fn(b, output):
        logp = _masked_vocab_logprobs(model, output, b["targets"], cfg.temperature)[:, :-1]
        mask = b["mask"]
        pg, clipped = clipped_surrogate(logp, b["old"], b["adv"], clip_low=cfg.clip_low, clip_high=cfg.clip_high)
        per_token = pg
        kl = torch.zeros_like(pg)
        if need_ref:
            kl = kl_penalty(logp, b["ref"], cfg.kl_kind)
            per_token = pg + cfg.kl_coef * kl
        w = b.get("w")
        loss = agg(per_token, mask, weights=w)
        stats = torch.stack([
            loss.detach(),
            agg(pg.detach(), mask, weights=w),
            agg(kl.detach(), mask, weights=w),
            (clipped.float() * mask).sum() / n_tok,
        ])
        ratio_max = (torch.exp(logp.detach() - b["old"]) * mask).max()
        return loss, torch.tensor(1, dtype=torch.int), {"stats": stats, "ratio_max": ratio_max.reshape(1)}

    store = _run_schedule(model, batches, loss_fn, forward_only=forward_only)
    stats = torch.stack([s["stats"] for s in store]).sum(0) if store else torch.zeros(4)
    # the largest ratio rides along as a fifth entry: summed stats, then a max
    peak = torch.cat([s["ratio_max"] for s in store]).max().reshape(1) if store else torch.zeros(1)
    both = _broadcast_from_last_stage(torch.cat([stats, peak.to(stats.dtype)]).to(_device(), torch.float32), 5)
    stats, peak = both[:4].to(_device(), torch.float64), both[4:].to(_device(), torch.float64)
    if ps.get_data_parallel_world_size() > 1:
        dist.all_reduce(stats, group=ps.get_data_parallel_group())
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group())
    s = stats.cpu().tolist()
    return {"loss": s[0], "pg_loss": s[1], "kl": s[2], "clipfrac": s[3], "ratio_max": float(peak.item()),
            "num_tokens": n_tok, "num_seqs": n_seq}


def policy_update(
    ddp_model,
    optimizer,
    batch: UpdateBatch,
    cfg: PolicyLossConfig,
    *,
    max_tokens_per_micro_batch: int = 4096,
    clip_grad: float = 1.0,
    counter: ForwardCounter | None = None,
) -> dict:
    """One optimizer step on this rank's survivors: zero grads, forward/backward over all
    micro-batches, DP all-reduce, grad-norm clipping, step. Returns the global metrics of
    ``policy_loss`` plus ``grad_norm`` (before clipping)."""
    if not (clip_grad >= 0):
        raise ValueError(f"clip_grad must be >= 0 (0 disables clipping), got {clip_grad!r}")
    ddp_model.train()
    ddp_model.zero_grad_buffer()
    optimizer.zero_grad()
    metrics = policy_loss(ddp_model, batch, cfg, max_tokens_per_micro_batch=max_tokens_per_micro_batch, counter=counter)
    with cpu_mode():
        optimizer.prepare_grads()
        grad_norm = float(optimizer.get_grad_norm())
        if clip_grad > 0 and grad_norm > clip_grad:
            coef = clip_grad / (grad_norm + 1e-6)
            for p in optimizer.get_parameters():  # each has a grad: prepare_grads set it from DDP's main_grad
                p.grad.mul_(coef)
        optimizer.step_with_ready_grads()
    metrics["grad_norm"] = grad_norm
    return metrics
