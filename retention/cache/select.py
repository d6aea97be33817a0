"""Top-B selection over scored cache entries, with deterministic tie-breaking.

Within a budget group entries are ranked by (score desc, position desc, layer asc, head asc, slot asc):
among equal scores the newer token wins, then the lower layer, then the lower head. Forced entries
(protected recent window, per-head minimum) rank before all others and are always kept.
"""

from __future__ import annotations

import torch


def _stable_order(order: torch.Tensor, key: torch.Tensor, descending: bool) -> torch.Tensor:
    """Refine ``order`` by ``key`` (a more significant key than the ones already applied)."""
    return order[torch.sort(key[order], stable=True, descending=descending).indices]


def rank_in_groups(
    score: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor, group: torch.Tensor, forced: torch.Tensor | None = None
) -> torch.Tensor:
    """Rank ``(R, Lpad)`` int64 of each entry inside its group (0 = best); rows are in (seq, layer, head) order.

    ``score/pos/valid`` ``(R, Lpad)``; ``group`` ``(R,)`` int64 with groups numbered 0..G-1; ``forced``
    ``(R, Lpad)`` bool ranks first. Invalid entries rank last.
    """
    R, Lpad = score.shape
    n = R * Lpad
    order = torch.arange(n, device=score.device)  # canonical (row, slot) order breaks the last ties
    order = _stable_order(order, pos.flatten(), descending=True)
    order = _stable_order(order, score.flatten().to(torch.float32), descending=True)
    if forced is not None:
        order = _stable_order(order, forced.flatten().to(torch.uint8), descending=True)
    order = _stable_order(order, valid.flatten().to(torch.uint8), descending=True)
    g = group[:, None].expand(R, Lpad).flatten()
    order = _stable_order(order, g, descending=False)
    g_sorted = g[order]
    first = torch.searchsorted(g_sorted, g_sorted, right=False)  # start of each entry's group in sorted order
    rank = torch.empty(n, dtype=torch.long, device=score.device)
    rank[order] = torch.arange(n, device=score.device) - first
    return rank.view(R, Lpad)


def select_keep(
    score: torch.Tensor,
    pos: torch.Tensor,
    valid: torch.Tensor,
    group: torch.Tensor,
    budget: torch.Tensor,
    forced: torch.Tensor | None = None,
) -> torch.Tensor:
    """Keep mask ``(R, Lpad)``: the top ``budget[g]`` valid entries of each group ``g`` plus every forced one."""
    rank = rank_in_groups(score, pos, valid, group, forced)
    keep = valid & (rank < budget[group][:, None])
    if forced is not None:
        keep |= forced & valid
    return keep
