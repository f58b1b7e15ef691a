"""HF ``generate`` in segments, for early stopping (``HFEngine.generate(..., monitor=...)``).

Why segments and not a ``StoppingCriteria``: HF ``generate`` keeps every row of its batch in
every forward until the whole batch is done (a stopped row is only padded), so a stopping
criterion saves no compute. Here each segment is one ``generate`` call of ``segment_tokens``
new tokens; between segments the monitor names the rows to stop, and the next call continues
the others from the KV cache of the previous one with the stopped and finished rows sliced out
(``DynamicCache.batch_select_indices``): the batch shrinks, no prefix is recomputed, and with
greedy decoding the completions are token for token those of one unsegmented call.

Per row the engine keeps the raw log-prob of every sampled token, its entropy (when the
monitor asks: the policy's own distribution, before temperature and top-p) and the hidden
state of the decoder's final norm at its last token (when asked).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import BoundaryView, SamplingParams, StopMonitor

__all__ = ["generate_segmented"]

_RUNNING, _FINISHED, _STOPPED = 0, 1, 2  # core.early_stop's statuses (the rollout layer imports no core)


class _Rows:
    """The growing state of B rows: tokens, per-token log-probs / entropies, status, hidden."""

    def __init__(self, B: int, want_entropy: bool) -> None:
        self.tokens: list[list[int]] = [[] for _ in range(B)]
        self.logp: list[list[float]] = [[] for _ in range(B)]
        self.ent: list[list[float]] | None = [[] for _ in range(B)] if want_entropy else None
        self.status = torch.full((B,), _RUNNING, dtype=torch.int64)
        self.hidden: torch.Tensor | None = None
        self.reasons = [""] * B

    def view(self, rows: torch.Tensor) -> BoundaryView:
        lengths = torch.tensor([len(t) for t in self.tokens], dtype=torch.int64)
        T = int(lengths.max()) if lengths.numel() else 0
        lp = torch.zeros(len(self.tokens), T, dtype=torch.float32)
        ent = None if self.ent is None else torch.zeros_like(lp)
        for i, vals in enumerate(self.logp):
            lp[i, : len(vals)] = torch.tensor(vals, dtype=torch.float32)
            if ent is not None and self.ent is not None:
                ent[i, : len(vals)] = torch.tensor(self.ent[i], dtype=torch.float32)
        return BoundaryView(rows=rows, lengths=lengths, status=self.status.clone(), logprobs=lp, entropies=ent,
                            hidden=None if self.hidden is None else self.hidden.clone())


def _final_norm(model):
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    norm = getattr(decoder, "norm", None)
    if norm is None:
        raise ValueError(f"early stopping with features=hidden reads the decoder's final norm; "
                         f"{type(model).__name__} has none: use cppo.early_stop.features=logprob or entropy")
    return norm


def _segment(model, ids, mask, cache, seg: int, params: SamplingParams, eos_id: int, pad_id: int):
    greedy = params.temperature == 0
    return model.generate(
        input_ids=ids, attention_mask=mask, past_key_values=cache, do_sample=not greedy,
        temperature=None if greedy else params.temperature, top_p=None if greedy else params.top_p,
        top_k=None if greedy else max(params.top_k, 0),
        repetition_penalty=None if params.repetition_penalty == 1.0 else params.repetition_penalty,
        max_new_tokens=seg, num_return_sequences=1, eos_token_id=eos_id, pad_token_id=pad_id,
        return_dict_in_generate=True, output_logits=True)


def _absorb(state: _Rows, live: torch.Tensor, new: torch.Tensor, logits: torch.Tensor, steps_hidden,
            eos_id: int, limit: int) -> None:
    """Append a segment's tokens of the ``live`` rows (stop at EOS), and mark the finished ones."""
    logp_all = torch.log_softmax(logits.float(), -1)  # [r, s, V]
    taken = logp_all.gather(2, new.unsqueeze(2)).squeeze(2)
    ent = -(logp_all.exp() * logp_all).sum(-1) if state.ent is not None else None
    for j, row in enumerate(live.tolist()):
        seq = new[j].tolist()
        cut = seq.index(eos_id) + 1 if eos_id in seq else len(seq)
        state.tokens[row] += seq[:cut]
        state.logp[row] += taken[j, :cut].tolist()
        if ent is not None and state.ent is not None:
            state.ent[row] += ent[j, :cut].tolist()
        if steps_hidden is not None and state.hidden is not None:
            state.hidden[row] = steps_hidden[min(cut, len(steps_hidden)) - 1][j]
        if eos_id in seq[:cut]:
            state.status[row], state.reasons[row] = _FINISHED, "stop"
        elif len(state.tokens[row]) >= limit:
            state.status[row], state.reasons[row] = _FINISHED, "length"


