"""AdaKV (Feng et al., 2024, "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation"),
optionally with CriticalKV's two-stage selection (Feng et al., 2025, "Identify Critical KV Cache in LLM
Inference from an Output Perturbation Perspective"; the authors' ``CriticalAdaKVPress``, FFY0/DefensiveKV
``kvpress/presses/criticalkv_press.py``).

Scores are SnapKV's (window attention summed over the last ``window`` queries, mean over the GQA group,
max-pooled with ``kernel``). Selection runs across all heads of a layer (``budget_scope="layer"``, B / L per
layer), so heads get adaptive budgets; a safeguard keeps at least ``alpha`` of the even per-head share in every
head (default 0.2), the observation window counting first (it holds the top score in the authors' kvpress AdaKV).
The observation window is always kept.

CriticalKV (``value_norm``): the heads' budgets come from AdaKV's allocation on the attention scores; then each
head keeps the top ``first_stage_ratio`` (0.5) of its budget by attention alone (stage 1) and fills the rest by
``(score + eps) * ||v_i W_O||_1`` (stage 2: the L1 norm of the value through each query head's ``W_O``, mean over
the group; ``score`` the attention averaged over the window; ``eps = 1e-4``).

One-shot (the paper's setting, default) or streaming (scores refreshed each chunk / turn).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from .base import EntryView, protect
from .scoring import max_pool, output_projections
from .window import PositionStats, WindowPolicy, recent_mask, window_attention, window_prefix

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..cache.paged import PaddedView


def safeguard(score: torch.Tensor, valid: torch.Tensor, keep: int, first: torch.Tensor | None = None) -> torch.Tensor:
    """Lift the ``keep`` best entries of every row ``(R, Lpad)`` above all others (still below the +inf window).

    ``first`` ``(R, Lpad)`` bool: entries that take the floor's places before any other (the observation window,
    which the authors' kvpress AdaKV scores with the layer's maximum, so it counts toward the floor)."""
    if keep <= 0:
        return score
    ok = valid & torch.isfinite(score)
    finite = torch.where(ok, score, torch.full_like(score, -float("inf")))
    key = finite if first is None else torch.where(first & valid, torch.full_like(score, float("inf")), finite)
    order = key.argsort(dim=-1, descending=True, stable=True)
    top = torch.zeros_like(valid)
    top.scatter_(-1, order[:, :keep], True)
    lift = torch.where(ok, score, torch.zeros_like(score)).abs().max() + 1.0
    return torch.where(top & ok, score + lift, score)


def l1_value_norms(values: torch.Tensor, w_o: torch.Tensor | None) -> torch.Tensor:
    """``||v_i W_O^h||_1`` averaged over each KV head's query heads (the authors' ``vwl1norm``): values
    ``(B, H, L, D)``, ``w_o`` ``(Hq, D, hidden)`` -> ``(B, H, L)`` float32; without ``W_O``, ``||v_i||_1``."""
    v = values.float()
    if w_o is None:
        return v.abs().sum(-1)
    H = v.shape[1]
    w = w_o.reshape(H, w_o.shape[0] // H, w_o.shape[1], -1).to(v.device)  # (H, G, D, hidden)
    # one query head at a time: the (B, H, L, hidden) projection is the largest tensor held
    return torch.stack([torch.einsum("bhld,hde->bhle", v, w[:, g]).abs().sum(-1) for g in range(w.shape[1])]).mean(0)


def _ranks(key: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """Rank ``(R, Lpad)`` of each entry in its row group, ties to the newest (the cache's own order)."""
    from ..cache.select import rank_in_groups  # the cache package imports the policies

    return rank_in_groups(key, pos, valid, group)


def _layer_groups(entries: EntryView) -> torch.Tensor:
    """``(R,)`` int64: one group per (sequence, layer) of the rows, numbered 0..G-1."""
    key = entries.seq.long() * (int(entries.layer.max()) + 1 if entries.layer.numel() else 1) + entries.layer.long()
    return torch.unique(key, return_inverse=True)[1]


@dataclass
class AdaKVPolicy(WindowPolicy):
    kernel: int = 7
    alpha: float = 0.2
    value_norm: bool = False  # CriticalKV: two-stage selection with ||v W_O||_1 (stage 2)
    name: str = "adakv"
    budget_scope: str = "layer"

    # CriticalKV's constants as its authors run them (CriticalAdaKVPress: first_stage_ratio=0.5, epsilon=1e-4)
    FIRST_STAGE_RATIO: ClassVar[float] = 0.5
    EPSILON: ClassVar[float] = 1e-4

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.alpha <= 1:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")
        self._w_o = None
        self._per_head = 0  # safeguard floor per head
        self._layer_budget: int | None = None
        self.norms = PositionStats()  # CriticalKV: ||v_i W_O||_1 by position

    def bind(self, model: PreTrainedModel) -> None:
        self._w_o = output_projections(model) if self.value_norm else None

    def set_budget(self, total: int, num_layers: int, num_heads: int) -> None:
        self._layer_budget = total // num_layers  # the cache's even split across layers
        # kvpress AdaKV: n_safe = int(alpha * n_kept) of the per-head share n_kept (window included)
        self._per_head = int(self.alpha * (self._layer_budget // num_heads))

    def layer_scores(self, layer: int, query: torch.Tensor, view: PaddedView, query_pos: torch.Tensor) -> torch.Tensor:
        attn = window_attention(query, view, query_pos, self.window).sum(3)  # (B, H, G, L)
        if self.value_norm:
            # CriticalKV adds eps to SnapKV's window *mean* (kvpress SnapKVPress): keep that scale for stage 2
            attn = attn / min(self.window, query.shape[2])
            self.norms.write(layer, l1_value_norms(view.values, None if self._w_o is None else self._w_o[layer]), view)
        s = attn.mean(2)
        # AdaKV's code pools the prefix's scores alone (calcul_attn_sore slices [..., :-window] before pooling), so
        # no entry borrows the window's attention; the window's own scores never decide anything (it counts first)
        prefix = window_prefix(view, query_pos, self.window)
        pooled = max_pool(s.masked_fill(~prefix, -float("inf")), self.kernel)
        return torch.where(prefix, pooled, s)

    def score(self, entries: EntryView) -> torch.Tensor:
        recent = recent_mask(entries, self.window)
        raw = self.stats.lookup(entries)
        # a left-padded row's padding slots (pos -1) look up position 0's score and sit before it: counted as valid,
        # they took the floor's places before any real entry (the cache drops them at eviction)
        real = entries.valid & (entries.pos >= 0)
        s = safeguard(raw, real, self._per_head, first=recent)
        if self.value_norm and self._layer_budget is not None:
            s = self._critical(raw, s, entries, recent)
        return protect(s, recent)

    def _critical(self, raw: torch.Tensor, s: torch.Tensor, entries: EntryView, recent: torch.Tensor) -> torch.Tensor:
        """CriticalKV's two stages on the attention scores ``raw`` and their safeguarded version ``s`` ``(R, Lpad)``:
        the returned scores put each head's selection (its AdaKV budget) above everything else, so the cache's
        top-B per layer keeps exactly it."""
        valid = entries.valid & (entries.pos >= 0)
        rows = torch.arange(s.shape[0], device=s.device)
        inf = torch.full_like(s, float("inf"))
        # budget allocation (AdaKV): each head's count in the layer's top-B of the safeguarded scores, window first
        sg = torch.where(recent, inf, s)
        budget = (valid & (_ranks(sg, entries.pos, valid, _layer_groups(entries)) < self._layer_budget)).sum(-1)
        # stage 1: the top first_stage_ratio of each head's budget by attention alone (criticalkv_press.py)
        stage1 = valid & (_ranks(sg, entries.pos, valid, rows) < (budget * self.FIRST_STAGE_RATIO).long()[:, None])
        # stage 2: the rest by (score + eps) * ||v W_O||_1 (criticalkv_press.py, CriticalAdaKVPress)
        lifted = s != raw  # the safeguard's floor (kvpress gives it the top score too)
        s2 = (raw + self.EPSILON) * self.norms.lookup(entries)
        key = torch.where(stage1 | lifted | recent, inf, s2)
        chosen = valid & (_ranks(key, entries.pos, valid, rows) < budget[:, None])
        top = torch.where(valid, s2, torch.zeros_like(s2)).abs().max() + 1.0
        return torch.where(chosen, torch.where(torch.isinf(key), 2 * top, s2 + top), s2)

    def select_batch(self, indices: torch.Tensor) -> None:
        super().select_batch(indices)
        self.norms.select_batch(indices)

    def reset(self) -> None:
        super().reset()
        self.norms.reset()
