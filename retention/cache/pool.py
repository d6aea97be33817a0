"""A pool of fixed-size KV pages shared by every (sequence, layer, KV head) stream of one cache.

Each page holds ``page_size`` entries; an entry is one token in one KV head of one layer: its key and
value ``(D,)``, its ``log_beta`` (float32) and its true position (int64, the token's index in its
sequence). Pages are handed out from a free stack and returned to it; the pool grows by reallocating
its tensors (page ids stay valid) and shrinks only when asked (:meth:`PagePool.shrink`: the pages in use move to
the lowest ids, and the caller renumbers its block tables).
"""

from __future__ import annotations

import torch


class PagePool:
    """Storage of ``capacity`` pages: ``keys/values`` ``(P, page_size, D)``, ``log_beta/pos`` ``(P, page_size)``.

    ``owner`` ``(P,)`` int64 records which stream holds a page (-1 = free): it makes leaks and double
    frees detectable (:meth:`check`) and costs one write per page handed out or returned.
    """

    def __init__(
        self,
        head_dim: int,
        page_size: int = 16,
        capacity: int = 64,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if page_size < 1 or capacity < 1 or head_dim < 1:
            raise ValueError(f"page_size, capacity and head_dim must be positive, got {page_size}, {capacity}, "
                             f"{head_dim}")
        self.page_size, self.head_dim, self.dtype, self.device = page_size, head_dim, dtype, torch.device(device)
        self.capacity = 0
        self.keys = torch.empty(0, page_size, head_dim, dtype=dtype, device=self.device)
        self.values = torch.empty_like(self.keys)
        self.log_beta = torch.empty(0, page_size, dtype=torch.float32, device=self.device)
        self.pos = torch.empty(0, page_size, dtype=torch.long, device=self.device)
        self.owner = torch.empty(0, dtype=torch.long, device=self.device)
        self._free = torch.empty(0, dtype=torch.long, device=self.device)  # stack; top = _n_free
        self._n_free = 0
        self.grow(capacity)

    # -- bookkeeping -------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return self._n_free

    @property
    def num_used(self) -> int:
        return self.capacity - self._n_free

    def page_bytes(self) -> int:
        """Bytes of one page's keys and values (metadata excluded)."""
        return 2 * self.page_size * self.head_dim * self.keys.element_size()

    def grow(self, min_capacity: int) -> None:
        """Reallocate to at least ``min_capacity`` pages (doubling); existing pages keep their ids."""
        if min_capacity <= self.capacity:
            return
        new = max(min_capacity, 2 * self.capacity)
        extra = new - self.capacity

        def extend(t: torch.Tensor, fill: float | int = 0) -> torch.Tensor:
            pad = torch.full((extra, *t.shape[1:]), fill, dtype=t.dtype, device=t.device)
            return torch.cat([t, pad])

        self.keys, self.values = extend(self.keys), extend(self.values)
        self.log_beta, self.pos, self.owner = extend(self.log_beta), extend(self.pos, -1), extend(self.owner, -1)
        free = torch.empty(new, dtype=torch.long, device=self.device)
        # new pages go under the existing free ones (the stack's top is handed out first), so freed pages and
        # then the lowest new ids are reused first (denser memory)
        free[:extra] = torch.arange(new - 1, self.capacity - 1, -1, device=self.device)
        free[extra : extra + self._n_free] = self._free[: self._n_free]
        self._free, self._n_free, self.capacity = free, self._n_free + extra, new

    def shrink(self, spare: int = 0) -> torch.Tensor:
        """Give back every free page but ``spare``: the pages in use move, in id order, to ids ``0..num_used-1`` and
        the tensors are reallocated to ``num_used + spare`` pages (at least one). Returns ``new_id`` ``(old
        capacity,)`` int64, the new id of each old page (-1 for a page that was free): the owner of the block tables
        must renumber them with it."""
        if spare < 0:
            raise ValueError(f"spare must be >= 0 pages, got {spare}")
        used = torch.nonzero(self.owner >= 0).flatten()  # ascending: the pages keep their order
        n_used = used.numel()
        new = max(n_used + spare, 1)
        new_id = torch.full((self.capacity,), -1, dtype=torch.long, device=self.device)
        new_id[used] = torch.arange(n_used, device=self.device)
        if new == self.capacity and bool((used == new_id[used]).all()):
            return new_id  # nothing to move and nothing to give back

        def take(t: torch.Tensor, fill: float | int = 0) -> torch.Tensor:
            out = torch.full((new, *t.shape[1:]), fill, dtype=t.dtype, device=t.device)
            out[:n_used] = t[used]  # a copy: the old tensor's memory is released with it
            return out

        self.keys, self.values = take(self.keys), take(self.values)
        self.log_beta, self.pos, self.owner = take(self.log_beta), take(self.pos, -1), take(self.owner, -1)
        # the free stack: the lowest free id on top, as a fresh pool hands them out
        self._free = torch.cat([torch.arange(new - 1, n_used - 1, -1, device=self.device),
                                torch.full((n_used,), -1, dtype=torch.long, device=self.device)])
        self._n_free, self.capacity = new - n_used, new
        return new_id

    def alloc(self, owners: torch.Tensor) -> torch.Tensor:
        """One page per element of ``owners`` ``(n,)`` (stream ids); returns page ids ``(n,)``."""
        n = owners.numel()
        if n == 0:
            return torch.empty(0, dtype=torch.long, device=self.device)
        if n > self._n_free:
            self.grow(self.capacity + n - self._n_free)
        pages = self._free[self._n_free - n : self._n_free].flip(0).clone()
        self._n_free -= n
        self.owner[pages] = owners.to(self.device, torch.long)
        return pages

    def free(self, pages: torch.Tensor) -> None:
        """Return ``pages`` ``(n,)`` to the pool. Freeing a free page is a bug and raises."""
        n = pages.numel()
        if n == 0:
            return
        if bool((self.owner[pages] < 0).any()) or pages.unique().numel() != n:
            raise RuntimeError("double free of a KV page: the block tables are corrupt")
        self.owner[pages] = -1
        self._free[self._n_free : self._n_free + n] = pages.flip(0)
        self._n_free += n

    def check(self) -> None:
        """Raise if the free stack and the owner table disagree (a leak or a double free)."""
        free = self._free[: self._n_free]
        if free.unique().numel() != free.numel():
            raise AssertionError("a page is on the free stack twice")
        if bool((self.owner[free] >= 0).any()):
            raise AssertionError("a page is both free and owned")
        if int((self.owner < 0).sum()) != self._n_free:
            raise AssertionError("a page is neither free nor owned (leak)")
