"""Left padding in a batch: the cache's padding counts (which new tokens are real: :mod:`retention.padding`).

A padding token is stored like any other (so every stream of a row stays in step) at position -1, which no query
attends to; its entries are dropped at the row's first eviction and never count against the budget.
"""

from __future__ import annotations

from typing import Any

import torch


class PaddingMixin:
    """:class:`~retention.cache.hf.RetentionCache`'s padding bookkeeping: ``_pad_entries`` ``(B,)`` padding entries
    not yet dropped (host), ``_forward_pads`` ``(B,)`` padding tokens of this forward (host; ``None``: none),
    ``_start`` ``(B,)`` left-padding tokens, i.e. the position of each row's first real token."""

    @property
    def holds_padding(self) -> bool:
        """Whether some row holds padding entries not yet dropped (host counts: no device sync)."""
        return self._pad_entries is not None and bool(self._pad_entries.any())

    def _new_rows(self, batch: int) -> None:
        """Padding counts for ``batch`` new, empty rows (the counts live on the host: decoding reads them every
        layer)."""
        self._pad_entries = torch.zeros(batch, dtype=torch.long)
        self._start = torch.zeros(batch, dtype=torch.long, device=self.store.lengths.device)

    def _read_forward_padding(self, token_valid: torch.Tensor | None, t0: int, T: int) -> None:
        """At a forward's first layer: count its padding tokens per row (every layer sees the same padding, so it is
        read once per forward: the only device sync of an append)."""
        pads = None if token_valid is None else (~token_valid).sum(1).cpu()
        self._forward_pads = pads if pads is not None and bool(pads.any()) else None
        if self._forward_pads is not None:
            self._start += self._forward_pads.to(self._start.device)
            self._crop_floor = t0 + T

    def _positions(self, token_valid: torch.Tensor | None, t0: int, shape: tuple[int, int, int],
                   device: torch.device) -> torch.Tensor:
        """``(B, T)`` true positions of a layer's new tokens ``t0 ..``, -1 for padding (then counted into
        ``_pad_entries``, ``H`` entries a token); on the host while nothing is padded. ``shape``: ``(B, H, T)``."""
        B, H, T = shape
        pos = (t0 + torch.arange(T)).expand(B, T)  # on the host: travels with the append's slots
        if self._forward_pads is not None:
            pos = torch.where(token_valid.to(device), pos.to(device, non_blocking=True), -1)
            self._pad_entries += self._forward_pads * H
        return pos
