"""Attention over :class:`~retention.cache.hf.RetentionCache`'s kept entries: which path a layer's queries take.

A single decoded token on CUDA (or forced for tests) reads the pages in place (FlashAttention's paged kernel where it
applies, else the Triton kernel); a decode step :class:`~retention.cache.graph_decode.GraphDecoder` planned on the CPU
runs the reference paged attention; everything else attends over the padded view the append gathered.
"""

from __future__ import annotations

import os

import torch

from .attention import padded_attention, paged_decode_reference


def triton_decodes(t: torch.Tensor) -> bool:
    """Whether paged decoding runs the Triton kernel for ``t``'s device: on CUDA, or forced for tests."""
    return t.is_cuda or os.environ.get("RETENTION_FORCE_TRITON") == "1"


class AttentionMixin:
    """Attention of :class:`~retention.cache.hf.RetentionCache`: ``update`` leaves, per layer, a view in ``_views``
    (the padded view or ``None`` for the paged path, the query positions, and ``held``: see
    :func:`~retention.cache.attention.padded_attention`); :meth:`retention_attend` consumes it."""

    def _paged_decode(self, key_states: torch.Tensor, T: int) -> bool:
        """Single-token decoding on CUDA (or forced for tests) goes through the Triton paged kernel."""
        if T != 1 or self.policy.needs_queries or self.page_size & (self.page_size - 1):
            return False
        if not triton_decodes(key_states):
            return False
        return not bool(self._pad_entries.any())  # (host) padding entries are masked by the padded path only

    def retention_attend(self, layer: int, query: torch.Tensor, scaling: float | None) -> torch.Tensor:
        """Attention of ``query`` ``(B, Hq, Q, D)`` over the layer's kept entries -> ``(B, Q, Hq, D)``."""
        view, qpos, held = self._views.pop(layer)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        if view is None:  # paged decode: one query per stream, every kept entry is in its past
            from .flash import flash_paged_decode
            from .triton_decode import paged_decode_triton

            B, Hq, _, D = query.shape
            H = self.num_kv_heads
            rows = self.store.streams(layer)
            q = query.reshape(B, H, Hq // H, D).reshape(B * H, Hq // H, D)
            store, pool = self.store, self.store.pool
            out = flash_paged_decode(q, pool.keys, pool.values, store.block_table, store.lengths, scale, rows=rows)
            if out is None and self.planning and not triton_decodes(q):  # GraphDecoder on the CPU
                out = paged_decode_reference(q, pool.keys, pool.values, store.block_table[rows], store.lengths[rows],
                                             scale)
            if out is None:  # the kernel reads the layer's rows of the block table in place
                # a graph replays the grid it recorded: the table's width then, not the host's longest stream now
                longest = None if self.planning else store.longest(layer)
                out = paged_decode_triton(q, pool.keys, pool.values, store.block_table, store.lengths, scale, rows=rows,
                                          longest=longest)
            return out.reshape(B, Hq, D)[:, None]
        if self.policy.needs_queries:
            self.policy.observe(layer, query, view, qpos)
        return padded_attention(query, view.keys, view.values, view.pos, view.valid, qpos, scale, held=held)
