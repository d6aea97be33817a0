"""Paged decoding through flash-attn's ``flash_attn_with_kvcache`` when flash-attn is installed.

Every (sequence, KV head) stream is its own flash-attn "sequence" with one KV head, so per-stream
block tables and lengths (different in every head after global eviction) map directly: queries
``(N, 1, G, D)``, the page pool as ``(P, page_size, 1, D)``, ``block_table`` ``(N, max_pages)`` int32 and
``cache_seqlens`` ``(N,)``. flash-attn 2 needs pages of a multiple of 256 entries: build the cache with
``page_size=256`` to use it; otherwise (or without flash-attn, or on CPU) this returns ``None`` and the
Triton kernel runs.
"""

from __future__ import annotations

import functools

import torch


@functools.cache  # a failed import is not cached by Python: it would search sys.path every layer and token
def _flash_attn_with_kvcache():
    try:
        from flash_attn import flash_attn_with_kvcache
    except ImportError:
        return None
    return flash_attn_with_kvcache


def flash_paged_decode(
    query: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    rows: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """``query`` ``(N, G, D)`` over paged streams -> ``(N, G, D)``, or ``None`` when flash-attn cannot run it.
    ``rows`` ``(N,)``: the streams' rows of ``block_table`` / ``lengths`` (default: the first N)."""
    fn = _flash_attn_with_kvcache()
    if fn is None or not query.is_cuda or key_pool.shape[1] % 256 or query.dtype not in (torch.float16, torch.bfloat16):
        return None
    N, G, D = query.shape
    if rows is not None:
        block_table, lengths = block_table[rows], lengths[rows]
    else:  # flash-attn requires exactly one table row and length per query sequence
        block_table, lengths = block_table[:N], lengths[:N]
    out = fn(
        query[:, None],  # (N, 1, G, D): one new token, G query heads on one KV head
        key_pool[:, :, None],
        value_pool[:, :, None],
        cache_seqlens=lengths.to(torch.int32),
        block_table=block_table.clamp_min(0).to(torch.int32),
        softmax_scale=scale,
        causal=False,  # every kept entry precedes the new token
    )
    return out[:, 0]
