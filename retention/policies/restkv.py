"""ReST-KV (../shared/papers/restkv.txt: layer-wise output reconstruction with spatio-temporal smoothing).

For window query ``t`` and query head ``h``, deleting entry ``n`` changes the head's projected output
``o_t = sum_n A_t[n] v_n W_O^h`` by (local linear approximation, Eq. 7)
``I_t[n] = A_t[n] / (1 - A_t[n]) * ||o_t - v_n W_O^h||_2``: the attention weight, amplified, times how
hard the entry is to replace by the others. Temporal smoothing: an EMA over the window queries in order
(``alpha``). Spatial smoothing (AWS): the window is split into front and rear halves, the mean index of
each half's top-``b`` entries (``b`` = the per-head budget) gives the drift ``dD``, and scores are
averaged over ``2 * floor(|dD| / beta) + 1`` neighbouring entries (centred; the paper also slides this
window by an offset, not modelled here). With GQA the score is the mean over the group's heads.
Budgets per head; the window is always kept (the paper's large constant Omega).

One-shot (default) or streaming (scores refreshed from each chunk's window).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .scoring import output_projections, projected_values
from .window import WindowPolicy, window_attention

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..cache.paged import PaddedView


def reconstruction_scores(attn: torch.Tensor, vw: torch.Tensor) -> torch.Tensor:
    """``I`` ``(B, H, G, W, L)`` from attention ``(B, H, G, W, L)`` and projected values ``(B, H, G, L, E)``."""
    o = torch.einsum("bhgwl,bhgle->bhgwe", attn, vw)  # each window query's head output
    dist2 = (o.square().sum(-1)[..., None] - 2 * torch.einsum("bhgwe,bhgle->bhgwl", o, vw)
             + vw.square().sum(-1)[:, :, :, None, :])
    return attn / (1 - attn).clamp_min(1e-6) * dist2.clamp_min(0).sqrt()


def ema(scores: torch.Tensor, alpha: float, dim: int) -> torch.Tensor:
    """EMA along ``dim`` (oldest first), returning the last value."""
    out = scores.select(dim, 0)
    for t in range(1, scores.shape[dim]):
        out = alpha * scores.select(dim, t) + (1 - alpha) * out
    return out


@dataclass
class ReSTKVPolicy(WindowPolicy):
    alpha: float = 0.5
    beta: float = 8.0
    name: str = "restkv"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.alpha <= 1 or self.beta <= 0:
            raise ValueError(f"alpha must be in (0, 1] and beta > 0, got {self.alpha}, {self.beta}")
        self._w_o = None
        self._per_head = 1

    def bind(self, model: PreTrainedModel) -> None:
        self._w_o = output_projections(model)

    def set_budget(self, total: int, num_layers: int, num_heads: int) -> None:
        self._per_head = max(1, total // (num_layers * num_heads))

    def layer_scores(self, layer: int, query: torch.Tensor, view: PaddedView, query_pos: torch.Tensor) -> torch.Tensor:
        attn = window_attention(query, view, query_pos, self.window)  # (B, H, G, W, L)
        I = reconstruction_scores(attn, projected_values(view.values, self._w_o[layer])).mean(2)  # (B, H, W, L)
        smooth = ema(I, self.alpha, dim=2)  # (B, H, L)
        W = I.shape[2]
        if W >= 2:  # adaptive window spatial smoothing
            k = min(self._per_head, I.shape[-1])
            idx = lambda s: s.topk(k, dim=-1).indices.float().mean(-1)  # noqa: E731
            drift = (idx(I[:, :, W // 2 :].mean(2)) - idx(I[:, :, : W // 2].mean(2))).abs().max()
            width = 2 * int(drift / self.beta) + 1
            if width > 1:
                B, H, L = smooth.shape
                smooth = F.avg_pool1d(smooth.reshape(B * H, 1, L), width, stride=1, padding=width // 2,
                                      count_include_pad=False).reshape(B, H, L)
        return smooth
