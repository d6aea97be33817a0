"""SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation").

Score = attention from the last ``window`` queries of the prompt (observation window, default 32),
summed over the window, averaged over the query heads of the KV group, then max-pooled along the
sequence with ``kernel`` (default 7) so neighbours of important tokens survive:
``score_i = maxpool_k( mean_g sum_{t in window} A[g, t, i] )``. The window itself is always kept.
Budget per head; attention is recomputed from the cached keys (no eager attention needed).

One-shot (the paper's setting, default): compress once after the prefill. Streaming: every chunk or
turn refreshes the scores from its own last ``window`` queries and compresses under the same budget.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .base import EntryView, EvictionPolicy
from .window import PositionStats, recent_mask, window_attention


def pooled_window_scores(query, view, query_pos, window: int, kernel: int) -> torch.Tensor:
    """``(B, H, L)``: window attention (sum over window, mean over group) max-pooled over entries."""
    attn = window_attention(query, view, query_pos, window).sum(3).mean(2)  # (B, H, L)
    if kernel > 1:
        B, H, L = attn.shape
        attn = F.max_pool1d(attn.reshape(B * H, 1, L), kernel, stride=1, padding=kernel // 2).reshape(B, H, L)
    return attn


@dataclass
class SnapKVPolicy(EvictionPolicy):
    window: int = 32
    kernel: int = 7
    name: str = "snapkv"
    budget_scope: str = "head"
    mode: str = "one_shot"
    needs_queries: bool = True
    stats: PositionStats = field(default_factory=PositionStats, repr=False)

    def __post_init__(self) -> None:
        self.validate()
        if self.window < 1 or self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"window must be >= 1 and kernel odd and >= 1, got window={self.window}, kernel={self.kernel}")

    def observe(self, layer, query, view, query_pos) -> None:
        if query.shape[2] == 1 and layer in self.stats.tables and self.mode == "one_shot":
            return  # decoding steps do not move one-shot scores
        self.stats.write(layer, pooled_window_scores(query, view, query_pos, self.window, self.kernel), view)

    def score(self, entries: EntryView) -> torch.Tensor:
        s = self.stats.lookup(entries)
        return torch.where(recent_mask(entries, self.window), torch.full_like(s, float("inf")), s)

    def reset(self) -> None:
        self.stats.reset()
