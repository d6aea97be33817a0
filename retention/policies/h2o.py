"""H2O (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference").

Score = attention each entry has accumulated from every query so far (summed over the query heads
of its KV group), ``score_i = sum_t sum_g A[g, t, i]``; the ``recent`` newest tokens are always kept
(the paper splits the budget evenly between heavy hitters and recent tokens; here ``recent`` is in
tokens, default 32). Budget per head.

Streaming: accumulation continues over chunks and turns (the paper's decode-time rule); one-shot
compresses once after the prefill with the accumulated prefill attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .base import EntryView, EvictionPolicy, protect
from .window import PositionStats, attention_mass, recent_mask

if TYPE_CHECKING:
    from ..cache.paged import PaddedView


@dataclass
class H2OPolicy(EvictionPolicy):
    recent: int = 32
    name: str = "h2o"
    mode: str = "streaming"
    budget_scope: str = "head"
    needs_queries: bool = True
    stats: PositionStats = field(default_factory=PositionStats, repr=False)

    def __post_init__(self) -> None:
        self.validate()
        if self.recent < 0:
            raise ValueError(f"recent must be >= 0 (newest tokens always kept), got {self.recent}")

    def observe(self, layer: int, query: torch.Tensor, view: PaddedView, query_pos: torch.Tensor) -> None:
        # every query of this forward, summed over the group's query heads and the queries
        self.stats.write(layer, attention_mass(query, view, query_pos), view, accumulate=True)

    def score(self, entries: EntryView) -> torch.Tensor:
        acc = self.stats.lookup(entries)
        return protect(acc, recent_mask(entries, self.recent))

    def reset(self) -> None:
        self.stats.reset()
