"""Paged decode attention in Triton: one new query token per (sequence, KV head) stream.

Each stream's kept entries live in pages of a shared pool, found through its block-table row; streams
have different lengths (global eviction gives every head its own). Split-K over pages: program
``(stream, split)`` walks its share of the stream's pages for all G query heads of the KV group at once
(the keys are loaded once per group) and writes a partial softmax (max, sum, weighted values); a second
kernel merges the partials in log-sum-exp form. Two launches per layer and token, reading the block
table and lengths in place (decoding a small model is bound by launches, not by the GPU's arithmetic).
:func:`retention.cache.attention.paged_decode_reference` is the oracle.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_split(
    Q, KP, VP, BT, LEN, ROWS, PO, PM, PL,
    stride_bt, pages_per_split, scale,
    G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
):
    n = tl.program_id(0)
    split = tl.program_id(1)
    n_splits = tl.num_programs(1)
    row = tl.load(ROWS + n).to(tl.int64)  # this stream's row of the block table and lengths
    length = tl.load(LEN + row)
    rg = tl.arange(0, BLOCK_G)
    rd = tl.arange(0, BLOCK_D)
    rp = tl.arange(0, PAGE)
    mask_g = rg < G
    mask_d = rd < D
    q = tl.load(Q + n * G * D + rg[:, None] * D + rd[None, :], mask=mask_g[:, None] & mask_d[None, :],
                other=0.0).to(tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    p_lo = split * pages_per_split
    p_hi = tl.minimum(p_lo + pages_per_split, tl.cdiv(length, PAGE))
    for pg in range(p_lo, p_hi):
        page = tl.load(BT + row * stride_bt + pg).to(tl.int64)
        slot = pg * PAGE + rp
        mask_p = slot < length
        kv_off = page * PAGE * D + rp[:, None] * D + rd[None, :]
        kv_mask = mask_p[:, None] & mask_d[None, :]
        k = tl.load(KP + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(VP + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], 2) * scale  # (G, PAGE)
        s = tl.where(mask_p[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], 1)
        m_i = m_new
    base = (n * n_splits + split) * G
    tl.store(PO + (base + rg)[:, None] * D + rd[None, :], acc, mask=mask_g[:, None] & mask_d[None, :])
    tl.store(PM + base + rg, m_i, mask=mask_g)
    tl.store(PL + base + rg, l_i, mask=mask_g)


@triton.jit
def _paged_decode_merge(
    PO, PM, PL, OUT, n_splits,
    G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program ``n`` merges stream n's partials: rescale each by exp(m_split - m_max). Empty streams
    (every split empty: m = -inf, l = 0) give zeros."""
    n = tl.program_id(0)
    rg = tl.arange(0, BLOCK_G)
    rd = tl.arange(0, BLOCK_D)
    mask_g = rg < G
    mask = mask_g[:, None] & (rd < D)[None, :]
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    for s in range(n_splits):
        m = tl.maximum(m, tl.load(PM + (n * n_splits + s) * G + rg, mask=mask_g, other=float("-inf")))
    m = tl.where(m == float("-inf"), 0.0, m)
    denom = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for s in range(n_splits):
        base = (n * n_splits + s) * G
        w = tl.exp(tl.load(PM + base + rg, mask=mask_g, other=float("-inf")) - m)  # 0 for empty splits
        denom += tl.load(PL + base + rg, mask=mask_g, other=0.0) * w
        acc += tl.load(PO + (base + rg)[:, None] * D + rd[None, :], mask=mask, other=0.0) * w[:, None]
    out = tl.where(denom[:, None] > 0, acc / tl.maximum(denom, 1e-30)[:, None], 0.0)
    tl.store(OUT + (n * G + rg)[:, None] * D + rd[None, :], out.to(OUT.dtype.element_ty), mask=mask)


