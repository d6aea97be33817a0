"""Learned global gates with a share of the budget picked by SnapKV's observation-window attention.

The gates rank entries by what any future query may need (query-agnostic, learned); SnapKV ranks them
by what the context's last ``window`` queries attend to, the best training-free predictor of the next
tokens' needs on SmolLM2 (fidelity). This policy gives each (layer, KV head) its SnapKV top
``share * B / (L * H_kv)`` entries (the window among them) and fills the rest of the one global budget
B with the gates' top entries, sinks included. ``share=0`` is :class:`GlobalGatesPolicy`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..cache.select import rank_in_groups
from .base import EntryView, protect
from .global_gates import GlobalGatesPolicy
from .snapkv import SnapKVPolicy

if TYPE_CHECKING:
    from ..cache.paged import PaddedView


@dataclass
class GatesSnapKVPolicy(GlobalGatesPolicy):
    share: float = 0.25
    window: int = 32
    kernel: int = 7
    name: str = "gates_snapkv"
    needs_queries: bool = True
    snap: SnapKVPolicy = field(init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.share <= 1.0:
            raise ValueError(f"share must be in [0, 1] (the budget's fraction picked by attention), got {self.share}")
        # one_shot: scores move with every prefill chunk or turn, not with each decoded token
        self.snap = SnapKVPolicy(window=self.window, kernel=self.kernel, mode="one_shot")
        self._per_head = 0

    def set_budget(self, total: int, num_layers: int, num_heads: int) -> None:
        self._per_head = int(self.share * total // (num_layers * num_heads))

    def observe(self, layer: int, query: torch.Tensor, view: PaddedView, query_pos: torch.Tensor) -> None:
        self.snap.observe(layer, query, view, query_pos)

    def score(self, entries: EntryView) -> torch.Tensor:
        """``(R, Lpad)``: +inf for each stream's SnapKV top ``share * B / (L * H)`` and the sinks, else the
        gates' log retention."""
        gates = super().score(entries)
        k = min(self._per_head, entries.valid.shape[1])
        if k == 0:
            return gates
        # a left-padded row's padding slots (pos -1) would look up position 0's score and take picks from real entries
        real = entries.valid & (entries.pos >= 0)
        # ties (max-pooled scores are flat over a peak's neighbours) go to the newer token, as in every top-B here,
        # so a row's picks do not depend on where its padding puts its entries
        rows = torch.arange(len(real), device=real.device)
        picked = real & (rank_in_groups(self.snap.score(entries), entries.pos, real, rows) < k)
        return protect(gates, picked)

    def reset(self) -> None:
        self.snap.reset()

    def select_batch(self, indices: torch.Tensor) -> None:
        self.snap.select_batch(indices)
