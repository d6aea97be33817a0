"""TRIM-KV: myopic retention scores (H = 1) with a budget per KV head (the local ablation)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .global_gates import GlobalGatesPolicy


@dataclass
class TrimKVPolicy(GlobalGatesPolicy):
    """Each (layer, KV head) keeps its own top ``budget / (L * H)`` entries, or ``head_budgets[l, h]``."""

    horizon: int = 1
    budget_scope: str = "head"
    head_budgets: torch.Tensor | None = None
    name: str = "trimkv"