@torch.no_grad()
def generate_segmented(model, prompts: Sequence[Sequence[int]], params: SamplingParams, monitor: StopMonitor, *,
                       row_offset: int, pad_id: int, eos_id: int, device: torch.device
                       ) -> tuple[list[list[int]], list[str], list[torch.Tensor]]:
    """Sample ``params.n`` completions of each prompt in segments, stopping what ``monitor`` names.

    Args:
        prompts: the chunk's prompts (token ids); its rows are ``row_offset + i`` of the call.
        monitor: the ``StopMonitor`` (``segment_tokens``, ``entropies``, ``hidden``).

    Returns:
        (tokens, finish reasons, raw log-probs [len] float32) per completion, prompt-major.
    """
    n = params.n
    B = len(prompts) * n
    width = max(len(p) for p in prompts)
    ids = torch.full((B, width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, each prompt repeated n times (prompt-major)
        ids[i * n:(i + 1) * n, width - len(p):] = torch.tensor(p)
        mask[i * n:(i + 1) * n, width - len(p):] = 1
    state = _Rows(B, monitor.entropies)
    captured: list[torch.Tensor] = []
    hook = None
    if monitor.hidden:
        state.hidden = torch.zeros(B, int(model.config.hidden_size), dtype=torch.float32)
        hook = _final_norm(model).register_forward_hook(lambda _m, _i, out: captured.append(out[:, -1].float().cpu()))
    live = torch.arange(B)
    cur_ids, cur_mask, cache = ids.to(device), mask.to(device), None
    made = 0
    try:
        while live.numel():
            seg = min(monitor.segment_tokens, params.max_new_tokens - made)
            captured.clear()
            out = _segment(model, cur_ids, cur_mask, cache, seg, params, eos_id, pad_id)
            new = out.sequences[:, cur_ids.shape[1]:].cpu()
            # hidden of the token that produced each new token: the first forward is the prefill
            steps_hidden = captured[-new.shape[1]:] if monitor.hidden else None
            _absorb(state, live, new, torch.stack(out.logits, 1).cpu(), steps_hidden, eos_id, params.max_new_tokens)
            made += seg
            running = state.status[live] == _RUNNING
            if bool(running.any()):
                stop = monitor.on_boundary(made, state.view(torch.arange(B) + row_offset)).to(torch.bool)
                stop = stop & (state.status == _RUNNING)
                for row in stop.nonzero().squeeze(1).tolist():
                    state.status[row], state.reasons[row] = _STOPPED, "stopped"
            keep = (state.status[live] == _RUNNING).nonzero().squeeze(1)
            if keep.numel() == 0:
                break
            cache = out.past_key_values
            cache.batch_select_indices(keep.to(device))
            cur_ids = out.sequences[keep.to(device)]
            cur_mask = torch.cat([cur_mask, torch.ones(cur_mask.shape[0], new.shape[1], dtype=cur_mask.dtype,
                                                       device=device)], 1)[keep.to(device)]
            live = live[keep]
    finally:
        if hook is not None:
            hook.remove()
    return state.tokens, state.reasons, [torch.tensor(v, dtype=torch.float32) for v in state.logp]
