"""CAKE (Qin et al., 2025, "CAKE: Cascading and Adaptive KV Cache Eviction with Layer Preferences").

Per layer, from the window attention ``A[j, i]`` (last ``window`` queries, mean over the GQA group):
spatial dispersion ``H_l`` = entropy of the window-mean attention, temporal shift ``V_l`` = variance of
attention across the window queries (mean over entries); preference ``P_l = H_l^(1/tau1) * V_l^(1/tau2)``
and layer budget ``B_l = P_l / sum P * B``, split evenly over the layer's heads. Entries are ranked by
``mean_j A[j, i] + gamma * var_j A[j, i]`` (max-pooled with ``kernel``); the window is always kept.

Cascading: the layer budgets are recomputed from every layer's latest preference at each eviction, so
with streaming (chunked prefill, turns) earlier layers shrink as later ones claim memory, as in the
paper's layer-by-layer prefill; one-shot (default) allocates once after the prefill.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .scoring import max_pool
from .window import WindowPolicy, window_attention

if TYPE_CHECKING:
    from ..cache.paged import PaddedView


@dataclass
class CAKEPolicy(WindowPolicy):
    kernel: int = 7
    gamma: float = 200.0
    tau1: float = 1.0
    tau2: float = 1.0
    name: str = "cake"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tau1 <= 0 or self.tau2 <= 0:
            raise ValueError(f"tau1 and tau2 must be > 0, got {self.tau1}, {self.tau2}")
        if self.gamma < 0:
            raise ValueError(f"gamma must be >= 0 (weight of the attention's variance in the eviction score), got "
                             f"{self.gamma}")
        self.preference: dict[int, float] = {}

    def layer_scores(self, layer: int, query: torch.Tensor, view: PaddedView, query_pos: torch.Tensor) -> torch.Tensor:
        attn = window_attention(query, view, query_pos, self.window).mean(2)  # (B, H, W, L)
        mean, var = attn.mean(2), attn.var(2, unbiased=False) if attn.shape[2] > 1 else torch.zeros_like(attn[:, :, 0])
        ok = (view.valid & (view.pos >= 0)).float()
        p = mean * ok / (mean * ok).sum(-1, keepdim=True).clamp_min(1e-30)
        entropy = -(p * torch.log(p.clamp_min(1e-30))).sum(-1).mean()
        shift = ((var * ok).sum(-1) / ok.sum(-1).clamp_min(1)).mean()
        self.preference[layer] = float(entropy.clamp_min(1e-12) ** (1 / self.tau1)
                                       * shift.clamp_min(1e-12) ** (1 / self.tau2))
        return max_pool(mean + self.gamma * var, self.kernel)

    def head_budget_table(self, total: int, num_layers: int, num_heads: int) -> torch.Tensor | None:
        if len(self.preference) < num_layers:
            return None  # nothing observed yet: the cache's even split
        p = torch.tensor([self.preference[l] for l in range(num_layers)])
        per_layer = torch.floor(p / p.sum() * total)
        return (per_layer // num_heads).long()[:, None].expand(num_layers, num_heads).clone()

    def reset(self) -> None:
        super().reset()
        self.preference.clear()
