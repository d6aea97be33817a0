"""Shared machinery of training-free policies: observation-window attention and statistics kept by
true token position (entries move in memory when the cache compacts; positions do not)."""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .base import EntryView, EvictionPolicy, protect

if TYPE_CHECKING:
    from ..cache.paged import PaddedView


def window_attention(query: torch.Tensor, view: PaddedView, query_pos: torch.Tensor,
                     window: int | None) -> torch.Tensor:
    """Softmax attention of the last ``window`` queries over the kept entries, recomputed from the
    cached keys (as SnapKV does under FlashAttention), so no eager attention is needed.

    ``query`` ``(B, Hq, Q, D)``, ``view`` keys ``(B, H, L, D)`` / pos / valid ``(B, H, L)``, ``query_pos``
    ``(B, Q)``. Returns ``(B, H, G, W, L)`` float32 with ``G = Hq / H`` query heads per KV head.
    """
    B, Hq, Q, D = query.shape
    H = view.keys.shape[1]
    W = Q if window is None else min(window, Q)
    q = query[:, :, Q - W :].float().reshape(B, H, Hq // H, W, D)
    s = torch.einsum("bhgwd,bhld->bhgwl", q, view.keys.float()) * D**-0.5
    qp = query_pos[:, Q - W :]
    ok = view.valid[:, :, None, :] & (view.pos[:, :, None, :] >= 0) & (view.pos[:, :, None, :] <= qp[:, None, :, None])
    s = s.masked_fill(~ok[:, :, None], float("-inf"))
    return torch.softmax(s, dim=-1).nan_to_num(0.0)


def attention_mass(query: torch.Tensor, view: PaddedView, query_pos: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """``window_attention(query, view, query_pos, None).sum(dim=(2, 3))`` without its ``(B, H, G, Q, L)`` tensor: the
    attention each entry receives from every query of the forward, summed over the group's query heads. Softmax is
    per query, so the queries are taken ``chunk`` at a time; a 4k one-shot prefill of SmolLM2 needs ~40 MB per chunk
    instead of ~600 MB per layer, which made H2O the slowest policy of a sweep by far, and the entries no query
    of a chunk may see are left out.

    ``query`` ``(B, Hq, Q, D)``, ``view`` keys ``(B, H, L, D)`` / pos / valid ``(B, H, L)``, ``query_pos`` ``(B, Q)``.
    Returns ``(B, H, L)`` float32.
    """
    B, Hq, Q, D = query.shape
    H = view.keys.shape[1]
    keys = view.keys.float()
    real = view.valid & (view.pos >= 0)  # (B, H, L)
    mass = torch.zeros(real.shape, dtype=torch.float32, device=keys.device)
    for start in range(0, Q, chunk):
        stop = min(start + chunk, Q)
        # entries past the last one any of these queries may see get no mass: a prefill's entries are in position
        # order, so causality halves the work
        seen = (real & (view.pos <= query_pos[:, start:stop].amax())).flatten(0, 1).any(0).nonzero()
        if len(seen) == 0:
            continue
        n = int(seen[-1]) + 1
        q = query[:, :, start:stop].float().reshape(B, H, Hq // H, stop - start, D)
        s = torch.einsum("bhgwd,bhld->bhgwl", q, keys[:, :, :n]) * D**-0.5
        ok = real[:, :, None, :n] & (view.pos[:, :, None, :n] <= query_pos[:, None, start:stop, None])
        s.masked_fill_(~ok[:, :, None], float("-inf"))
        mass[..., :n] += torch.softmax(s, dim=-1).nan_to_num_(0.0).sum(dim=(2, 3))
    return mass


def window_prefix(view: PaddedView, query_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """``(B, H, L)`` bool: the real entries before the observation window, the only ones the window policies rank.

    SnapKV's code scores ``attn[..., -window:, :-window]`` (FasterDecoding/SnapKV ``snapkv_utils.py``; likewise
    KVCache-Factory, AdaKV, LAVa, CAKE and DefensiveKV) and concatenates the window, kept whole: pooling and any
    statistic over entries (entropies, means, top-b) use these columns only. ``view`` pos / valid ``(B, H, L)``,
    ``query_pos`` ``(B, Q)``; the window is the last ``min(window, Q)`` queries, as in :func:`window_attention`.
    """
    Q = query_pos.shape[1]
    W = Q if window is None else min(window, Q)
    first = query_pos[:, Q - W]  # (B,) position of the window's first query
    return view.valid & (view.pos >= 0) & (view.pos < first[:, None, None])


class PositionStats:
    """Per-layer ``(B, H, P)`` statistics indexed by true position ``P`` (grown as tokens arrive)."""

    def __init__(self) -> None:
        self.tables: dict[int, torch.Tensor] = {}

    def reset(self) -> None:
        self.tables.clear()

    def select_batch(self, indices: torch.Tensor) -> None:
        """Row ``i`` of every table becomes old row ``indices[i]`` (repeats allowed)."""
        self.tables = {layer: t[indices.to(t.device)] for layer, t in self.tables.items()}

    def write(self, layer: int, values: torch.Tensor, view: PaddedView, accumulate: bool = False) -> None:
        """Store (or add) ``values`` ``(B, H, L)`` of the view's entries under their positions."""
        pos = view.pos.clamp_min(0)
        size = int(pos.max()) + 1 if pos.numel() else 1
        table = self.tables.get(layer)
        if table is None or table.shape[-1] < size or table.shape[:2] != values.shape[:2]:
            new = torch.zeros(*values.shape[:2], max(size, 2 * (0 if table is None else table.shape[-1])),
                              device=values.device)
            if table is not None and table.shape[:2] == values.shape[:2]:
                new[..., : table.shape[-1]] = table
            table = new
        # only the real entries: a page-padded slot holds pos -1 (clamped to 0) or a stale position left by
        # compaction, and a scatter over every slot let its "keep the old value" write land after the real
        # entry's, so position 0 (the attention sink) lost its score whenever a length was not a page multiple
        b, h, i = (view.valid & (view.pos >= 0)).nonzero(as_tuple=True)
        vals = values.float()[b, h, i]
        table.index_put_((b, h, view.pos[b, h, i]), vals, accumulate=accumulate)
        self.tables[layer] = table

    def lookup(self, entries: EntryView) -> torch.Tensor:
        """Statistics of every entry ``(R, Lpad)`` (0 where nothing was recorded)."""
        out = torch.zeros_like(entries.log_beta)
        for layer in entries.layer.unique().tolist():
            table = self.tables.get(layer)
            if table is None:
                continue
            rows = (entries.layer == layer).nonzero().flatten()
            t = table[entries.seq[rows], entries.head[rows]]  # (r, P)
            pos = entries.pos[rows].clamp(0, t.shape[-1] - 1)
            out[rows] = t.gather(-1, pos)
        return out


def round_to_total(exact: torch.Tensor, total: int, cap: torch.Tensor | None = None) -> torch.Tensor:
    """``(L,)`` int64 ``exact`` ``(L,)`` float shares rounded down, then one more each to the largest fractions (lower
    parts first, none past ``cap[l]``) until they sum to ``total``: whole shares that spend a budget."""
    share = exact.floor().long()
    short = total - int(share.sum())
    if short > 0:
        frac = exact - exact.floor()
        order = sorted(range(len(exact)), key=lambda l: (-float(frac[l]), l))
        share[[l for l in order if cap is None or share[l] < cap[l]][:short]] += 1
    return share


class SequenceStats(dict):
    """Per-layer ``(B,)`` float64 statistics, one per sequence of the batch (a layer's entropy, preference or
    context length), so that the budget one sequence's layers get does not depend on the sequences batched
    with it. ``{layer: (B,)}``, kept on the CPU, where the budget tables are computed."""

    def put(self, layer: int, values: torch.Tensor) -> None:
        self[layer] = values.detach().to("cpu", torch.float64).reshape(-1)

    def of(self, seq: int, num_layers: int) -> torch.Tensor | None:
        """``(num_layers,)`` float64 of sequence ``seq``, or None while a layer has not been observed."""
        if any(l not in self for l in range(num_layers)):
            return None
        return torch.stack([self[l][seq] for l in range(num_layers)])

    def select_batch(self, indices: torch.Tensor) -> None:
        """Row ``i`` becomes old row ``indices[i]`` (repeats allowed)."""
        for layer in list(self):
            self[layer] = self[layer][indices.cpu()]

    def reset(self) -> None:
        self.clear()


def over_heads(values: torch.Tensor, view: PaddedView, mean: bool = False) -> torch.Tensor:
    """``(B, H, L)``: for each real entry the sum (``mean``: the mean) of ``values`` ``(B, H, L)`` over the layer's
    heads that hold its position; 0 for padding. By position, not by slot: after an eviction the heads hold
    different positions in the same slot, and a position kept in some heads only is shared among those."""
    real = view.valid & (view.pos >= 0)
    b, h, i = real.nonzero(as_tuple=True)
    p, v = view.pos[b, h, i], values[b, h, i]
    size = int(view.pos.max()) + 1 if view.pos.numel() else 1
    total = values.new_zeros(values.shape[0], size).index_put_((b, p), v, accumulate=True)
    if mean:
        total = total / values.new_zeros(values.shape[0], size).index_put_((b, p), torch.ones_like(v),
                                                                           accumulate=True).clamp_min(1)
    out = total.gather(1, view.pos.clamp_min(0).flatten(1)).view_as(values)
    return torch.where(real, out, torch.zeros_like(out))


def recent_mask(entries: EntryView, window: int) -> torch.Tensor:
    """``(R, Lpad)`` True for the newest ``window`` tokens of each sequence (always kept)."""
    return entries.pos > entries.step[:, None] - window


@dataclass
class WindowPolicy(EvictionPolicy):
    """Base of the observation-window policies (SnapKV and its descendants).

    Subclasses implement :meth:`layer_scores` (``(B, H, L)`` scores of a layer's kept entries from the
    last ``window`` queries); scores are stored by true position, looked up at eviction, and the
    window's own tokens are always kept. One-shot policies keep the prefill's scores while decoding;
    streaming ones refresh them with every forward.

    The window is the last ``window`` tokens of the input however it was chunked: a forward of fewer tokens
    (a prefill's last chunk, a short question after a long context) observes the queries of the tokens before
    it as well, kept from earlier forwards (as the papers' window is the prompt's last ``w`` tokens, which a
    one-shot prefill sees in one forward). A decoding step observes its own query only, as before.
    """

    window: int = 32
    budget_scope: str = "head"
    mode: str = "one_shot"
    needs_queries: bool = True
    stats: PositionStats = field(default_factory=PositionStats, repr=False)

    def __post_init__(self) -> None:
        self.validate()
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        self._tail: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer: the last queries (B, Hq, <=w, D), pos

    def window_queries(self, layer: int, query: torch.Tensor, query_pos: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """The queries ``(B, Hq, W, D)`` and positions ``(B, W)`` a forward of ``query`` ``(B, Hq, Q, D)``
        observes: with ``Q > 1`` the last ``window`` of every query seen so far (earlier forwards' included),
        with ``Q == 1`` (a decoding step) its own. Records this forward's queries for the next one."""
        prev = self._tail.get(layer)
        if prev is not None and prev[0].shape[0] == query.shape[0] and query.shape[2] < self.window:
            # new tensors of under 2 * window queries: the slices hold nothing larger
            q = torch.cat([prev[0].to(query.dtype), query.detach()], 2)[:, :, -self.window :]
            pos = torch.cat([prev[1], query_pos], 1)[:, -self.window :]
            self._tail[layer] = (q, pos)
        else:
            q, pos = query[:, :, -self.window :], query_pos[:, -self.window :]
            # a copy: a slice would keep this forward's whole query tensor (a long chunk's) alive
            self._tail[layer] = (q.detach().clone(), pos.clone())
        return (query, query_pos) if query.shape[2] == 1 else (q, pos)

    @abstractmethod
    def layer_scores(self, layer: int, query: torch.Tensor, view: PaddedView, query_pos: torch.Tensor) -> torch.Tensor:
        """``(B, H, L)`` scores of the layer's kept entries."""

    def observe(self, layer: int, query: torch.Tensor, view: PaddedView, query_pos: torch.Tensor) -> None:
        query, query_pos = self.window_queries(layer, query, query_pos)
        if query.shape[2] == 1 and layer in self.stats.tables and self.mode == "one_shot":
            return  # decoding steps do not move one-shot scores
        self.stats.write(layer, self.layer_scores(layer, query, view, query_pos), view)

    def adjust(self, scores: torch.Tensor, entries: EntryView) -> torch.Tensor:
        """Hook on the looked-up scores before the window is protected (AdaKV's safeguard)."""
        return scores

    def score(self, entries: EntryView) -> torch.Tensor:
        s = self.adjust(self.stats.lookup(entries), entries)
        return protect(s, recent_mask(entries, self.window))

    def select_batch(self, indices: torch.Tensor) -> None:
        super().select_batch(indices)
        self._tail = {layer: (q[indices.to(q.device)], pos[indices.to(pos.device)])
                      for layer, (q, pos) in self._tail.items()}

    def reset(self) -> None:
        self.stats.reset()
        self._tail.clear()
