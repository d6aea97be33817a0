"""AdaKV (Feng et al., 2024, "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation"),
optionally with CriticalKV's value-norm scaling (Feng et al., 2025, "Identify Critical KV Cache in LLM
Inference from an Output Perturbation Perspective").

Scores are SnapKV's (window attention summed over the last ``window`` queries, mean over the GQA group,
max-pooled with ``kernel``); with ``value_norm`` each is multiplied by ``||v_i W_O||`` (mean over the
group's heads). Selection runs across all heads of a layer (``budget_scope="layer"``, B / L per layer), so
heads get adaptive budgets; a safeguard keeps at least ``alpha`` of the even per-head share in every head
(default 0.2). The observation window is always kept.

One-shot (the paper's setting, default) or streaming (scores refreshed each chunk / turn).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .base import EntryView
from .scoring import max_pool, output_projections, value_norms
from .window import WindowPolicy, window_attention

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..cache.paged import PaddedView


def safeguard(score: torch.Tensor, valid: torch.Tensor, keep: int) -> torch.Tensor:
    """Lift the ``keep`` best entries of every row above all others (still below the +inf window)."""
    if keep <= 0:
        return score
    finite = torch.where(valid & torch.isfinite(score), score, torch.full_like(score, -float("inf")))
    order = finite.argsort(dim=-1, descending=True, stable=True)
    top = torch.zeros_like(valid)
    top.scatter_(-1, order[:, :keep], True)
    lift = finite.masked_fill(~valid, 0).abs().max() + 1.0
    return torch.where(top & torch.isfinite(score), score + lift, score)


@dataclass
class AdaKVPolicy(WindowPolicy):
    kernel: int = 7
    alpha: float = 0.2
    value_norm: bool = False  # CriticalKV scaling by ||v W_O||
    name: str = "adakv"
    budget_scope: str = "layer"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.alpha <= 1:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")
        self._w_o = None
        self._per_head = 0

    def bind(self, model: PreTrainedModel) -> None:
        self._w_o = output_projections(model) if self.value_norm else None

    def set_budget(self, total: int, num_layers: int, num_heads: int) -> None:
        self._per_head = int(self.alpha * total / (num_layers * num_heads))

    def layer_scores(self, layer: int, query: torch.Tensor, view: PaddedView, query_pos: torch.Tensor) -> torch.Tensor:
        attn = window_attention(query, view, query_pos, self.window).sum(3)  # (B, H, G, L)
        if self.value_norm:
            attn = attn * value_norms(view.values, None if self._w_o is None else self._w_o[layer])
        return max_pool(attn.mean(2), self.kernel)

    def adjust(self, scores: torch.Tensor, entries: EntryView) -> torch.Tensor:
        return safeguard(scores, entries.valid, self._per_head)
