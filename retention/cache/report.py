"""What :class:`~retention.cache.hf.RetentionCache` holds: its memory report, and the entries kept of marked tokens."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache  # a RetentionCache (hf imports this module, so not named here)


class ReportMixin:
    """:meth:`memory_report` of :class:`~retention.cache.hf.RetentionCache`."""

    def memory_report(self) -> "MemoryReport":
        """Entries kept per (sequence, layer, head), KV bytes in use vs a full cache, page slack: a dict that
        prints as a short summary (``print(cache.memory_report())``)."""
        if self.store is None:  # the same keys as after use, so a caller's report["kv_fraction"] never fails
            return MemoryReport(
                tokens_seen=0, entries_per_head=torch.zeros(0, self.num_layers, self.num_kv_heads, dtype=torch.long),
                kept_entries=0, full_cache_entries=0, kv_bytes=0, full_cache_bytes=0, kv_fraction=1.0, pages_in_use=0,
                page_bytes_in_use=0, page_slack_entries=0, metadata_bytes=0, pool_capacity_bytes=0,
                held_bytes=0, used_bytes=0, peak_entries=self.peak_entries, evictions=self.evictions)
        s = self.store
        elem = s.pool.keys.element_size()
        entry_bytes = 2 * self.head_dim * elem
        kept = int(s.lengths.sum())
        pages = s.pool.num_used
        full_entries = self._seen[0] * self.streams_per_seq * s.batch
        # a page's keys and values plus its entries' log_beta (float32), position (int64) and its owner (int64)
        per_page = s.pool.page_bytes() + s.page_size * (4 + 8) + 8
        table = s.block_table.numel() * s.block_table.element_size() + 2 * s.lengths.numel() * 8
        return MemoryReport({
            "tokens_seen": self._seen[0],
            "entries_per_head": s.entries_per_head(),
            "kept_entries": kept,
            "full_cache_entries": full_entries,
            "kv_bytes": kept * entry_bytes,
            "full_cache_bytes": full_entries * entry_bytes,
            "kv_fraction": kept / full_entries if full_entries else 1.0,
            "pages_in_use": pages,
            "page_bytes_in_use": pages * s.pool.page_bytes(),
            "page_slack_entries": pages * s.page_size - kept,
            "metadata_bytes": pages * s.page_size * (4 + 8),  # log_beta float32 + position int64
            "pool_capacity_bytes": s.pool.capacity * s.pool.page_bytes(),
            # what the cache's tensors take (every page of the pool, free ones too, and the block tables) against
            # the pages its entries fill: RetentionCache.shrink() gives back all but a spare page per stream
            "held_bytes": s.pool.capacity * per_page + table,
            "used_bytes": pages * per_page,
            "peak_entries": self.peak_entries,
            "evictions": self.evictions,
        })


def kept_where(cache: Cache, marked: torch.Tensor) -> int:
    """How many entries ``cache`` keeps of the tokens ``marked`` (``(T,)`` bool over the sequence's token indices,
    e.g. ``ids[0] == image_token_id``), over every layer and KV head of sequence 0."""
    if cache.store is None:
        return 0
    kept = 0
    for layer in range(cache.store.num_layers):
        view = cache.store.gather_layer(layer)
        pos = view.pos[:1][view.valid[:1]]
        # left padding (position -1) and tokens past ``marked`` are no marked token (-1 would index the last one)
        pos = pos[(pos >= 0) & (pos < len(marked))]
        kept += int(marked[pos].sum())
    return kept


class MemoryReport(dict):
    """:meth:`RetentionCache.memory_report`: a plain dict of its numbers (``entries_per_head``: ``(batch, layers,
    kv_heads)`` entries kept; bytes in bytes) whose ``str`` is a summary a person can read."""

    def __str__(self) -> str:
        if not self.get("tokens_seen"):
            return "KV cache: empty (nothing prefilled yet)"
        mib = lambda n: f"{n / 2**20:.2f} MiB"  # noqa: E731
        lines = [f"KV cache: {self['kept_entries']:,} of {self['full_cache_entries']:,} entries kept "
                 f"({self['kv_fraction']:.1%}), {mib(self['kv_bytes'])} against {mib(self['full_cache_bytes'])} for a "
                 f"full cache; {self['tokens_seen']:,} tokens seen, eviction rounds: {self['evictions']:,}, peak "
                 f"{self['peak_entries']:,} entries"]
        per_head = self["entries_per_head"]
        for b in range(per_head.shape[0]):
            seq = f" (sequence {b})" if per_head.shape[0] > 1 else ""
            layers = per_head[b].sum(dim=1).tolist()
            lines.append(f"  kept per layer{seq}, all KV heads: {' '.join(str(n) for n in layers)}")
            flat = per_head[b].flatten()
            lo, hi = int(flat.argmin()), int(flat.argmax())
            heads = per_head.shape[2]
            lines.append(f"  per KV head: {int(flat[lo])} (layer {lo // heads}, head {lo % heads}) to {int(flat[hi])} "
                         f"(layer {hi // heads}, head {hi % heads}), mean {flat.float().mean():.1f}")
        if "kept_image_entries" in self:  # a vision-language chat: how the budget splits between the modalities
            share = self["kept_image_entries"] / self["kept_entries"] if self["kept_entries"] else 0.0
            lines.append(f"  image entries: {self['kept_image_entries']:,} kept ({share:.1%} of the kept entries) of "
                         f"{self['image_tokens']:,} image tokens seen")
        lines.append(f"  pages: {self['pages_in_use']:,} in use ({mib(self['page_bytes_in_use'])}, "
                     f"{self['page_slack_entries']:,} entries of slack), positions and scores "
                     f"{mib(self['metadata_bytes'])}, pool {mib(self['pool_capacity_bytes'])}")
        if "held_bytes" in self:
            lines.append(f"  memory: {mib(self['held_bytes'])} held, {mib(self['used_bytes'])} used "
                         "(cache.shrink() gives free pages back)")
        return "\n".join(lines)
