"""HF transformers ``generate`` as a rollout engine (the default, CPU or CUDA)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Sequence

import torch

from .base import RolloutEngine, RolloutResult, SamplingParams, StopMonitor, check_prompts
from .hf_segments import generate_segmented

_MAX_LOGIT_ELEMENTS = 3e8  # beyond this, returning sampler log-probs would exhaust memory


class HFEngine(RolloutEngine):
    """Samples with ``model.generate``. With ``shared=True`` the engine generates with the
    training policy object itself (no weight copy needed); otherwise it owns a copy that
    ``update_weights`` refreshes."""

    name = "hf"

    def __init__(self, model, *, pad_id: int, eos_id: int, device: torch.device, max_batch_sequences: int = 4096,
                 shared: bool = True) -> None:
        self.model = model
        self.pad_id, self.eos_id = pad_id, eos_id
        self.device = device
        self.max_batch_sequences = max_batch_sequences
        self.shared = shared

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 monitor: StopMonitor | None = None) -> RolloutResult:
        """``monitor``: generate in segments and stop what it names (``hf_segments``); the
        sampler log-probs are then always the raw ones."""
        check_prompts(prompts)
        t0 = time.perf_counter()
        chunk = max(1, self.max_batch_sequences // params.n)
        tokens: list[list[int]] = []
        reasons: list[str] = []
        logprobs: list[torch.Tensor] | None = [] if params.logprobs else None
        was_training = self.model.training
        self.model.eval()
        # a seeded call draws from its own stream and leaves the global RNG as it was
        rng = contextlib.nullcontext() if params.seed is None else torch.random.fork_rng(
            devices=[self.device] if self.device.type == "cuda" else [])
        try:
            with rng:
                if params.seed is not None:
                    torch.manual_seed(params.seed)
                for start in range(0, len(prompts), chunk):
                    if monitor is None:
                        self._generate_chunk(prompts[start : start + chunk], params, tokens, reasons, logprobs)
                        continue
                    self._check_logit_budget(min(chunk, len(prompts) - start) * params.n, monitor.segment_tokens)
                    toks, why, lps = generate_segmented(
                        self.model, prompts[start : start + chunk], params, monitor, row_offset=start * params.n,
                        pad_id=self.pad_id, eos_id=self.eos_id, device=self.device)
                    tokens += toks
                    reasons += why
                    if logprobs is not None:
                        logprobs += lps
        finally:
            self.model.train(was_training)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        index = torch.arange(len(prompts)).repeat_interleave(params.n)
        return RolloutResult(index, tokens, reasons, logprobs, time.perf_counter() - t0)

    def _generate_chunk(self, prompts, params, tokens, reasons, logprobs) -> None:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding: generation continues every row at the end
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        greedy = params.temperature == 0
        want_logits = logprobs is not None
        if want_logits:
            self._check_logit_budget(len(prompts) * params.n, params.max_new_tokens)
        out = self.model.generate(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            do_sample=not greedy,
            temperature=None if greedy else params.temperature,
            top_p=None if greedy else params.top_p,
            top_k=None if greedy else max(params.top_k, 0),
            repetition_penalty=None if params.repetition_penalty == 1.0 else params.repetition_penalty,
            max_new_tokens=params.max_new_tokens,
            num_return_sequences=params.n,
            eos_token_id=self.eos_id,
            pad_token_id=self.pad_id,
            return_dict_in_generate=True,
            output_logits=want_logits and params.logprobs_mode == "raw",
            output_scores=want_logits and params.logprobs_mode == "processed",
        )
        gen = out.sequences[:, width:].cpu()
        if want_logits:
            # raw: untempered logits, the policy's own log-probs as the trainer computes them;
            # processed: the scores after temperature/top-k/top-p, the distribution sampled from
            steps = out.logits if params.logprobs_mode == "raw" else out.scores
            step_logp = torch.stack([torch.log_softmax(s.float(), -1) for s in steps], 1).cpu()
        for row in range(gen.shape[0]):
            seq = gen[row].tolist()
            if self.eos_id in seq:
                cut = seq.index(self.eos_id) + 1
                reasons.append("stop")
            else:
                cut = len(seq)
                reasons.append("length")
            tokens.append(seq[:cut])
            if want_logits:
                t = torch.tensor(seq[:cut], dtype=torch.long)
                logprobs.append(step_logp[row, torch.arange(cut), t])

    def _check_logit_budget(self, rows: int, steps: int) -> None:
        vocab = self.model.get_output_embeddings().weight.shape[0]
        if rows * steps * vocab > _MAX_LOGIT_ELEMENTS:
            raise ValueError(f"sampler log-probs from HF generate would hold {rows * steps * vocab:.2e} logits; "
                             "lower rollout.max_batch_sequences (or cppo.early_stop.segment_tokens)")

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.shared:
            return  # generates with the training policy itself: already current
        state = dict(named_tensors)
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        missing = [m for m in missing if not m.endswith("lm_head.weight") or not self.model.config.tie_word_embeddings]
        if missing or unexpected:
            raise ValueError(f"weight sync: missing {missing[:5]}, unexpected {unexpected[:5]}")
