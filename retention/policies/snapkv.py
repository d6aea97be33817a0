"""SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation").

Score = attention from the last ``window`` queries of the prompt (observation window, default 32),
summed over the window, averaged over the query heads of the KV group, then max-pooled along the
sequence with ``kernel`` (default 7) so neighbours of important tokens survive:
``score_i = maxpool_k( mean_g sum_{t in window} A[g, t, i] )`` over the entries before the window only
(the authors' code pools ``attn[..., -window:, :-window]``). The window itself is always kept.
Budget per head; attention is recomputed from the cached keys (no eager attention needed).

One-shot (the paper's setting, default): compress once after the prefill. Streaming: every chunk or
turn refreshes the scores from its own last ``window`` queries and compresses under the same budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .scoring import max_pool
from .window import WindowPolicy, window_attention, window_prefix

if TYPE_CHECKING:
    from ..cache.paged import PaddedView


def pooled_window_scores(query: torch.Tensor, view: PaddedView, query_pos: torch.Tensor, window: int,
                         kernel: int) -> torch.Tensor:
    """``(B, H, L)``: window attention (sum over window, mean over group) max-pooled over the entries before the
    window; the window's own entries (always kept) hold their unpooled sums."""
    scores = window_attention(query, view, query_pos, window).sum(3).mean(2)
    # SnapKV's code pools attn[..., -window:, :-window] (FasterDecoding/SnapKV snapkv_utils.py): the window's columns
    # are not pooled, so the kernel // 2 entries just before it do not inherit the window's own attention
    return max_pool(scores, kernel, within=window_prefix(view, query_pos, window))


@dataclass
class SnapKVPolicy(WindowPolicy):
    kernel: int = 7
    name: str = "snapkv"

    def layer_scores(self, layer: int, query: torch.Tensor, view: PaddedView, query_pos: torch.Tensor) -> torch.Tensor:
        return pooled_window_scores(query, view, query_pos, self.window, self.kernel)
