"""LAVa (Shen et al., 2025, "LAVa: Layer-wise KV Cache Eviction with Dynamic Budget Allocation";
../shared/papers/lava.txt).

Score (Eq. 5): ``s_{l,h}[i] = max_k ||V_{l,h}[k]||_1 / w * sum_{j in window} A^j_{l,h}[i]``, max-pooled
(``kernel``, as in its implementation); with GQA the score of a KV entry is the max over the query
heads of its group. Eviction is layer-wise across heads (dynamic head budgets). Layer budgets are
dynamic (Eq. 6-7): ``B_l = e_l / sum e * B`` with ``e_l`` the entropy of the layer's normalised scores
divided by ``H * N``, each sequence of a batch on its own scores; the shares are whole entries summing to ``B``
(the remainder to the largest fractions), and a layer whose share passes the entries it holds keeps them all and
hands the rest to the others in proportion to their ``e_l``. The last ``window`` tokens are always kept.
Scores, pooling, ``max_k`` and the entropy cover the ``N`` entries before the window only (Algorithm 1 scores
``i not in [N - w, N]``; the authors' code, MGDDestiny/Lava ``snapkv_utils.py``, slices ``attn[..., :-window]``
and ``value_states[..., :-window, :]``).

One-shot (default): compress once after the prefill. Streaming: scores and layer entropies are
refreshed from each chunk's window and the cache is compressed under the same total budget (the
paper's layer-by-layer recompression during prefill is this with one chunk per layer pass).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .scoring import max_pool
from .window import SequenceStats, WindowPolicy, round_to_total, window_attention, window_prefix

if TYPE_CHECKING:
    from ..cache.paged import PaddedView


def proportional_shares(weights: torch.Tensor, total: int, cap: torch.Tensor | None = None) -> torch.Tensor:
    """``(L,)`` int64 shares of ``total`` in proportion to ``weights`` ``(L,)`` (> 0), each at most ``cap[l]``
    (``None``: no cap): a capped part keeps its cap and the others share the rest in proportion. Rounded down with
    the remainder one each to the largest fractions (lower parts first), so they sum to ``min(total, sum cap)``."""
    w = weights.double()
    cap = torch.full_like(w, float("inf")) if cap is None else cap.double()
    exact, fixed = torch.zeros_like(w), torch.zeros_like(w, dtype=torch.bool)
    while not bool(fixed.all()):
        free = ~fixed
        exact[free] = w[free] / w[free].sum() * (total - float(cap[fixed].sum()))
        over = free & (exact >= cap)
        if not bool(over.any()):
            break
        fixed |= over
        exact[over] = cap[over]
    return round_to_total(exact, total if bool(torch.isinf(cap).any()) else min(total, int(cap.sum())), cap)


@dataclass
class LAVaPolicy(WindowPolicy):
    kernel: int = 7
    name: str = "lava"
    budget_scope: str = "layer"

    def __post_init__(self) -> None:
        super().__post_init__()
        self.entropy = SequenceStats()  # {layer: (B,)}
        self.entries = SequenceStats()  # {layer: (B,)} entries the layer holds (all its heads), its most to keep

    def layer_scores(self, layer: int, query: torch.Tensor, view: PaddedView, query_pos: torch.Tensor) -> torch.Tensor:
        W = min(self.window, query.shape[2])
        attn = window_attention(query, view, query_pos, self.window).sum(3).amax(2)  # (B, H, L), max over group
        # Algorithm 1 scores only i not in [N - w, N]; the authors' code takes max_k ||V[k]||_1 over those entries
        # (value_states[..., :-window, :]), pools them alone and computes the entropy over them (MGDDestiny/Lava)
        ok = window_prefix(view, query_pos, self.window)  # (B, H, L)
        vmax = (view.values.float().abs().sum(-1) * ok).amax(-1, keepdim=True)  # max_k ||V[k]||_1
        s = max_pool(attn * vmax / W, self.kernel, within=ok)
        # the layer's uncertainty (Eq. 6-7) sets its share of the budget
        p = (s * ok) / (s * ok).sum(dim=(1, 2), keepdim=True).clamp_min(1e-30)
        n = ok.sum(-1).amax(-1).clamp_min(1).float()  # N: entries per head
        ent = -(p * torch.log(p.clamp_min(1e-30))).sum(dim=(1, 2)) / (s.shape[1] * n)
        self.entropy.put(layer, ent)
        self.entries.put(layer, (view.valid & (view.pos >= 0)).sum(dim=(1, 2)))
        return s

    def layer_budget_table(self, total: int, num_layers: int, seq: int = 0) -> torch.Tensor | None:
        e = self.entropy.of(seq, num_layers)
        if e is None:
            return None
        # B_l = e_l / sum e * B in whole entries (rounding every share down lost up to L - 1 of the budget), none
        # past what the layer holds (a share beyond it was lost, not handed to the other layers)
        return proportional_shares(e.clamp_min(1e-12), total, self.entries.of(seq, num_layers))

    def select_batch(self, indices: torch.Tensor) -> None:
        super().select_batch(indices)
        self.entropy.select_batch(indices)
        self.entries.select_batch(indices)

    def reset(self) -> None:
        super().reset()
        self.entropy.reset()
        self.entries.reset()
