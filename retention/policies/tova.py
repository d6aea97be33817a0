"""TOVA (Oren et al., 2024, "Transformers are Multi-State RNNs").

Score = attention of the newest query, averaged over all query heads of the layer:
``score_i = mean_h A[h, t, i]`` (over the query heads whose KV head holds the token: a layer budget that is not a
multiple of the KV heads keeps its last position in some of them only); the same score for every KV head of a
layer, and one budget per layer (the paper evicts one token per layer per step, in every head at once).

Streaming: each eviction uses the attention of the last query seen (the paper's rule); one-shot
compresses once after the prefill with the prefill's last query.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .base import EntryView, EvictionPolicy
from .window import PositionStats, over_heads, window_attention

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
        attn = window_attention(query, view, query_pos, window=1)[:, :, :, 0].mean(2)  # (B, H, L): mean over G
        # the same token sits at different slots in different heads, and a layer budget that is not a multiple of H
        # keeps its last position in some heads only: average each position over the heads that hold it (a mean of
        # the whole table mixed in the score an earlier observation left for the heads that had dropped it)
        self.stats.write(layer, over_heads(attn, view, mean=True), view)

    def score(self, entries: EntryView) -> torch.Tensor:
        return self.stats.lookup(entries)

    def reset(self) -> None:
        self.stats.reset()