def split_plan(max_pages: int, pages_per_split: int | None = None) -> tuple[int, int]:
    """``(pages_per_split, n_splits)`` covering ``max_pages`` pages: by default up to 8 splits, enough to
    fill the GPU when streams are few and long."""
    if pages_per_split is None:
        pages_per_split = max(1, triton.cdiv(max_pages, 8))
    return pages_per_split, max(1, triton.cdiv(max_pages, pages_per_split))


def paged_decode_triton(
    query: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    pages_per_split: int | None = None,
    rows: torch.Tensor | None = None,
    longest: int | None = None,
) -> torch.Tensor:
    """Same contract as :func:`~retention.cache.attention.paged_decode_reference`: ``query`` ``(N, G, D)``,
    pools ``(P, page_size, D)``, ``block_table`` ``(S, max_pages)``, ``lengths`` ``(S,)`` -> ``(N, G, D)``.
    ``rows`` ``(N,)``: stream n's row of ``block_table`` / ``lengths`` (default: row n). ``longest``: the
    longest of those streams in entries, known on the host (an upper bound is fine; default: the table's
    width); the splits then share only the pages in use, not a table widened by doubling or left wide by
    evictions. A value below a stream's length drops that stream's tail."""
    N, G, D = query.shape
    # the kernel computes offsets from these shapes: a mismatch would read the wrong entries, not fail
    if key_pool.ndim != 3 or value_pool.shape != key_pool.shape or key_pool.shape[2] != D:
        raise ValueError(f"key and value pools must both be (pages, page_size, {D}) for queries {tuple(query.shape)}; "
                         f"got {tuple(key_pool.shape)} and {tuple(value_pool.shape)}")
    if block_table.dtype.is_floating_point or lengths.dtype.is_floating_point:
        raise ValueError(f"block_table and lengths must be integer tensors, got {block_table.dtype} and "
                         f"{lengths.dtype}")
    if block_table.ndim != 2 or lengths.shape != block_table.shape[:1]:
        raise ValueError(f"block_table must be (streams, max_pages) with lengths (streams,); got "
                         f"{tuple(block_table.shape)} and {tuple(lengths.shape)}")
    if rows is not None and rows.shape != (N,):
        raise ValueError(f"rows must be ({N},), one block-table row per query stream; got {tuple(rows.shape)}")
    if rows is None and N > block_table.shape[0]:  # stream n reads row n: past the table it read other memory
        raise ValueError(f"{N} query streams but {block_table.shape[0]} block-table rows: pass rows, or one row "
                         "per stream")
    if not query.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("the Triton decode kernel needs CUDA tensors (or TRITON_INTERPRET=1 set before import for "
                         "CPU testing); use paged_decode_reference on the CPU")
    page = key_pool.shape[1]
    if page & (page - 1):
        raise ValueError(f"page size must be a power of two for the Triton decode kernel, got {page}")
    max_pages = block_table.shape[1]
    if longest is not None:
        max_pages = min(max_pages, triton.cdiv(longest, page))
    pages_per_split, n_splits = split_plan(max_pages, pages_per_split)
    if rows is None:
        rows = torch.arange(N, device=query.device)
    q = query.contiguous()
    bt, lens = block_table.contiguous(), lengths.contiguous()  # int32 or int64, read in place
    po = torch.empty(N, n_splits, G, D, dtype=torch.float32, device=query.device)
    pm = torch.empty(N, n_splits, G, dtype=torch.float32, device=query.device)
    pl = torch.empty_like(pm)
    out = torch.empty_like(q)
    blocks = dict(G=G, BLOCK_G=max(2, triton.next_power_of_2(G)), D=D, BLOCK_D=max(16, triton.next_power_of_2(D)))
    warps = 1 if os.environ.get("TRITON_INTERPRET") == "1" else 4
    _paged_decode_split[(N, n_splits)](
        q, key_pool.contiguous(), value_pool.contiguous(), bt, lens, rows, po, pm, pl,
        bt.stride(0), pages_per_split, scale, PAGE=page, num_warps=warps, **blocks,
    )
    _paged_decode_merge[(N,)](po, pm, pl, out, n_splits, num_warps=warps, **blocks)
    return out
