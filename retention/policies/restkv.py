"""ReST-KV (../shared/papers/restkv.txt: layer-wise output reconstruction with spatio-temporal smoothing).

For window query ``t`` and query head ``h``, deleting entry ``n`` changes the head's projected output
``o_t = sum_n A_t[n] v_n W_O^h`` by (local linear approximation, Eq. 7)
``I_t[n] = A_t[n] / (1 - A_t[n]) * ||o_t - v_n W_O^h||_2``: the attention weight, amplified, times how
hard the entry is to replace by the others. Temporal smoothing: an EMA over the window queries in order
(``alpha``). Spatial smoothing (AWS): the window is split into front and rear halves, the mean index of
each half's top-``b`` entries (``b`` = the per-head budget enforced at eviction) gives the drift ``dD``, and
scores are averaged over ``2 * floor(|dD| / beta) + 1`` neighbouring entries (centred; the paper also slides
this window by an offset, not modelled here; one width per layer and sequence, from its largest drift over
the heads). With GQA the score is the mean over the group's heads. Budgets per head; the window is always
kept (the paper's large constant Omega), so the drift's top-``b`` and the smoothing run over the entries
before it only, the candidates (as SnapKV's code scores ``attn[..., :-window]``).

The EMA and the two halves' mean scores are stored by position when the queries are seen; the drift and the
smoothing are applied when the cache scores for an eviction, after it has set the budget (a cache given its
budget only at :meth:`RetentionCache.compress`, as the evaluation harness does, smooths with that budget).

One-shot (default) or streaming (scores refreshed from each chunk's window).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .base import EntryView
from .scoring import output_projections, projected_values
from .window import PositionStats, WindowPolicy, window_attention, window_prefix

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


def mean_top_index(scores: torch.Tensor, cand: torch.Tensor, b: int) -> torch.Tensor:
    """``(R,)`` mean slot index of the ``min(b, #candidates)`` best candidates of each row of ``scores`` ``(R, L)``
    (``cand`` ``(R, L)`` bool; 0 for a row without candidates)."""
    k = cand.sum(-1).clamp_max(b)  # (R,)
    order = scores.masked_fill(~cand, float("-inf")).argsort(dim=-1, descending=True, stable=True)
    top = torch.arange(scores.shape[-1], device=scores.device)[None] < k[:, None]
    return (order.float() * top).sum(-1) / k.clamp_min(1).float()


def window_average(scores: torch.Tensor, cand: torch.Tensor, width: int) -> torch.Tensor:
    """``(R, L)``: each candidate's mean over the candidates among its ``width`` centred neighbours (slots);
    other entries keep their score."""
    if width <= 1:
        return scores
    R, L = scores.shape
    c = cand.float().reshape(R, 1, L)
    pool = lambda x: F.avg_pool1d(x, width, stride=1, padding=width // 2, count_include_pad=False)  # noqa: E731
    avg = (pool(scores.reshape(R, 1, L) * c) / pool(c).clamp_min(1e-30)).reshape(R, L)
    return torch.where(cand, avg, scores)


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
        self._per_head = 1  # b until the cache sets a budget
        # what AWS needs, by position: mean I over the window's front / rear half, and 1 for the candidates
        self._front, self._rear, self._cand = PositionStats(), PositionStats(), PositionStats()
        self._halves: dict[int, bool] = {}  # layer -> its last window had two halves (>= 2 queries)

    def bind(self, model: PreTrainedModel) -> None:
        self._w_o = output_projections(model)

    def set_budget(self, total: int, num_layers: int, num_heads: int) -> None:
        self._per_head = max(1, total // (num_layers * num_heads))

    def layer_scores(self, layer: int, query: torch.Tensor, view: PaddedView, query_pos: torch.Tensor) -> torch.Tensor:
        attn = window_attention(query, view, query_pos, self.window)  # (B, H, G, W, L)
        I = reconstruction_scores(attn, projected_values(view.values, self._w_o[layer])).mean(2)  # (B, H, W, L)
        W = I.shape[2]
        self._halves[layer] = W >= 2
        if W >= 2:  # kept for the adaptive window smoothing, which needs the budget (see adjust)
            self._front.write(layer, I[:, :, : W // 2].mean(2), view)
            self._rear.write(layer, I[:, :, W // 2 :].mean(2), view)
            self._cand.write(layer, window_prefix(view, query_pos, self.window).float(), view)
        return ema(I, self.alpha, dim=2)  # (B, H, L)

    def adjust(self, scores: torch.Tensor, entries: EntryView) -> torch.Tensor:
        """Adaptive window spatial smoothing of the EMA scores ``(R, Lpad)`` with the budget now enforced: ReST-KV
        estimates the drift from the top-``b`` entries with ``b`` the budget (restkv.txt, AWS), which the cache
        sets just before scoring, not when the queries were observed."""
        real = entries.valid & (entries.pos >= 0)
        cand = real & (self._cand.lookup(entries) > 0)  # a stale or unrecorded slot is no candidate
        front, rear = self._front.lookup(entries), self._rear.lookup(entries)
        out = scores.clone()
        for layer in entries.layer.unique().tolist():
            if not self._halves.get(layer, False):
                continue
            rows = (entries.layer == layer).nonzero().flatten()
            c = cand[rows]
            drift = (mean_top_index(rear[rows], c, self._per_head) - mean_top_index(front[rows], c, self._per_head))
            seq = entries.seq[rows]
            for s in seq.unique().tolist():  # one width per (layer, sequence): its largest drift over the heads
                mine = rows[seq == s]
                width = 2 * int(drift[seq == s].abs().max() / self.beta) + 1
                out[mine] = window_average(scores[mine], cand[mine], width)
        return out

    def select_batch(self, indices: torch.Tensor) -> None:
        super().select_batch(indices)
        for stats in (self._front, self._rear, self._cand):
            stats.select_batch(indices)

    def reset(self) -> None:
        super().reset()
        for stats in (self._front, self._rear, self._cand):
            stats.reset()
        self._halves.clear()
