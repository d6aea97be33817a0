"""Attention of new queries over a cache whose KV heads keep different numbers of entries.

CPU / reference path: the layer's pages are gathered into a padded ``(B, H_kv, Lmax, D)`` layout with
a validity mask; the G query heads of a KV group are folded into the query axis so one batched SDPA
call covers every head (no Python loop over heads). While nothing has been evicted or padded (a prompt's
first chunks) the mask is plain lower-right causal, and SDPA runs without one built per head. On CUDA,
single-token decoding goes through the Triton paged kernel (:mod:`retention.cache.triton_decode`) without
materialising the padded copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def padded_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_pos: torch.Tensor,
    valid: torch.Tensor,
    query_pos: torch.Tensor,
    scale: float,
    held: int | None = None,
) -> torch.Tensor:
    """Causal attention by true positions.

    ``query`` ``(B, Hq, Q, D)``; ``keys/values`` ``(B, H, L, D)`` with ``Hq = G * H``; ``key_pos``
    ``(B, H, L)`` int64 (-1 = padding token); ``valid`` ``(B, H, L)`` bool; ``query_pos`` ``(B, Q)``
    (-1 = padding token). Query ``q`` sees valid keys with ``0 <= pos <= query_pos[q]``. Returns
    ``(B, Q, Hq, D)`` (transformers' attention-output layout).

    ``held=N`` is the caller's word (read on the host, so no device sync) that nothing was evicted or padded: every
    stream's first N entries are positions ``0..N-1`` in order (the rest of ``L`` is the padded view's invalid
    tail) and the queries are positions ``N-Q..N-1``. The mask is then lower-right causal over those N, so
    ``key_pos``, ``valid`` and ``query_pos`` go unread and SDPA gets no per-head mask (one 4k-token prompt
    chunk of SmolLM2 on 2 CPU cores: about 5x faster per layer).
    """
    B, Hq, Q, D = query.shape
    H = keys.shape[1]
    G = Hq // H
    if held is not None:
        # each query head reads its KV head's copy (heads h*G .. h*G+G-1 share KV head h, as the fold below)
        k, v = (t[:, :, :held].to(query.dtype).repeat_interleave(G, dim=1) for t in (keys, values))
        # square: plain causal; one query (decoding): every key; else the last Q keys causal, the rest all seen
        # (torch.nn.attention.bias.causal_lower_right would import Triton into every process that imports this)
        mask = None if Q in (1, held) else torch.ones(Q, held, dtype=torch.bool, device=query.device).tril(held - Q)
        out = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, is_causal=Q == held > 1, scale=scale)
        return out.transpose(1, 2)
    q = query.reshape(B, H, G * Q, D)
    mask = visible_keys(key_pos, valid, query_pos, G)
    out = F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask, scale=scale)
    return out.reshape(B, Hq, Q, D).transpose(1, 2)


def visible_keys(key_pos: torch.Tensor, valid: torch.Tensor, query_pos: torch.Tensor, G: int) -> torch.Tensor:
    """``(B, H, G * Q, L)`` bool: which keys each query sees in :func:`padded_attention`'s folded layout (the G
    query heads of a KV head along the query axis). Shapes as there."""
    B, H, L = key_pos.shape
    Q = query_pos.shape[1]
    ok = valid[:, :, None, :] & (key_pos[:, :, None, :] >= 0) & (key_pos[:, :, None, :] <= query_pos[:, None, :, None])
    # padding queries see nothing; give them every valid key so their (unused) output stays finite
    ok = ok | (~ok.any(-1, keepdim=True) & valid[:, :, None, :])
    return ok[:, :, None].expand(B, H, G, Q, L).reshape(B, H, G * Q, L)


def paged_decode_reference(
    query: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per (sequence, KV head) stream over paged KV: the reference for the Triton kernel.

    ``query`` ``(N, G, D)`` (N streams, G query heads sharing each stream's KV head); pools
    ``(P, page_size, D)``; ``block_table`` ``(N, max_pages)`` int (entries past a stream's pages
    unused); ``lengths`` ``(N,)``. Returns ``(N, G, D)`` in the query dtype (float32 accumulation).
    Streams of length 0 give zeros.
    """
    N, G, D = query.shape
    ps = key_pool.shape[1]
    n_pages = max(int((lengths.max() + ps - 1) // ps) if N else 0, 1)
    pages = block_table[:, :n_pages].long().clamp_min(0)
    k = key_pool[pages].reshape(N, n_pages * ps, D).float()
    v = value_pool[pages].reshape(N, n_pages * ps, D).float()
    valid = torch.arange(n_pages * ps, device=query.device)[None] < lengths[:, None]
    s = torch.einsum("ngd,nld->ngl", query.float(), k) * scale
    s = s.masked_fill(~valid[:, None], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("ngl,nld->ngd", p, v).to(query.dtype)
