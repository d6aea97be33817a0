"""Random eviction: the sanity floor. Scores are uniform noise from a seeded generator."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import EntryView, EvictionPolicy


@dataclass
class RandomPolicy(EvictionPolicy):
    """Keeps a random subset of the budget's size (per head by default, like the fixed-budget baselines).

    Streaming: each eviction draws fresh noise (seeded by ``seed`` and the step), so survivors of one
    round are not favoured in the next.
    """

    seed: int = 0
    name: str = "random"
    mode: str = "streaming"
    budget_scope: str = "head"

    def __post_init__(self) -> None:
        self.validate()

    def score(self, entries: EntryView) -> torch.Tensor:
        g = torch.Generator(device="cpu").manual_seed(self.seed * 1_000_003 + int(entries.step.max()))
        return torch.rand(entries.log_beta.shape, generator=g).to(entries.log_beta.device)
