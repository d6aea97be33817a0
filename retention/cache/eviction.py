"""Eviction for :class:`~retention.cache.hf.RetentionCache`: when it runs, and which entries it keeps.

The policy scores every kept entry of the sequences over budget; :func:`~retention.cache.select.select_keep` picks the
top entries of each budget group (the whole sequence, a layer or a stream, as the policy's ``budget_scope`` says) and
:meth:`~retention.cache.paged.PagedKVStore.compact` drops the rest.
"""

from __future__ import annotations

import torch

from ..policies.base import EntryView
from .select import rank_in_groups, select_keep


class EvictionMixin:
    """Eviction of :class:`~retention.cache.hf.RetentionCache` (its ``store``, ``policy``, ``budget``, ``slack``,
    ``protected_window`` and ``min_per_head``)."""

    def _maybe_evict(self, query_len: int) -> None:
        if self.budget is None or self.store is None or not self.policy.evicts:
            return
        if self.policy.mode == "one_shot" and not (self._last_query_len > 1 and query_len == 1):
            return  # one-shot policies compress once, when a prefill has ended
        budgets = self._budgets(self.store.batch)
        if self.policy.head_budgets is not None:
            budgets = budgets.clamp_max(int(self.policy.head_budgets.sum()))
        slack = 0 if self.policy.mode == "one_shot" else self.slack
        self._evict_over(budgets, slack)

    def _evict_over(self, budgets: torch.Tensor, slack: int) -> None:
        """Evict the sequences holding more than ``budgets + slack`` entries (``budgets`` ``(B,)`` on the
        host, as the totals are: no device sync unless something is evicted)."""
        # padding entries do not count: a padded row evicts exactly when it would alone
        totals = self.store.host_lengths.view(self.store.batch, -1).sum(1) - self._pad_entries
        over = (totals > budgets + slack).nonzero().flatten()
        if over.numel():
            dev = self.store.lengths.device
            self.evict(over.to(dev), budgets[over].to(dev))

    def compress(self, release: bool = True) -> None:
        """Evict every sequence down to its budget now, whatever the policy's mode (e.g. when a context
        has been prefilled and the question has not arrived yet: the query-agnostic protocol). ``release``: then
        give the emptied pages back (:meth:`shrink`), so the compressed cache holds about its budget in memory, not
        its peak; False keeps them for the next appends."""
        if self.budget is None or self.store is None or not self.policy.evicts:
            return
        self._evict_over(self._budgets(self.store.batch), 0)
        if release:
            self.shrink()

    def shrink(self, spare_pages: int | None = None) -> None:
        """Give the page pool's free pages back to the allocator (the pool grows to its peak and keeps it
        otherwise): after it the cache holds about the bytes of the pages it uses (``memory_report()``'s
        ``held_bytes`` against ``used_bytes``). ``spare_pages`` stay free for the next appends (default one per
        stream, what one more token of every stream may need). The entries are untouched, so decoding goes on
        token for token the same; a :class:`~retention.cache.graph_decode.GraphDecoder` records its graph again on
        the next step (the pool's addresses change). Not during a planned step, whose slots point into the pool."""
        if self.planning:
            raise RuntimeError("shrink() during a planned decode step would move the pages its slots point at: call "
                               "it between steps (GraphDecoder records its graph again after it)")
        if self.store is None:
            return
        spare = self.store.num_streams if spare_pages is None else spare_pages
        if not isinstance(spare, int) or isinstance(spare, bool) or spare < 0:
            raise ValueError(f"spare_pages must be an integer >= 0, got {spare_pages!r}")
        self.store.shrink(spare)

    def evict(self, seqs: torch.Tensor, budgets: torch.Tensor) -> None:
        """Cut sequences ``seqs`` ``(n,)`` down to ``budgets`` ``(n,)`` entries by the policy's ranking."""
        store, n, L, H = self.store, self.streams_per_seq, self.num_layers, self.num_kv_heads
        dev = store.lengths.device
        rows = (seqs[:, None] * n + torch.arange(n, device=dev)[None]).flatten()
        view = store.gather(rows, with_kv=self.policy.needs_kv)
        local = torch.arange(len(seqs), device=dev).repeat_interleave(n)
        layer = torch.arange(L, device=dev).repeat_interleave(H).repeat(len(seqs))
        head = torch.arange(H, device=dev).repeat(L * len(seqs))
        step = torch.full((len(rows),), self._seen[0] - 1, dtype=torch.long, device=dev)
        entries = EntryView(view.log_beta, view.pos, view.valid, step, seqs[local], layer, head,
                            self._start[seqs][local], view.keys, view.values,
                            is_image=self._image_flags(seqs[local], view.pos))
        # policies whose scores depend on the budget (AdaKV's safeguard, the SnapKV share) score each row at its own
        score = None
        for b in budgets.unique().tolist():
            self.policy.set_budget(int(b), L, H)
            s = self.policy.score(entries)
            score = s if score is None else torch.where((budgets.to(dev)[local] == b)[:, None], s, score)
        valid = view.valid & (view.pos >= 0)  # padding tokens are dropped at the first eviction
        forced = torch.zeros_like(valid)
        if self.protected_window:
            forced |= view.pos >= self._seen[0] - self.protected_window
        if self.min_per_head:
            forced |= rank_in_groups(score, view.pos, valid, torch.arange(len(rows), device=dev)) < self.min_per_head
        scope = self.policy.budget_scope
        if scope == "global":
            group, budget = local, budgets
        elif scope == "layer":
            # each sequence's own allocation across layers (LAVa), from what the policy observed of it and not of
            # its batchmates; the even split while it has observed nothing
            budget = torch.cat([_or_even(self.policy.layer_budget_table(b, L, seq=q), b, L, dev)
                                for q, b in zip(seqs.tolist(), budgets.tolist())])
            group = local * L + layer
        else:
            group = torch.arange(len(rows), device=dev)
            if self.policy.head_budgets is not None:  # a fixed (L, H) split
                budget = self.policy.head_budgets.to(dev, torch.long).flatten().repeat(len(seqs))
            else:  # each sequence's uneven split across layers (PyramidKV, CAKE), else the even one
                budget = torch.cat([_or_even(self.policy.head_budget_table(b, L, H, seq=q), b, n, dev)
                                    for q, b in zip(seqs.tolist(), budgets.tolist())])
        keep = select_keep(score, view.pos, valid, group, budget, forced)
        store.compact(rows, keep)
        self._pad_entries[seqs.cpu()] = 0
        self._crop_floor = self._seen[0]
        self.evictions += 1


def _or_even(table: torch.Tensor | None, total: int, parts: int, device: torch.device) -> torch.Tensor:
    """A policy's budget table flattened ``(parts,)`` int64, or ``total`` split evenly over ``parts`` without one."""
    if table is None:
        return torch.full((parts,), total // parts, dtype=torch.long, device=device)
    return table.to(device, torch.long).flatten()
