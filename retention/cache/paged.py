"""Paged KV store: one block table and one length per (sequence, layer, KV head) stream.

Stream ``s = (b * L + l) * H + h`` for sequence ``b``, layer ``l`` and KV head ``h``. Entries of a
stream sit in its pages in append order (so in position order); eviction keeps a subset, compacts it
to the front of the stream's pages (order preserved) and returns the emptied pages to the pool: memory
is freed, not masked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .pool import PagePool


@dataclass
class PaddedView:
    """A layer's entries gathered into a padded layout.

    ``keys/values`` ``(B, H, Lmax, D)``, ``log_beta`` ``(B, H, Lmax)`` float32, ``pos`` ``(B, H, Lmax)``
    int64 (-1 for padding entries of left-padded batches), ``valid`` ``(B, H, Lmax)`` bool
    (slot < length of its stream).
    """

    keys: torch.Tensor
    values: torch.Tensor
    log_beta: torch.Tensor
    pos: torch.Tensor
    valid: torch.Tensor


def _cdiv(a: torch.Tensor, b: int) -> torch.Tensor:
    return (a + b - 1) // b


class PagedKVStore:
    """KV entries of ``batch`` sequences x ``num_layers`` x ``num_kv_heads`` streams in one :class:`PagePool`."""

    def __init__(
        self,
        batch: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        initial_pages: int | None = None,
    ) -> None:
        self.batch, self.num_layers, self.num_kv_heads = batch, num_layers, num_kv_heads
        self.num_streams = batch * num_layers * num_kv_heads
        self.page_size = page_size
        self.pool = PagePool(head_dim, page_size, initial_pages or max(self.num_streams, 1), dtype, device)
        dev = self.pool.device
        self.block_table = torch.full((self.num_streams, 1), -1, dtype=torch.long, device=dev)
        self.lengths = torch.zeros(self.num_streams, dtype=torch.long, device=dev)
        # the same lengths on the host: appends plan pages and read totals without waiting for the GPU
        # (one device sync per layer and token otherwise); the same tensor on CPU
        self.host_lengths = self.lengths if dev.type == "cpu" else torch.zeros_like(self.lengths, device="cpu")
        self._layer_streams: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # streams(layer), device and host
        self._all_streams: tuple[torch.Tensor, torch.Tensor] | None = None  # every stream, device and host

    # -- indexing ----------------------------------------------------------------------------------
    def streams(self, layer: int, batch_index: torch.Tensor | None = None) -> torch.Tensor:
        """Stream ids of ``layer`` ordered (b, h): ``(B * H,)``."""
        if batch_index is None:
            return self._cached_streams(layer)[0]
        L, H = self.num_layers, self.num_kv_heads
        return ((batch_index[:, None] * L + layer) * H + torch.arange(H, device=batch_index.device)[None]).flatten()

    def _cached_streams(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``streams(layer)`` on the device and on the host, built once per batch (asked twice per layer
        and token)."""
        if layer not in self._layer_streams:
            host = self.streams(layer, torch.arange(self.batch))
            self._layer_streams[layer] = (host.to(self.pool.device), host)
        return self._layer_streams[layer]

    def sequence_streams(self, b: int) -> torch.Tensor:
        """All streams of sequence ``b`` ordered (layer, head): ``(L * H,)``."""
        n = self.num_layers * self.num_kv_heads
        return torch.arange(b * n, (b + 1) * n, device=self.pool.device)

    def _ensure_columns(self, pages: int) -> None:
        if pages > self.block_table.shape[1]:
            new = max(pages, 2 * self.block_table.shape[1])
            pad = torch.full((self.num_streams, new - self.block_table.shape[1]), -1, dtype=torch.long,
                             device=self.block_table.device)
            self.block_table = torch.cat([self.block_table, pad], dim=1)

    # -- append / gather ---------------------------------------------------------------------------
    def append(self, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, log_beta: torch.Tensor,
               pos: torch.Tensor) -> None:
        """Append ``T`` entries to each stream in ``rows`` ``(R,)``.

        ``keys/values`` ``(R, T, D)``, ``log_beta`` ``(R, T)``, ``pos`` ``(R, T)`` int64 (on the host or the
        device).
        """
        self._append(rows, rows.cpu(), keys, values, log_beta, pos)

    def append_layer(self, layer: int, keys: torch.Tensor, values: torch.Tensor, log_beta: torch.Tensor,
                     pos: torch.Tensor) -> None:
        """:meth:`append` to the ``B * H`` streams of ``layer`` (ordered (b, h)), without a device sync."""
        self._append(*self._cached_streams(layer), keys, values, log_beta, pos)

    def _append(self, rows: torch.Tensor, host_rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                log_beta: torch.Tensor, pos: torch.Tensor) -> None:
        R, T = keys.shape[0], keys.shape[1]
        if T == 0:
            return
        slot, pos = self._reserve(rows, host_rows, T, pos)
        self.write(slot, keys.reshape(R * T, -1), values.reshape(R * T, -1), log_beta.reshape(-1), pos.reshape(-1))

    def _reserve(self, rows: torch.Tensor, host_rows: torch.Tensor, T: int,
                 pos: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Room for ``T`` more entries in each stream of ``rows`` ``(R,)``: pages allocated where needed and the
        lengths grown by ``T`` (host and device). Returns the entries' pool slots ``(R * T,)`` on the device and
        ``pos`` ``(R, T)`` moved there (None stays None)."""
        R = rows.shape[0]
        dev, ps = rows.device, self.page_size
        # page planning on the host copy of the lengths: nothing here waits for the device
        old = self.host_lengths[host_rows]
        new = old + T
        old_np, new_np = _cdiv(old, ps), _cdiv(new, ps)
        need = new_np - old_np  # (R,) pages each stream needs
        n_new = int(need.sum())
        if n_new:  # most decode steps fill open pages: no allocation and no block-table growth
            self._ensure_columns(int(new_np.max()))
            owner = host_rows.repeat_interleave(need)
            # column of each new page: old_np[r] + 0..need[r]-1
            first = torch.cumsum(need, 0) - need
            col = old_np.repeat_interleave(need) + torch.arange(n_new) - first.repeat_interleave(need)
            owner, col = owner.to(dev), col.to(dev)
            self.block_table[owner, col] = self.pool.alloc(owner)
        idx = old[:, None] + torch.arange(T)[None]  # (R, T) slots in each stream, on the host
        # one host-to-device copy carries the page columns, offsets and (host) positions
        on_host = pos is not None and pos.device.type == "cpu"
        host = [idx // ps, idx % ps] + ([pos.reshape(R, T)] if on_host else [])
        moved = torch.stack(host).to(dev, non_blocking=True)
        if pos is not None:
            pos = moved[2] if on_host else pos.reshape(R, T)
        slot = (self.block_table[rows[:, None], moved[0]] * ps + moved[1]).flatten()  # (R * T,) in the pool
        self.host_lengths[host_rows] = new
        self._lengths_to_device()
        return slot, pos

    def reserve_next(self) -> torch.Tensor:
        """Room for one more entry in every stream (a decode step of every sequence): slots ``(num_streams,)`` on the
        device, in stream order; the lengths grow by one. The caller writes the entries (:meth:`write`)."""
        if self._all_streams is None:
            host = torch.arange(self.num_streams)
            self._all_streams = (host.to(self.pool.device), host)
        return self._reserve(*self._all_streams, 1)[0]

    def release_next(self) -> None:
        """Undo :meth:`reserve_next` (a step that failed before its entries were read): every stream's length shrinks
        by one and a page the reservation opened goes back to the pool."""
        ps, new = self.page_size, self.host_lengths - 1
        opened = torch.nonzero(new % ps == 0).flatten()  # the reserved entry was the first of its page
        if opened.numel():
            rows, col = opened.to(self.block_table.device), (new[opened] // ps).to(self.block_table.device)
            self.pool.free(self.block_table[rows, col])
            self.block_table[rows, col] = -1
        self.host_lengths.copy_(new)
        self._lengths_to_device()

    def write(self, slot: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, log_beta: torch.Tensor,
              pos: torch.Tensor) -> None:
        """Store entries at pool ``slot`` ``(n,)``: ``keys/values`` ``(n, D)``, ``log_beta`` ``(n,)``, ``pos`` ``(n,)``
        int64. No host work: a CUDA graph can record it."""
        p = self.pool
        p.keys.view(-1, p.keys.shape[-1]).index_copy_(0, slot, keys.to(p.dtype))
        p.values.view(-1, p.values.shape[-1]).index_copy_(0, slot, values.to(p.dtype))
        p.log_beta.view(-1).index_copy_(0, slot, log_beta.to(torch.float32))
        p.pos.view(-1).index_copy_(0, slot, pos)

    def _lengths_to_device(self) -> None:
        # non_blocking from pageable memory: staged at once, so later host edits cannot race the copy
        if self.lengths is not self.host_lengths:
            self.lengths.copy_(self.host_lengths, non_blocking=True)

    def longest(self, layer: int) -> int:
        """Entries in the longest stream of ``layer``, read on the host (no device sync)."""
        return int(self.host_lengths[self._cached_streams(layer)[1]].max())

    def shortest(self, layer: int) -> int:
        """Entries in the shortest stream of ``layer``, read on the host (no device sync)."""
        return int(self.host_lengths[self._cached_streams(layer)[1]].min())

    def gather(self, rows: torch.Tensor, with_kv: bool = True, longest: int | None = None) -> PaddedView:
        """Entries of ``rows`` ``(R,)`` padded to the longest: tensors shaped ``(R, Lmax[, D])``.
        ``longest``: that length when the caller knows it on the host (spares a device sync)."""
        lengths = self.lengths[rows]
        if longest is None:
            longest = int(lengths.max()) if rows.numel() else 0
        n_pages = max(_cdiv(longest, self.page_size), 1)
        pages = self.block_table[rows, :n_pages].clamp_min(0)  # (R, np); unused columns masked below
        Lmax = n_pages * self.page_size
        valid = torch.arange(Lmax, device=rows.device)[None] < lengths[:, None]
        p, flat, R = self.pool, pages.flatten(), len(rows)

        def take(t: torch.Tensor) -> torch.Tensor:  # index_select: ~3x faster than t[pages] on CPU
            return t.index_select(0, flat).reshape(R, Lmax, *t.shape[2:])

        kv = (take(p.keys), take(p.values)) if with_kv else (None, None)
        return PaddedView(kv[0], kv[1], take(p.log_beta), take(p.pos), valid)

    def gather_layer(self, layer: int) -> PaddedView:
        """A layer's entries as ``(B, H, Lmax, ...)`` (see :class:`PaddedView`)."""
        v = self.gather(self.streams(layer), longest=self.longest(layer))
        B, H = self.batch, self.num_kv_heads

        def shape(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(B, H, *t.shape[1:])

        return PaddedView(shape(v.keys), shape(v.values), shape(v.log_beta), shape(v.pos), shape(v.valid))

    # -- eviction ----------------------------------------------------------------------------------
    def compact(self, rows: torch.Tensor, keep: torch.Tensor) -> None:
        """Keep the entries ``keep`` ``(R, Lpad)`` (bool, over the padded layout of :meth:`gather`) of
        streams ``rows`` ``(R,)``; move them to the front in order and free the emptied pages."""
        lengths = self.lengths[rows]
        Lpad = keep.shape[1]
        keep = keep & (torch.arange(Lpad, device=keep.device)[None] < lengths[:, None])
        new_len = keep.sum(1)
        r, src = keep.nonzero(as_tuple=True)
        dst = (torch.cumsum(keep, 1) - 1)[r, src]
        moved = src != dst
        if bool(moved.any()):
            r, src, dst = r[moved], src[moved], dst[moved]
            sp, so = self.block_table[rows[r], src // self.page_size], src % self.page_size
            dp, do = self.block_table[rows[r], dst // self.page_size], dst % self.page_size
            p = self.pool
            for t in (p.keys, p.values, p.log_beta, p.pos):
                t[dp, do] = t[sp, so]  # advanced-index read makes a copy first, so overlap is safe
        old_np, new_np = _cdiv(lengths, self.page_size), _cdiv(new_len, self.page_size)
        cols = torch.arange(self.block_table.shape[1], device=rows.device)[None]
        drop = (cols >= new_np[:, None]) & (cols < old_np[:, None])
        table = self.block_table[rows]
        self.pool.free(table[drop])
        table[drop] = -1
        self.block_table[rows] = table
        self.lengths[rows] = new_len
        if self.lengths is not self.host_lengths:
            self.host_lengths.copy_(self.lengths)  # evictions are rare next to appends: a sync is fine here

    def shrink(self, spare_pages: int = 0) -> None:
        """Give the free pages back to the allocator (see :meth:`PagePool.shrink`; ``spare_pages`` stay free for the
        next appends) and narrow the block table to the widest stream: afterwards the store holds about what it
        uses. Entries, their order and every stream's length are unchanged."""
        new_id = self.pool.shrink(spare_pages)
        listed = self.block_table >= 0
        table = self.block_table.clone()
        table[listed] = new_id[self.block_table[listed]]
        width = max(int(_cdiv(self.host_lengths, self.page_size).max()) if self.num_streams else 1, 1)
        self.block_table = table[:, :width].contiguous()

    def clear(self) -> None:
        """Free every page (the pool keeps its capacity)."""
        used = self.block_table[self.block_table >= 0]
        self.pool.free(used)
        self.block_table.fill_(-1)
        self.lengths.zero_()
        self.host_lengths.zero_()

    def select_batch(self, indices: torch.Tensor) -> None:
        """Keep sequences ``indices`` ``(B',)`` in that order and free the pages of the others.

        A sequence named more than once (beam search, several samples of one prompt) is copied: its
        first occurrence keeps its pages, each later one gets fresh pages holding the same entries.
        """
        dev = self.block_table.device
        n = self.num_layers * self.num_kv_heads
        indices = indices.to(dev, torch.long)
        if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= self.batch):
            raise IndexError(f"sequence indices must lie in [0, {self.batch}), got {indices.tolist()}")
        src = (indices[:, None] * n + torch.arange(n, device=dev)[None]).flatten()  # old stream of each new one
        gone = torch.ones(self.num_streams, dtype=torch.bool, device=dev)
        gone[src] = False
        dropped = self.block_table[gone]
        self.pool.free(dropped[dropped >= 0])
        table, lengths = self.block_table[src], self.lengths[src]
        order = indices.tolist()
        repeat = torch.tensor([b in order[:i] for i, b in enumerate(order)], dtype=torch.bool, device=dev)
        copies = repeat.repeat_interleave(n).nonzero().flatten()  # streams of sequences named before
        if copies.numel():
            n_pages = _cdiv(lengths[copies], self.page_size)
            used = torch.arange(table.shape[1], device=dev)[None] < n_pages[:, None]  # (c, columns)
            sub = table[copies]
            old_pages = sub[used]  # row-major: the order of the owners below
            new_pages = self.pool.alloc(copies.repeat_interleave(n_pages))
            p = self.pool
            for t in (p.keys, p.values, p.log_beta, p.pos):
                t[new_pages] = t[old_pages]
            sub[used] = new_pages
            table[copies] = sub
        self.block_table, self.lengths = table, lengths
        self.host_lengths = lengths if lengths.device.type == "cpu" else lengths.cpu()
        self.batch, self.num_streams = len(indices), len(src)
        self._layer_streams.clear()
        self._all_streams = None
        owned = self.block_table >= 0  # page owners follow the renumbered streams
        self.pool.owner[self.block_table[owned]] = (
            torch.arange(self.num_streams, device=dev)[:, None].expand_as(self.block_table)[owned])

    # -- reports -----------------------------------------------------------------------------------
    def entries_per_head(self) -> torch.Tensor:
        """Kept entries ``(batch, layers, kv_heads)``."""
        return self.lengths.reshape(self.batch, self.num_layers, self.num_kv_heads).clone()

    def check(self) -> None:
        """Raise if pages and block tables disagree (for tests and debugging)."""
        self.pool.check()
        n_pages = _cdiv(self.lengths, self.page_size)
        cols = torch.arange(self.block_table.shape[1], device=self.lengths.device)[None]
        used = cols < n_pages[:, None]
        if bool((self.block_table[used] < 0).any()) or bool((self.block_table[~used] >= 0).any()):
            raise AssertionError("block table does not match the stream lengths")
        pages = self.block_table[used]
        if pages.unique().numel() != pages.numel():
            raise AssertionError("a page is in two block-table slots")
        owners = torch.arange(self.num_streams, device=pages.device)[:, None].expand_as(self.block_table)[used]
        if not torch.equal(self.pool.owner[pages], owners):
            raise AssertionError("a page is owned by another stream than the one whose table lists it")
        if self.pool.num_used != pages.numel():
            raise AssertionError(f"{self.pool.num_used} pages owned but {pages.numel()} listed in block tables (leak)")
