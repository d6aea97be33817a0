"""DefensiveKV and Layer-DefensiveKV (Feng et al., ICLR 2026, "Taming the Fragility of KV Cache
Eviction in LLM Inference"; ../shared/papers/defensivekv.txt).

Importance of entry ``i`` for window query ``j``: attention ``A[j, i]`` (max-pooled with ``kernel``)
times CriticalKV's value norm ``||v_i W_O||``. Defensive aggregation replaces the mean over the window
by the worst case, ``R~_i = max_j I[j, i]``, with an adaptive prior lower bound ``R_i = max(R~_i, mean_i R~_i)``
per head. With GQA the risk is the max over the group's heads. DefensiveKV selects per layer across
heads (B / L per layer); Layer-DefensiveKV divides the risks by the layer's ``sum_i ||v_i W_O||`` and
selects jointly over all layers (one global budget). The last ``window`` tokens are always kept.

One-shot (default) or streaming (risks refreshed from each chunk's window).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .scoring import max_pool, output_projections, value_norms
from .window import WindowPolicy, window_attention

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..cache.paged import PaddedView


@dataclass
class DefensiveKVPolicy(WindowPolicy):
    kernel: int = 7
    name: str = "defensivekv"
    budget_scope: str = "layer"
    layer_normalise: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        self._w_o = None

    def bind(self, model: PreTrainedModel) -> None:
        self._w_o = output_projections(model)

    def layer_scores(self, layer: int, query: torch.Tensor, view: PaddedView, query_pos: torch.Tensor) -> torch.Tensor:
        attn = max_pool(window_attention(query, view, query_pos, self.window), self.kernel)  # (B, H, G, W, L)
        vn = value_norms(view.values, None if self._w_o is None else self._w_o[layer])  # (B, H, G, L)
        imp = attn * vn[:, :, :, None]
        risk = imp.amax(3).amax(2)  # worst case over the window, then over the group
        ok = view.valid & (view.pos >= 0)
        prior = (risk * ok).sum(-1, keepdim=True) / ok.sum(-1, keepdim=True).clamp_min(1)
        risk = torch.maximum(risk, prior)
        if self.layer_normalise:
            # cross-layer normalisation: divide by the layer's total value norm
            risk = risk / (vn.amax(2) * ok).sum(dim=(1, 2), keepdim=True).clamp_min(1e-30)
        return risk


@dataclass
class LayerDefensiveKVPolicy(DefensiveKVPolicy):
    name: str = "layer_defensivekv"
    budget_scope: str = "global"
    layer_normalise: bool = True
