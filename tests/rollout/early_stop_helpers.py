"""A planted ``StopMonitor`` for the engines' early-stopping tests (HF and vLLM)."""

from __future__ import annotations

import torch


class PlantedMonitor:
    """Stops exactly the rows named per boundary (``stop_at``: {tokens: {row, ...}}) and keeps every
    view it was shown."""

    def __init__(self, segment_tokens: int, stop_at: dict[int, set[int]] | None = None, *,
                 entropies: bool = False, hidden: bool = False) -> None:
        self.segment_tokens = segment_tokens
        self.entropies, self.hidden = entropies, hidden
        self.stop_at = stop_at or {}
        self.calls: list[tuple[int, object]] = []

    def on_boundary(self, tokens: int, view) -> torch.Tensor:
        self.calls.append((tokens, view))
        named = self.stop_at.get(tokens, set())
        return torch.tensor([int(r) in named for r in view.rows.tolist()], dtype=torch.bool)
