"""PyramidKV (Cai et al., 2024, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal
Information Funneling").

SnapKV's scores with a pyramid of layer budgets: lower layers attend broadly and get more, upper
layers less. As in the authors' code (Zefan-Cai/KVCache-Factory, ``pyramidkv_utils.py``,
``PyramidKVCluster.update_kv``) the pyramid splits the *prefix* budget and every layer keeps the
observation window on top of its share: with ``a`` entries per KV head on average and ``p = a - window``,
the top layer keeps ``p / beta`` prefix entries, the bottom one ``2p - p / beta``, linearly in between,
plus the ``window`` newest tokens in every layer, so the layers average ``a`` per head. Short contexts
follow the same code: a context shorter than ``2p`` gets SnapKV's even split, and a bottom layer whose
share would pass the whole prefix is cut to it with the top layer raised by as much. Each layer's
budget is the same in all its KV heads. Modes as for SnapKV (one-shot by default).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .snapkv import SnapKVPolicy
from .window import SequenceStats, round_to_total

if TYPE_CHECKING:
    from ..cache.paged import PaddedView


def _spread_evenly(units: int, num_layers: int) -> torch.Tensor:
    """``(L,)`` integer shares of ``units`` as even as can be, the remainder to the lower layers."""
    per = torch.full((num_layers,), units // num_layers, dtype=torch.long)
    per[: units % num_layers] += 1
    return per


def pyramid_budgets(total: int, num_layers: int, num_heads: int, beta: float, window: int,
                    context: int | None = None) -> torch.Tensor:
    """``(L, H)`` integer entries per KV head summing to at most ``total``, decreasing linearly with depth.

    ``total``: entries over all layers and heads; ``window``: the observation window each layer keeps on
    top of its pyramid share of the prefix budget; ``context``: tokens per head to choose from (``None``:
    a context long enough for the full pyramid).
    """
    units = total // num_heads  # entries per head summed over the layers (what every head of a layer shares)
    a = units / num_layers  # per head and layer on average (PyramidKV's max_capacity_prompt)
    p = a - window  # prefix budget per layer on average
    # PyramidKV's code asserts max_capacity_prompt > window; below that nothing is left to grade: even split
    # (the remainder to the lower layers, so a budget under L x H still fills heads instead of exceeding it)
    # and SnapKV's even split where the code falls back to it (context < 2 * (max_capacity_prompt - window)) or
    # keeps everything (context < max_capacity_prompt)
    if p <= 0 or num_layers == 1 or (context is not None and (context < 2 * p or context <= a)):
        per_layer = _spread_evenly(units, num_layers)
    else:
        # min_num / max_num of PyramidKVCluster.update_kv: the window is kept on top of the pyramid
        lo = p / beta
        hi = 2 * p - lo
        if context is not None and hi >= context - window:  # the code's cap at the whole prefix
            hi = float(context - window)
            lo = 2 * p - hi
        exact = window + torch.linspace(hi, lo, num_layers, dtype=torch.float64)  # sums to `units`
        # the code steps by (max_num - min_num) // (L - 1) entries, which keeps more than the budget (263 -> 60
        # per head at 150 on 30 layers instead of 262 -> 38, 9% over); the exact arithmetic sequence of the
        # paper keeps the budget, rounded down with the remainder to the largest fractions (lower layers first)
        per_layer = round_to_total(exact, units)
    return per_layer[:, None].expand(num_layers, num_heads).clone()


@dataclass
class PyramidKVPolicy(SnapKVPolicy):
    beta: float = 20.0
    name: str = "pyramidkv"
    # candidates per head, per layer and sequence
    context: SequenceStats = field(default_factory=SequenceStats, init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.beta < 1:
            raise ValueError(f"beta must be >= 1, got {self.beta}")

    def observe(self, layer: int, query: torch.Tensor, view: PaddedView, query_pos: torch.Tensor) -> None:
        # the entries each head chooses from (PyramidKV's q_len: the prompt in one shot, what is kept plus the
        # new chunk when streaming), each sequence its own (a short prompt batched with a long one keeps its split)
        real = view.valid & (view.pos >= 0)
        self.context.put(layer, real.sum(-1).amax(-1) if real.numel() else torch.zeros(real.shape[0]))
        super().observe(layer, query, view, query_pos)

    def head_budget_table(self, total: int, num_layers: int, num_heads: int, seq: int = 0) -> torch.Tensor:
        seen = [int(c[seq]) for c in self.context.values() if seq < len(c)]
        return pyramid_budgets(total, num_layers, num_heads, self.beta, self.window, max(seen) if seen else None)

    def select_batch(self, indices: torch.Tensor) -> None:
        super().select_batch(indices)
        self.context.select_batch(indices)

    def reset(self) -> None:
        super().reset()
        self.context.reset()
