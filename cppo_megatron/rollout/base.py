"""The rollout engine interface the trainer uses."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

# the generation engines (``rollout.engine``); build_engine in __init__ makes them
ENGINES = ("hf", "vllm")


LOGPROBS_MODES = ("raw", "processed")


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1  # completions per prompt (G)
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    max_new_tokens: int = 8
    logprobs: bool = False  # also return the sampler's log-prob of each generated token
    top_k: int = 0  # 0 = off (veRL and vLLM say -1)
    repetition_penalty: float = 1.0
    # "raw": log-softmax of the model's logits (the policy's own log-probs, what the trainer
    # computes); "processed": after temperature/top-k/top-p, the distribution actually
    # sampled from (vLLM's and veRL's default, `processed_logprobs`)
    logprobs_mode: str = "raw"
    # None: the engine's own random stream (the global torch RNG for HF, vLLM's engine
    # seed); an int: the same prompts with the same seed give the same samples, across
    # restarts too, without any engine state to save
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k must be >= -1 (0 or -1: off), got {self.top_k}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"SamplingParams.repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"SamplingParams.logprobs_mode must be one of {LOGPROBS_MODES}, "
                             f"got {self.logprobs_mode!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.seed is not None and not 0 <= self.seed < 1 << 63:
            raise ValueError(f"SamplingParams.seed must be in [0, 2**63) or None, got {self.seed}")


# a completion's finish reason: EOS ("stop"), the length limit ("length"), or stopped early by a
# ``StopMonitor`` ("stopped": its remaining tokens were never generated)
FINISH_REASONS = ("stop", "length", "stopped")


@dataclass(frozen=True)
class BoundaryView:
    """What an engine hands a ``StopMonitor`` at a segment boundary, for the rows of one
    generate call it is running together (a chunk of whole groups).

    rows: [R] int64 indices into the call's P x n completions (prompt-major). lengths: [R]
    int64 tokens generated so far. status: [R] int64 ``core.early_stop`` RUNNING / FINISHED /
    STOPPED. logprobs: [R, T] float32 raw log-probs of the sampled tokens (row r read in
    ``[:lengths[r]]``). entropies: [R, T] float32 per-token entropies of the policy's
    distribution, when the monitor asks for them. hidden: [R, D] float32 the policy's last
    hidden state at each row's last token, when the monitor asks for it."""

    rows: torch.Tensor
    lengths: torch.Tensor
    status: torch.Tensor
    logprobs: torch.Tensor
    entropies: torch.Tensor | None = None
    hidden: torch.Tensor | None = None


class StopMonitor(Protocol):
    """Decides, at each segment boundary of a generate call, which running completions to stop
    (the trainer's early stopping, ``trainer/early_stop.py``). An engine given one generates in
    segments of ``segment_tokens`` and calls ``on_boundary`` after each segment but the last."""

    segment_tokens: int
    entropies: bool  # the engine must fill BoundaryView.entropies
    hidden: bool  # the engine must fill BoundaryView.hidden

    def on_boundary(self, tokens: int, view: BoundaryView) -> torch.Tensor:
        """[R] bool: rows of ``view`` to stop now (only RUNNING ones)."""
        ...


@dataclass
class RolloutResult:
    """Completions for P prompts x n samples, grouped prompt-major (all samples of prompt 0
    first). ``tokens[i]`` ends with EOS when ``finish_reasons[i] == "stop"``; a completion
    stopped early by a ``StopMonitor`` (``"stopped"``) holds the tokens generated until then."""

    prompt_index: torch.Tensor  # [P * n] which prompt each completion answers
    tokens: list[list[int]]
    finish_reasons: list[str]
    logprobs: list[torch.Tensor] | None = None  # per completion: [len] sampler log-probs
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def lengths(self) -> list[int]:
        return [len(t) for t in self.tokens]

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    def metrics(self, prefix: str = "rollout/") -> dict[str, float]:
        lengths = self.lengths
        n = max(len(lengths), 1)
        return {
            f"{prefix}completions": float(len(lengths)),
            f"{prefix}tokens": float(self.num_tokens),
            f"{prefix}mean_length": self.num_tokens / n,
            f"{prefix}max_length": float(max(lengths, default=0)),
            f"{prefix}truncated_ratio": sum(r == "length" for r in self.finish_reasons) / n,
            f"{prefix}stopped_ratio": sum(r == "stopped" for r in self.finish_reasons) / n,
            f"{prefix}tokens_per_s": self.num_tokens / self.seconds if self.seconds > 0 else 0.0,
        }


def check_prompts(prompts: Sequence[Sequence[int]], max_len: int | None = None, max_new_tokens: int = 0) -> None:
    """Every engine's input check: at least one prompt, none empty, each fits ``max_len``
    (prompt + ``max_new_tokens``) when the engine has such a limit."""
    if not prompts:
        raise ValueError("generate: no prompts")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"generate: prompt {i} is empty")
        if max_len is not None and len(p) + max_new_tokens > max_len:
            raise ValueError(
                f"generate: prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} it "
                f"exceeds the engine's max_model_len={max_len} (model.max_position)"
            )


def mix_seed(*parts: int) -> int:
    """A seed in [0, 2**62) derived from integers (a run seed, a step, a rank, a prompt
    index...): streams for different tuples are unrelated, and equal tuples agree on
    every rank and across restarts. 2**62 leaves room for vLLM's per-sample ``seed + i``."""
    h = 0x9E3779B97F4A7C15
    for x in parts:
        if not isinstance(x, int) or isinstance(x, bool):
            raise TypeError(f"mix_seed: parts must be ints, got {x!r}")
        h = (h ^ (x + 0x632BE59BD9B4E019)) * 0xBF58476D1CE4E5B9 % (1 << 64)
        h ^= h >> 31
    return h % (1 << 62)


class RolloutEngine:
    """Generates completions with the current policy weights."""

    name = "base"

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 monitor: StopMonitor | None = None) -> RolloutResult:
        """``monitor``: generate in segments and stop the completions it names (early stopping)."""
        raise NotImplementedError

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new policy weights (HF parameter names)."""
        raise NotImplementedError

    def close(self) -> None:
        pass
