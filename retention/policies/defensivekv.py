"""DefensiveKV and Layer-DefensiveKV (Feng et al., ICLR 2026, "Taming the Fragility of KV Cache
Eviction in LLM Inference"; ../shared/papers/defensivekv.txt), as the authors run them (FFY0/DefensiveKV,
``kvpress/presses/efficient_defensivekv_press.py`` and ``efficient_layer_defensivekv_press.py``).

Over the context before the observation window (the last ``window`` queries), per KV head:

1. Importance ``I[g, j, i]``: attention of query head ``g`` and window query ``j`` to entry ``i``, average-pooled
   along the entries (``kernel`` 5, zero padding) and rescaled so each query's total stays what it was.
2. Defensive aggregation: worst case ``R~_i = max_{g, j} I[g, j, i]``, then the adaptive prior
   ``R_i = max(R~_i, mean_i R~_i)``.
3. Value norm after the prior (the paper's ``R_i <- R_i x norm(v_i W_O)``), as the code applies it: ``R_i`` times
   the head's share of the position's norm over the layer's KV heads, ``n_h,i / sum_h' n_h',i`` with
   ``n = ||v_i W_O||_1`` (L1 through each query head's ``W_O``, mean over the group, as ``vwl1norm``).
4. CriticalKV's first stage: the entries with the most mean window attention, up to 90% of it (less the mean
   attention the code measures on the last ``window`` entries before the window, its ``window_bias``) and at most
   the per-head share less the window, take the layer's top score.

DefensiveKV selects per layer across heads (B / L per layer); Layer-DefensiveKV scores the same way and selects
jointly over all layers (one global budget). The paper describes its inter-layer normalisation as dividing by the
layer's ``sum_i norm(v_i W_O)`` and DefensiveKV as multiplying by the raw norm; both presses normalise over the KV
heads at each position instead, which is what runs here. The last ``window`` tokens are always kept.

One-shot (default) or streaming (risks refreshed from each chunk's window).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F

from .adakv import _layer_groups, l1_value_norms
from .base import EntryView, protect
from .scoring import output_projections
from .window import PositionStats, WindowPolicy, over_heads, recent_mask, window_attention, window_prefix

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..cache.paged import PaddedView


def avg_pool(scores: torch.Tensor, kernel: int) -> torch.Tensor:
    """Average-pool ``(..., L)`` along the entries with zero padding (``F.avg_pool1d``'s default), same length."""
    if kernel <= 1:
        return scores
    shape = scores.shape
    return F.avg_pool1d(scores.reshape(-1, 1, shape[-1]), kernel, stride=1, padding=kernel // 2).reshape(shape)


@dataclass
class DefensiveKVPolicy(WindowPolicy):
    kernel: int = 5  # efficient_defensivekv_press.py: average pooling, kernel_size=5
    name: str = "defensivekv"
    budget_scope: str = "layer"

    STAGE1_MASS: ClassVar[float] = 0.9  # CriticalKV's first stage as the DefensiveKV code runs it

    def __post_init__(self) -> None:
        super().__post_init__()
        self._w_o = None
        self._cap: int | None = None  # stage-1 entries per head: the per-head share less the window
        self.stage1 = PositionStats()  # 1 + the entry's rank in its head's stage-1 order; 0: not in stage 1

    def bind(self, model: PreTrainedModel) -> None:
        self._w_o = output_projections(model)

    def set_budget(self, total: int, num_layers: int, num_heads: int) -> None:
        # count.clamp_(max=int(q_len * (1 - compression_ratio) - window_size)): the per-head share less the window
        self._cap = max(total // (num_layers * num_heads) - self.window, 0)

    def observe(self, layer: int, query: torch.Tensor, view: PaddedView, query_pos: torch.Tensor) -> None:
        query, query_pos = self.window_queries(layer, query, query_pos)
        if query.shape[2] == 1 and layer in self.stats.tables and self.mode == "one_shot":
            return  # decoding steps do not move one-shot scores
        risk, tag = self._risk(layer, query, view, query_pos)
        self.stats.write(layer, risk, view)
        self.stage1.write(layer, tag, view)

    def layer_scores(self, layer: int, query: torch.Tensor, view: PaddedView, query_pos: torch.Tensor) -> torch.Tensor:
        return self._risk(layer, query, view, query_pos)[0]

    def _risk(self, layer: int, query: torch.Tensor, view: PaddedView,
              query_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(B, H, L)`` scores of the entries before the window (0 for the window's own) and stage-1 tags."""
        attn = window_attention(query, view, query_pos, self.window)  # (B, H, G, W, L)
        W = attn.shape[3]
        first = query_pos[:, -W]  # (B,) position of the first window query
        prefix = window_prefix(view, query_pos, self.window)  # the code scores keys[:-window] only
        p = prefix[:, :, None, None]
        a = attn * p
        base = a.sum(-1, keepdim=True)
        pooled = avg_pool(a, self.kernel) * p  # pooled over the prefix alone: the window acts as zero padding
        pooled = pooled / pooled.sum(-1, keepdim=True).clamp_min(1e-30) * base
        risk = pooled.amax(3).amax(2)  # worst case over the window queries and the group
        n = prefix.sum(-1, keepdim=True).clamp_min(1)
        risk = torch.maximum(risk, (risk * prefix).sum(-1, keepdim=True) / n)  # adaptive prior, per head
        norm = l1_value_norms(view.values, None if self._w_o is None else self._w_o[layer]) * prefix
        # after the prior, as the paper's "R_i <- R_i x norm(v_i W_O)"; the code of both presses multiplies by each
        # head's share of the norm at that position, WoV_norm / WoV_norm.sum(over the layer's KV heads): scores
        # comparable across heads and layers (the paper's Layer-DefensiveKV normalisation, in both)
        return risk * norm / over_heads(norm, view).clamp_min(1e-30), self._stage1_tags(attn, view, prefix, first)

    def _stage1_tags(self, attn: torch.Tensor, view: PaddedView, prefix: torch.Tensor,
                     first: torch.Tensor) -> torch.Tensor:
        """CriticalKV's first stage as efficient_defensivekv_press.py runs it: entries by mean window attention
        (mean over the group and the window, normalised over the prefix), kept while the cumulative share stays
        below 0.9 - window_bias. Returns ``(B, H, L)`` float: 1 + rank for those entries, 0 elsewhere."""
        W = attn.shape[3]
        ave = (attn * prefix[:, :, None, None]).mean(dim=(2, 3))
        ave = ave / ave.sum(-1, keepdim=True).clamp_min(1e-30)
        # window_bias: the code's mean attention (over heads and window queries) on the last window_size keys of
        # the prefix (it slices attn_weights[..., -window_size:] after dropping the window's own keys)
        last = prefix & (view.pos >= (first - W)[:, None, None])
        bias = (attn * last[:, :, None, None]).sum(-1).mean(dim=(1, 2, 3))  # (B,)
        key = torch.where(prefix, ave, torch.full_like(ave, -1.0))
        sorted_ave, order = key.sort(dim=-1, descending=True, stable=True)
        covered = (sorted_ave.clamp_min(0).cumsum(-1) < (self.STAGE1_MASS - bias)[:, None, None]) & (sorted_ave >= 0)
        rank = torch.arange(ave.shape[-1], device=ave.device, dtype=torch.float32).expand_as(ave)
        tag = torch.zeros_like(ave).scatter(-1, order, torch.where(covered, rank + 1, torch.zeros_like(rank)))
        return tag

    def score(self, entries: EntryView) -> torch.Tensor:
        recent = recent_mask(entries, self.window)
        s = self.stats.lookup(entries)
        if self._cap:
            tag = self.stage1.lookup(entries)
            prefix = entries.valid & (entries.pos >= 0) & ~recent
            stage1 = prefix & (tag > 0) & (tag <= self._cap)
            # the code gives stage-1 entries scores.max(): the layer's top score (all its heads)
            group = _layer_groups(entries)
            masked = torch.where(prefix, s, torch.full_like(s, -float("inf"))).amax(-1)
            top = torch.full((int(group.max()) + 1,), -float("inf"), device=s.device)
            top = top.scatter_reduce(0, group, masked, reduce="amax")
            s = torch.where(stage1, top[group][:, None].expand_as(s), s)
        return protect(s, recent)

    def select_batch(self, indices: torch.Tensor) -> None:
        super().select_batch(indices)
        self.stage1.select_batch(indices)

    def reset(self) -> None:
        super().reset()
        self.stage1.reset()


@dataclass
class LayerDefensiveKVPolicy(DefensiveKVPolicy):
    name: str = "layer_defensivekv"
    budget_scope: str = "global"
