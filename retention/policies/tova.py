"""TOVA (Oren et al., 2024, "Transformers are Multi-State RNNs").

Score = attention of the newest query, averaged over all query heads of the layer:
``score_i = mean_h A[h, t, i]``; the same score for every KV head of a layer, and one budget per layer
(the paper evicts one token per layer per step, in every head at once).

Streaming: each eviction uses the attention of the last query seen (the paper's rule); one-shot
compresses once after the prefill with the prefill's last query.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .base import EntryView, EvictionPolicy
from .window import PositionStats, window_attention

if TYPE_CHECKING:
    from ..cache.paged import PaddedView


@dataclass
class TOVAPolicy(EvictionPolicy):
    name: str = "tova"
    mode: str = "streaming"
    budget_scope: str = "layer"
    needs_queries: bool = True
    stats: PositionStats = field(default_factory=PositionStats, repr=False)

    def __post_init__(self) -> None:
        self.validate()

    def observe(self, layer: int, query: torch.Tensor, view: PaddedView, query_pos: torch.Tensor) -> None:
        attn = window_attention(query, view, query_pos, window=1)[:, :, :, 0]  # (B, H, G, L)
        # the same token sits at different slots in different heads: average by position
        self.stats.write(layer, attn.mean(2), view)
        table = self.stats.tables[layer]
        self.stats.tables[layer] = table.mean(1, keepdim=True).expand_as(table).clone()

    def score(self, entries: EntryView) -> torch.Tensor:
        return self.stats.lookup(entries)

    def reset(self) -> None:
        self.stats.reset()
