"""CAKE (Qin et al., ICLR 2025, "CAKE: Cascading and Adaptive KV Cache Eviction with Layer Preferences").

Follows the authors' code (github.com/antgroup/cakekv: ``cake/model/modify_llama.py``, ``cake/cake_cache.py``,
``cake/utils.py``; the same computation as the port in FFY0/DefensiveKV, ``cake_global_press.py``). From the
softmax attention ``A[g, j, i]`` of the last ``window`` queries ``j`` of every query head ``g`` over the prefix
entries ``i`` (the entries older than the window; the softmax runs over every entry, as in the code):

* spatial dispersion ``H_l = -sum_{g, j, i} A log A`` (each window query's own entropy, summed);
* temporal shift ``V_l = sum_{g, i} Var_j A[g, j, i]`` (unbiased variance over the window queries);
* preference ``P_l = H_l^(1/tau1) * V_l^(1/tau2)``; every layer keeps the window plus
  ``P_l / sum P * (B - L * window)`` prefix entries per KV head (``B``: entries per head over all layers), a
  layer capped at its whole prefix handing the rest to the others;
* eviction indicator ``mean_j A + gamma * Var_j A`` per query head, average-pooled over the prefix with
  ``kernel`` (5) and averaged over the GQA group; the window is always kept.

Cascading: the layer budgets are recomputed from every layer's latest preference at each eviction, so
with streaming (chunked prefill, turns) earlier layers shrink as later ones claim memory, as in the
paper's layer-by-layer prefill; one-shot (default) allocates once after the prefill.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .window import SequenceStats, WindowPolicy, window_attention

if TYPE_CHECKING:
    from ..cache.paged import PaddedView


def _fill(share: torch.Tensor, cap: torch.Tensor, extra: int) -> torch.Tensor:
    """Hand ``extra`` more entries to the layers of ``share`` ``(L,)`` below their ``cap`` ``(L,)``: evenly, the
    remainder one each to the first of them (the authors' ``adjust_budgets``), again while some layer hits its cap."""
    share = share.clone()
    while extra > 0:
        open_ = (share < cap).nonzero().flatten()
        if not open_.numel():
            break
        add = torch.zeros_like(share)
        add[open_] = extra // len(open_)
        add[open_[: extra % len(open_)]] += 1
        grown = torch.minimum(share + add, cap)
        extra -= int((grown - share).sum())
        share = grown
    return share


@dataclass
class CAKEPolicy(WindowPolicy):
    kernel: int = 5  # the authors' F.avg_pool1d(kernel_size=5) over the eviction indicator
    gamma: float = 200.0  # the authors' default (pred_cake.py --gamma)
    # tau1 / tau2 are tuned per model and budget in the authors' config/model2tau.json; for a model not listed
    # there (SmolLM2, Qwen3) their LongBench script falls back to 1.0 / 1.0, kept here (DefensiveKV's port
    # hard-codes Llama-3.1-8B's values at a 128-token budget, 1.6 / 0.6)
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
        # per layer and sequence: the preference, and the entries a head chooses from at the latest observation
        self.preference = SequenceStats()
        self.context = SequenceStats()

    def layer_scores(self, layer: int, query: torch.Tensor, view: PaddedView, query_pos: torch.Tensor) -> torch.Tensor:
        attn = window_attention(query, view, query_pos, self.window)  # (B, H, G, W, L), softmax over every entry
        B, H, G, W, L = attn.shape
        real = view.valid & (view.pos >= 0)
        self.context.put(layer, real.sum(-1).amax(-1) if real.numel() else torch.zeros(B))
        # the authors slice the window's own columns off ([..., :-window]) before every statistic, without
        # renormalising: the prefix is what the cache may evict (older than the always-kept window)
        prefix = real & (view.pos <= query_pos[:, -1, None, None] - self.window)  # (B, H, L)
        a = attn * prefix[:, :, None, None]
        mean = a.mean(3)  # (B, H, G, L)
        # unbiased variance over the window queries, as torch.var in the authors' code (zero with one query)
        var = a.var(3) if W > 1 else torch.zeros_like(mean)
        if W > 1:  # a lone query (a decoding step) has no temporal shift: the layer keeps its preference
            # dispersion: the entropy of each window query's own distribution over the prefix, summed over queries
            # and heads (the authors' calculate_entropy over A[:, :, -w:, :-w], eps 1e-10); shift: the summed
            # variance. The authors run batch 1 and sum over the batch as well; here each sequence has its own
            disp = -(a * torch.log(a + 1e-10)).flatten(1).sum(1).double()  # (B,)
            shift = var.flatten(1).sum(1).double()
            pref = disp.clamp_min(0) ** (1 / self.tau1) * shift.clamp_min(0) ** (1 / self.tau2)
            # past float range (or inf * 0): inf, which the budget table reads as "takes the whole share"
            self.preference.put(layer, torch.where(pref.isfinite(), pref, torch.full_like(pref, float("inf"))))
        # eviction indicator per query head, avg-pooled with zero padding counted (F.avg_pool1d's default) over
        # the prefix only (window columns are zero here, as the authors' slice pads them), then the group mean;
        # pooling and the group mean are both linear, so their order does not matter
        ind = (mean + self.gamma * var).mean(2)  # (B, H, L)
        if self.kernel > 1:
            ind = F.avg_pool1d(ind.reshape(B * H, 1, L), self.kernel, stride=1,
                               padding=self.kernel // 2).reshape(B, H, L)
        return ind

    def head_budget_table(self, total: int, num_layers: int, num_heads: int, seq: int = 0) -> torch.Tensor | None:
        p = self.preference.of(seq, num_layers)
        if p is None:
            return None  # nothing observed yet: the cache's even split
        if torch.isinf(p).any():  # a preference past float range takes what the finite ones would share
            p = torch.isinf(p).double()
        units = total // num_heads  # entries per KV head over all layers
        prefix_units = units - num_layers * self.window
        if p.sum() <= 0 or prefix_units <= 0:
            return None  # no preference to follow, or not even the windows fit: the cache's even split
        # CakeprefillKVCache: total_size = (cache_size - window) * layers is shared by preference and every layer
        # keeps its window on top; budgets are truncated to integers, capped at the layer's prefix (seq_len -
        # window) with the excess handed evenly to the others, and the truncation's remainder added the same way
        share = torch.floor(p / p.sum() * prefix_units).long()
        context = self.context.of(seq, num_layers)
        context = torch.full((num_layers,), units) if context is None else context.long()
        cap = (context - self.window).clamp_min(0)
        excess = int((share - cap).clamp_min(0).sum())
        share = _fill(torch.minimum(share, cap), cap, excess)
        share = _fill(share, cap, prefix_units - int(share.sum()))
        per_layer = share + self.window
        return per_layer[:, None].expand(num_layers, num_heads).clone()

    def select_batch(self, indices: torch.Tensor) -> None:
        super().select_batch(indices)
        self.preference.select_batch(indices)
        self.context.select_batch(indices)

    def reset(self) -> None:
        super().reset()
        self.preference.reset()
        self.context.reset()
