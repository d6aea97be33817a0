"""Full cache: no eviction (the quality ceiling every method is compared with)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import EntryView, EvictionPolicy


@dataclass
class FullCachePolicy(EvictionPolicy):
    """Keeps every entry whatever the budget; one-shot and streaming are the same."""

    name: str = "full"
    mode: str = "streaming"
    evicts: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def score(self, entries: EntryView) -> torch.Tensor:
        return torch.zeros_like(entries.log_beta)
