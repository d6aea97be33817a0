"""``QueryRecorder``: a policy that evicts nothing and keeps each layer's prefill queries, so that a cache prefilled
once can be copied (:meth:`retention.cache.RetentionCache.copy_from`) into caches of attention-based policies (SnapKV,
H2O, TOVA, ...) that must observe those queries."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .base import EntryView, EvictionPolicy

if TYPE_CHECKING:
    from ..cache.paged import PaddedView


class QueryRecorder(EvictionPolicy):
    """Never evicts; records ``queries[layer] = (query (B, Hq, Q, D), query_pos (B, Q))`` of the last forward of
    each layer (a one-shot prefill's: what an observation-window policy reads). Also keeps the gate scores, so gated
    policies can share the copy."""

    name = "recorder"
    needs_queries = True
    evicts = False
    keeps_gate_scores = True

    def __init__(self) -> None:
        self.queries: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def observe(self, layer: int, query: torch.Tensor, view: PaddedView, query_pos: torch.Tensor) -> None:
        self.queries[layer] = (query, query_pos)

    def score(self, entries: EntryView) -> torch.Tensor:  # evicts is False: the cache never asks
        raise RuntimeError("QueryRecorder never evicts, so it scores nothing")

    def reset(self) -> None:
        self.queries.clear()
