"""PyramidKV (Cai et al., 2024, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal
Information Funneling").

SnapKV's scores with a pyramid of layer budgets: lower layers attend broadly and get more, upper
layers less. With ``a = total / L`` per layer on average and ``beta`` (default 20), the top layer gets
``a / beta`` and budgets grow linearly to ``2a - a / beta`` at the bottom; each layer's budget is split
evenly over its KV heads. Modes as for SnapKV (one-shot by default).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .snapkv import SnapKVPolicy


def pyramid_budgets(total: int, num_layers: int, num_heads: int, beta: float) -> torch.Tensor:
    """``(L, H)`` integer budgets summing to at most ``total``, decreasing linearly with depth."""
    a = total / num_layers
    lo, hi = a / beta, 2 * a - a / beta
    per_layer = torch.linspace(hi, lo, num_layers) if num_layers > 1 else torch.tensor([a])
    per_head = torch.floor(per_layer / num_heads).long().clamp_min(1)
    return per_head[:, None].expand(num_layers, num_heads).clone()


@dataclass
class PyramidKVPolicy(SnapKVPolicy):
    beta: float = 20.0
    name: str = "pyramidkv"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.beta < 1:
            raise ValueError(f"beta must be >= 1, got {self.beta}")

    def head_budget_table(self, total: int, num_layers: int, num_heads: int) -> torch.Tensor:
        return pyramid_budgets(total, num_layers, num_heads, self.beta)
