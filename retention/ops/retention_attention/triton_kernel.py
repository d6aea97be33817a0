"""Retention-gated attention as FlashAttention-2-style Triton kernels (forward and backward).

Same math as :mod:`.reference` (the oracle the tests compare against):

    score[t, i] = q_t . k_i * scale + (t - i) * log_beta_i      (i <= t, same document)

Tokens are handled as *segments*: a segment is one document of a packed row (``cu_seqlens``, cut at
row ends) or one batch row. Queries of a segment are the last ``q_len`` of its ``k_len`` keys
(``q_len < k_len`` is a decode step with a cache). The launch grid is ``(blocks of the longest
segment, heads, segments)``; a program past its segment's end returns at once, and block indices run
backwards so the most expensive blocks (the last queries, the first keys) start first. Blocks outside
the document are never visited and causal skipping is index arithmetic. Key/query block pairs strictly
below the diagonal run without any masks; only the diagonal pairs (and a ragged tail) pay for them.

Kernels (all accumulate in fp32; the decay bias is computed in fp32, scores in the log2 domain):
  _fwd_kernel    online softmax over key blocks; writes ``out`` and the log-sum-exp (natural log).
  _delta_kernel  backward preprocess: ``delta_t = sum_d dout_t * out_t``.
  _dkdv_kernel   one program per (segment, KV head, key block) owns dK, dV and d log_beta of its keys
                 and loops over the query heads of its GQA group and the query blocks at or after its
                 keys: no atomics. Computed transposed (keys x queries), so no tile is transposed in
                 registers.
  _dq_kernel     one program per (segment, query head, query block) loops over its key blocks.

Tile sizes, warps and pipeline stages are autotuned on the GPU per head dim, GQA group, dtype and
length bucket (the candidates are ``FWD_TILES``, ``DKDV_TILES``, ``DQ_TILES``); the interpreter runs
one small tile. Inputs may be strided views (e.g. ``(B, H, T, D)`` tensors transposed to
``(B, T, H, D)``) as long as the head dimension is contiguous; nothing is copied for them.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl

from .reference import _check
from .segments import Segments, segments  # noqa: F401  (the kernels' launch grid; also used by capacity)

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


# ----------------------------------------------------------------------------------------------
# launch configuration
# ----------------------------------------------------------------------------------------------

# (outer block, inner block, warps, stages): forward and dQ tile queries x keys, dK dV keys x queries.
# The first entry of each list is the one fp32 inputs use (exact fp32 dot products in big tiles take
# minutes to compile and overflow shared memory; fp32 is a correctness path, not a speed target).
FWD_TILES = [(64, 32, 4, 2), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3)]
DKDV_TILES = [(64, 32, 4, 2), (128, 32, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 8, 2)]
DQ_TILES = [(64, 32, 4, 2), (128, 32, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 8, 2)]
INTERPRET_TILE = (16, 16)


def _configs(outer: str, inner: str, tiles: list[tuple[int, int, int, int]]) -> list:
    if _INTERPRET:  # the interpreter cannot autotune over several configs
        return [triton.Config({outer: INTERPRET_TILE[0], inner: INTERPRET_TILE[1]}, num_warps=1, num_stages=1)]
    return [triton.Config({outer: o, inner: i}, num_warps=w, num_stages=st) for o, i, w, st in tiles]


def _prune(configs: list, named_args: dict, **kwargs: Any) -> list:
    """fp32 inputs take the first (small) tile only; 16-bit inputs with d > 64 drop 128 x 128 tiles (their
    shared memory need passes the GPU's)."""
    args = {**named_args, **kwargs}
    if args["Q"].dtype == torch.float32:
        return configs[:1]
    big = [c for c in configs[1:] if not (args["D"] > 64 and min(c.kwargs.values()) >= 128)]
    return big or configs[:1]


def _autotune(configs: list):
    """``triton.autotune`` keyed on head dim, GQA group, length bucket (and, implicitly, the dtypes);
    results are kept on disk where this Triton supports it, so a restarted job does not tune again."""
    import inspect

    params = inspect.signature(triton.autotune).parameters
    extra = {"cache_results": True} if "cache_results" in params else {}
    if not _INTERPRET:
        extra["prune_configs_by"] = {"early_config_prune": _prune}
    return triton.autotune(configs=configs, key=["D", "G", "T_KEY"], **extra)


def _length_bucket(n: int) -> int:
    """The autotune key for a length: its power of two (the best tile changes with length, little within 2x)."""
    return triton.next_power_of_2(max(int(n), 1))


# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _log2_beta(lb):
    """log_beta (any float dtype) -> log2(beta) in fp32, floored at the reference's ``LOG_BETA_FLOOR`` (-1e30) so
    the scaling cannot overflow to -inf (0 * -inf on the diagonal would be NaN); NaN stays NaN."""
    lb = lb.to(tl.float32)
    return tl.where(lb < -1e30, -1e30, lb) * 1.4426950408889634


@triton.jit
def _segment(SEG_B, SEG_T0, SEG_QLEN, SEG_KLEN):
    """The segment of this program (grid axis 2): (batch row, first row position, q_len, k_len)."""
    seg = tl.program_id(2)
    b = tl.load(SEG_B + seg).to(tl.int64)  # int64 offsets: B * T * H * D may pass 2**31
    t0 = tl.load(SEG_T0 + seg).to(tl.int64)
    qlen = tl.load(SEG_QLEN + seg)
    klen = tl.load(SEG_KLEN + seg)
    return b, t0, qlen, klen


@triton.jit
def _load_rows(ptr, rows, stride, rd, mask_rows, mask_d, EVEN_ROWS: tl.constexpr, EVEN_D: tl.constexpr):
    """A ``(len(rows), BLOCK_D)`` tile of rows ``rows`` (row stride ``stride``, head dim contiguous);
    masks only where the tile may leave the rows (``EVEN_ROWS`` false) or the head dim (``EVEN_D`` false)."""
    ptrs = ptr + rows.to(tl.int64)[:, None] * stride + rd[None, :]
    if EVEN_ROWS:
        if EVEN_D:
            return tl.load(ptrs)
        return tl.load(ptrs, mask=mask_d[None, :], other=0.0)
    return tl.load(ptrs, mask=mask_rows[:, None] & mask_d[None, :], other=0.0)


@triton.jit
def _load_cols(ptr, cols, stride, rd, mask_cols, mask_d, EVEN_COLS: tl.constexpr, EVEN_D: tl.constexpr):
    """The transposed tile ``(BLOCK_D, len(cols))`` of rows ``cols``: loaded so, it feeds ``tl.dot`` as the
    right operand with no transpose in registers."""
    ptrs = ptr + cols.to(tl.int64)[None, :] * stride + rd[:, None]
    if EVEN_COLS:
        if EVEN_D:
            return tl.load(ptrs)
        return tl.load(ptrs, mask=mask_d[:, None], other=0.0)
    return tl.load(ptrs, mask=mask_cols[None, :] & mask_d[:, None], other=0.0)


@triton.jit
def _key_block_scores(q, rq, K_blk, LB_blk, skt, slbt, rd, mask_d, n0, klen, qk_scale,
                      BLOCK_N: tl.constexpr, MASK: tl.constexpr, EVEN_D: tl.constexpr, PREC: tl.constexpr):
    """The key block at ``n0`` against the query tile ``q``: its positions ``rn`` and their mask, the transposed K
    tile ``(BLOCK_D, BLOCK_N)``, the distances ``(BLOCK_M, BLOCK_N)`` and the biased scores ``s`` in the log2 domain
    (unmasked; the forward and the dQ loop both read a block so, and mask as each needs)."""
    rn = n0 + tl.arange(0, BLOCK_N)
    mask_n = rn < klen
    kT = _load_cols(K_blk, rn, skt, rd, mask_n, mask_d, not MASK, EVEN_D)
    if MASK:
        lb = _log2_beta(tl.load(LB_blk + rn.to(tl.int64) * slbt, mask=mask_n, other=0.0))
    else:
        lb = _log2_beta(tl.load(LB_blk + rn.to(tl.int64) * slbt))
    dist = rq[:, None] - rn.to(tl.float32)[None, :]
    s = tl.dot(q, kT, input_precision=PREC) * qk_scale + dist * lb[None, :]
    return rn, mask_n, kT, dist, s


@triton.jit
def _fwd_inner(
    acc, l_i, m_i, q, rq, K_blk, V_blk, LB_blk, skt, svt, slbt, rd, mask_d, n_lo, n_hi, klen, qk_scale,
    BLOCK_N: tl.constexpr, MASK: tl.constexpr, EVEN_D: tl.constexpr, PREC: tl.constexpr,
):
    """Online-softmax update over key blocks [n_lo, n_hi). Off the diagonal (``MASK`` false) every key is
    in range and visible to every query, so nothing is masked; ``s`` is in the log2 domain."""
    for n0 in range(n_lo, n_hi, BLOCK_N):
        rn, mask_n, kT, dist, s = _key_block_scores(q, rq, K_blk, LB_blk, skt, slbt, rd, mask_d, n0, klen, qk_scale,
                                                    BLOCK_N, MASK, EVEN_D, PREC)
        v = _load_rows(V_blk, rn, svt, rd, mask_n, mask_d, not MASK, EVEN_D)
        if MASK:
            s = tl.where((dist >= 0) & mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new
    return acc, l_i, m_i


@_autotune(_configs("BLOCK_M", "BLOCK_N", FWD_TILES))
@triton.jit
def _fwd_kernel(
    Q, K, V, LB, O, LSE, SEG_B, SEG_T0, SEG_QLEN, SEG_KLEN,
    sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, slbb, slbh, slbt,
    Tq, Hq, G, qk_scale, T_KEY,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
):
    h = tl.program_id(1)
    hk = h // G
    b, t0, qlen, klen = _segment(SEG_B, SEG_T0, SEG_QLEN, SEG_KLEN)
    n_blocks = tl.cdiv(qlen, BLOCK_M)
    if tl.program_id(0) >= n_blocks:
        return
    mblk = n_blocks - 1 - tl.program_id(0)  # the last query blocks see the most keys: they start first
    off = klen - qlen  # query j sits at key position j + off
    rm = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    rd = tl.arange(0, BLOCK_D)
    mask_m = rm < qlen
    mask_d = rd < D
    q = _load_rows(Q + b * sqb + t0 * sqt + h * sqh, rm, sqt, rd, mask_m, mask_d, False, D == BLOCK_D)
    rq = (rm + off).to(tl.float32)
    K_blk = K + b * skb + t0 * skt + hk * skh
    V_blk = V + b * svb + t0 * svt + hk * svh
    LB_blk = LB + b * slbb + hk * slbh + t0 * slbt
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    first = mblk * BLOCK_M + off  # position of the block's first query (< klen)
    lo = ((first + 1) // BLOCK_N) * BLOCK_N  # key blocks before lo are visible to every query here
    hi = tl.minimum(klen, first + BLOCK_M)  # keys from hi on are in every query's future
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, rq, K_blk, V_blk, LB_blk, skt, svt, slbt, rd, mask_d,
                               0, lo, klen, qk_scale, BLOCK_N, False, D == BLOCK_D, PREC)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, rq, K_blk, V_blk, LB_blk, skt, svt, slbt, rd, mask_d,
                               lo, hi, klen, qk_scale, BLOCK_N, True, D == BLOCK_D, PREC)
    # every real query sees at least its own key, so l_i >= 1 there; rows past q_len are not stored
    out = acc / l_i[:, None]
    q_mask = mask_m[:, None] & mask_d[None, :]
    tl.store(O + (b * Tq + t0 + rm)[:, None] * (Hq * D) + h * D + rd[None, :], out.to(O.dtype.element_ty), mask=q_mask)
    lse = (m_i + tl.log2(l_i)) * 0.6931471805599453
    tl.store(LSE + (b * Hq + h) * Tq + t0 + rm, lse, mask=mask_m)


@triton.jit
def _delta_kernel(O, DO, DELTA, sdb, sdt, sdh, n_tok, Tq, Hq, D: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_D: tl.constexpr):
    """``delta[b, h, t] = sum_d dout * out`` in fp32; ``out`` is contiguous, ``dout`` strided."""
    h = tl.program_id(1)
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rd = tl.arange(0, BLOCK_D)
    mask = (tok < n_tok)[:, None] & (rd < D)[None, :]
    b = (tok // Tq).to(tl.int64)
    t = (tok % Tq).to(tl.int64)
    o = tl.load(O + (b * Tq + t)[:, None] * (Hq * D) + h * D + rd[None, :], mask=mask, other=0.0)
    do = tl.load(DO + (b * sdb + t * sdt)[:, None] + h * sdh + rd[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + (b * Hq + h) * Tq + t, delta, mask=tok < n_tok)


@triton.jit
def _dkdv_inner(
    dk, dv, dlb, k, v, lb, rk, Q_blk, DO_blk, LSE_blk, DELTA_blk, sqt, sdt, rd, mask_d, m_lo, m_hi, qlen, off, qk_scale,
    BLOCK_M: tl.constexpr, MASK: tl.constexpr, EVEN_D: tl.constexpr, PREC: tl.constexpr,
):
    """Accumulate dK, dV, d log_beta of one key block over query blocks [m_lo, m_hi) of one head, keys x
    queries: ``sT[j, i]`` is query i's score of key j. Off the diagonal (``MASK`` false) the query blocks
    are whole and see every key of the block: no masks."""
    for m0 in range(m_lo, m_hi, BLOCK_M):
        rm = m0 + tl.arange(0, BLOCK_M)
        mask_m = rm < qlen
        qT = _load_cols(Q_blk, rm, sqt, rd, mask_m, mask_d, not MASK, EVEN_D)
        do = _load_rows(DO_blk, rm, sdt, rd, mask_m, mask_d, not MASK, EVEN_D)
        if MASK:
            # LSE +inf on rows past q_len makes their probabilities exactly 0
            lse = tl.load(LSE_blk + rm, mask=mask_m, other=float("inf")) * 1.4426950408889634
            delta = tl.load(DELTA_blk + rm, mask=mask_m, other=0.0)
        else:
            lse = tl.load(LSE_blk + rm) * 1.4426950408889634
            delta = tl.load(DELTA_blk + rm)
        distT = (rm + off).to(tl.float32)[None, :] - rk[:, None]
        sT = tl.dot(k, qT, input_precision=PREC) * qk_scale + distT * lb[:, None]
        pT = tl.exp2(sT - lse[None, :])
        if MASK:
            pT = tl.where(distT >= 0, pT, 0.0)
        dv += tl.dot(pT.to(do.dtype), do, input_precision=PREC)
        dpT = tl.dot(v, tl.trans(do), input_precision=PREC)
        dsT = pT * (dpT - delta[None, :])  # d loss / d score (natural units)
        dk += tl.dot(dsT.to(qT.dtype), tl.trans(qT), input_precision=PREC)
        dlb += tl.sum(dsT * distT, 1)
    return dk, dv, dlb


@_autotune(_configs("BLOCK_N", "BLOCK_M", DKDV_TILES))
@triton.jit
def _dkdv_kernel(
    Q, K, V, LB, DO, LSE, DELTA, DK, DV, DLB, SEG_B, SEG_T0, SEG_QLEN, SEG_KLEN,
    sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, slbb, slbh, slbt, sdb, sdt, sdh,
    Tq, Tk, Hq, Hkv, G, qk_scale, scale, T_KEY,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
):
    hk = tl.program_id(1)
    b, t0, qlen, klen = _segment(SEG_B, SEG_T0, SEG_QLEN, SEG_KLEN)
    n_blocks = tl.cdiv(klen, BLOCK_N)
    if tl.program_id(0) >= n_blocks:
        return
    nblk = tl.program_id(0)  # the first key blocks are seen by the most queries: they start first
    off = klen - qlen
    rn = nblk * BLOCK_N + tl.arange(0, BLOCK_N)
    rd = tl.arange(0, BLOCK_D)
    mask_n = rn < klen
    mask_d = rd < D
    k = _load_rows(K + b * skb + t0 * skt + hk * skh, rn, skt, rd, mask_n, mask_d, False, D == BLOCK_D)
    v = _load_rows(V + b * svb + t0 * svt + hk * svh, rn, svt, rd, mask_n, mask_d, False, D == BLOCK_D)
    lb = _log2_beta(tl.load(LB + b * slbb + hk * slbh + (t0 + rn) * slbt, mask=mask_n, other=0.0))
    rk = rn.to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dlb = tl.zeros([BLOCK_N], tl.float32)
    # query blocks before m_lo only see earlier keys; from m_full on, every query sees every key here;
    # whole query blocks run unmasked up to m_even, the ragged last one (if any) masked
    m_lo = (tl.maximum(nblk * BLOCK_N - off, 0) // BLOCK_M) * BLOCK_M
    m_full = tl.maximum(tl.cdiv(tl.maximum(nblk * BLOCK_N + BLOCK_N - 1 - off, 0), BLOCK_M) * BLOCK_M, m_lo)
    m_mid = tl.minimum(m_full, qlen)
    m_even = tl.maximum((qlen // BLOCK_M) * BLOCK_M, m_mid)
    for g in range(0, G):
        h = hk * G + g
        Q_blk = Q + b * sqb + t0 * sqt + h * sqh
        DO_blk = DO + b * sdb + t0 * sdt + h * sdh
        LSE_blk = LSE + (b * Hq + h) * Tq + t0
        DELTA_blk = DELTA + (b * Hq + h) * Tq + t0
        dk, dv, dlb = _dkdv_inner(dk, dv, dlb, k, v, lb, rk, Q_blk, DO_blk, LSE_blk, DELTA_blk, sqt, sdt, rd, mask_d,
                                  m_lo, m_mid, qlen, off, qk_scale, BLOCK_M, True, D == BLOCK_D, PREC)
        dk, dv, dlb = _dkdv_inner(dk, dv, dlb, k, v, lb, rk, Q_blk, DO_blk, LSE_blk, DELTA_blk, sqt, sdt, rd, mask_d,
                                  m_mid, m_even, qlen, off, qk_scale, BLOCK_M, False, D == BLOCK_D, PREC)
        dk, dv, dlb = _dkdv_inner(dk, dv, dlb, k, v, lb, rk, Q_blk, DO_blk, LSE_blk, DELTA_blk, sqt, sdt, rd, mask_d,
                                  m_even, qlen, qlen, off, qk_scale, BLOCK_M, True, D == BLOCK_D, PREC)
    row = (b * Tk + t0 + rn)[:, None] * (Hkv * D) + hk * D + rd[None, :]
    kv_mask = mask_n[:, None] & mask_d[None, :]
    tl.store(DK + row, (dk * scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + row, dv.to(DV.dtype.element_ty), mask=kv_mask)
    tl.store(DLB + (b * Hkv + hk) * Tk + t0 + rn, dlb, mask=mask_n)


@triton.jit
def _dq_inner(
    dq, q, do, lse, delta, rq, K_blk, V_blk, LB_blk, skt, svt, slbt, rd, mask_d, n_lo, n_hi, klen, qk_scale,
    BLOCK_N: tl.constexpr, MASK: tl.constexpr, EVEN_D: tl.constexpr, PREC: tl.constexpr,
):
    for n0 in range(n_lo, n_hi, BLOCK_N):
        rn, mask_n, kT, dist, s = _key_block_scores(q, rq, K_blk, LB_blk, skt, slbt, rd, mask_d, n0, klen, qk_scale,
                                                    BLOCK_N, MASK, EVEN_D, PREC)
        vT = _load_cols(V_blk, rn, svt, rd, mask_n, mask_d, not MASK, EVEN_D)
        p = tl.exp2(s - lse[:, None])
        if MASK:
            p = tl.where((dist >= 0) & mask_n[None, :], p, 0.0)
        dp = tl.dot(do, vT, input_precision=PREC)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(kT.dtype), tl.trans(kT), input_precision=PREC)
    return dq


@_autotune(_configs("BLOCK_M", "BLOCK_N", DQ_TILES))
@triton.jit
def _dq_kernel(
    Q, K, V, LB, DO, LSE, DELTA, DQ, SEG_B, SEG_T0, SEG_QLEN, SEG_KLEN,
    sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, slbb, slbh, slbt, sdb, sdt, sdh,
    Tq, Hq, G, qk_scale, scale, T_KEY,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
):
    h = tl.program_id(1)
    hk = h // G
    b, t0, qlen, klen = _segment(SEG_B, SEG_T0, SEG_QLEN, SEG_KLEN)
    n_blocks = tl.cdiv(qlen, BLOCK_M)
    if tl.program_id(0) >= n_blocks:
        return
    mblk = n_blocks - 1 - tl.program_id(0)
    off = klen - qlen
    rm = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    rd = tl.arange(0, BLOCK_D)
    mask_m = rm < qlen
    mask_d = rd < D
    q = _load_rows(Q + b * sqb + t0 * sqt + h * sqh, rm, sqt, rd, mask_m, mask_d, False, D == BLOCK_D)
    do = _load_rows(DO + b * sdb + t0 * sdt + h * sdh, rm, sdt, rd, mask_m, mask_d, False, D == BLOCK_D)
    lse = tl.load(LSE + (b * Hq + h) * Tq + t0 + rm, mask=mask_m, other=float("inf")) * 1.4426950408889634
    delta = tl.load(DELTA + (b * Hq + h) * Tq + t0 + rm, mask=mask_m, other=0.0)
    rq = (rm + off).to(tl.float32)
    K_blk = K + b * skb + t0 * skt + hk * skh
    V_blk = V + b * svb + t0 * svt + hk * svh
    LB_blk = LB + b * slbb + hk * slbh + t0 * slbt
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    first = mblk * BLOCK_M + off
    lo = ((first + 1) // BLOCK_N) * BLOCK_N
    hi = tl.minimum(klen, first + BLOCK_M)
    dq = _dq_inner(dq, q, do, lse, delta, rq, K_blk, V_blk, LB_blk, skt, svt, slbt, rd, mask_d,
                   0, lo, klen, qk_scale, BLOCK_N, False, D == BLOCK_D, PREC)
    dq = _dq_inner(dq, q, do, lse, delta, rq, K_blk, V_blk, LB_blk, skt, svt, slbt, rd, mask_d,
                   lo, hi, klen, qk_scale, BLOCK_N, True, D == BLOCK_D, PREC)
    q_mask = mask_m[:, None] & mask_d[None, :]
    tl.store(DQ + (b * Tq + t0 + rm)[:, None] * (Hq * D) + h * D + rd[None, :], (dq * scale).to(DQ.dtype.element_ty),
             mask=q_mask)


# ----------------------------------------------------------------------------------------------
# host side
# ----------------------------------------------------------------------------------------------


def _head_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    # the kernels take any batch / token / head strides but read head_dim as one contiguous run
    return x if x.stride(-1) == 1 else x.contiguous()


def _precision(dtype: torch.dtype) -> str:
    # exact fp32 dot products for fp32 inputs (ignored for 16-bit inputs, which use tensor cores)
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_inputs(q, k, v, log_beta, cu_seqlens) -> None:
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q must be float16, bfloat16 or float32, got {q.dtype}; cast q, k, v first")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not log_beta.dtype.is_floating_point:
        raise ValueError(f"log_beta must be a floating tensor (float32 preferred), got {log_beta.dtype}")
    _check(q, k, v, log_beta)
    devices = {q.device, k.device, v.device, log_beta.device}
    if len(devices) != 1:
        raise ValueError(f"q, k, v, log_beta must be on one device, got {sorted(map(str, devices))}")
    if q.device.type != "cuda" and not _INTERPRET:
        raise ValueError(
            "the Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1 set before import for CPU "
            "testing); use backend='reference' on CPU"
        )
    if q.shape[-1] > 256:
        raise ValueError(f"head_dim {q.shape[-1]} > 256 is not supported by the Triton kernel")


def _strides3(x: torch.Tensor) -> tuple[int, int, int]:
    return x.stride(0), x.stride(1), x.stride(2)


class RetentionAttentionTriton(torch.autograd.Function):
    """Autograd wrapper: ``forward(q, k, v, log_beta, scale, cu_seqlens) -> (out, lse)``."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_beta: torch.Tensor, scale: float,
                cu_seqlens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        _check_inputs(q, k, v, log_beta, cu_seqlens)
        q, k, v = (_head_dim_contiguous(x) for x in (q, k, v))
        B, Tq, Hq, D = q.shape
        Tk, Hkv = k.shape[1], k.shape[2]
        seg = segments(B, Tq, Tk, cu_seqlens, q.device)
        out = torch.empty(B, Tq, Hq, D, dtype=q.dtype, device=q.device)
        lse = torch.empty(B, Hq, Tq, dtype=torch.float32, device=q.device)
        if q.numel():
            _fwd_kernel[lambda meta: (triton.cdiv(seg.max_q, meta["BLOCK_M"]), Hq, seg.b.numel())](
                q, k, v, log_beta, out, lse, *seg[:4],
                *_strides3(q), *_strides3(k), *_strides3(v), *_strides3(log_beta),
                Tq, Hq, Hq // Hkv, scale * _LOG2E, _length_bucket(seg.max_k),
                D=D, BLOCK_D=max(16, triton.next_power_of_2(D)), PREC=_precision(q.dtype),
            )
        ctx.save_for_backward(q, k, v, log_beta, out, lse)
        ctx.seg = seg
        ctx.scale = scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(
        ctx: Any, dout: torch.Tensor, _dlse: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, None, None]:
        q, k, v, log_beta, out, lse = ctx.saved_tensors
        seg = ctx.seg
        scale = ctx.scale
        B, Tq, Hq, D = q.shape
        Tk, Hkv = k.shape[1], k.shape[2]
        G = Hq // Hkv
        do = _head_dim_contiguous(dout.to(q.dtype))
        dq = torch.empty(B, Tq, Hq, D, dtype=q.dtype, device=q.device)
        dk = torch.empty(B, Tk, Hkv, D, dtype=k.dtype, device=k.device)
        dv = torch.empty_like(dk)
        dlb = torch.zeros(B, Hkv, Tk, dtype=torch.float32, device=q.device)  # keys no query sees keep 0
        if q.numel():
            BD = max(16, triton.next_power_of_2(D))
            prec = _precision(q.dtype)
            delta = torch.empty_like(lse)
            block_t = 16 if _INTERPRET else 64
            _delta_kernel[(triton.cdiv(B * Tq, block_t), Hq)](
                out, do, delta, *_strides3(do), B * Tq, Tq, Hq, D=D, BLOCK_T=block_t, BLOCK_D=BD
            )
            strides = (*_strides3(q), *_strides3(k), *_strides3(v), *_strides3(log_beta), *_strides3(do))
            n_seg, t_key = seg.b.numel(), _length_bucket(seg.max_k)
            _dkdv_kernel[lambda meta: (triton.cdiv(seg.max_k, meta["BLOCK_N"]), Hkv, n_seg)](
                q, k, v, log_beta, do, lse, delta, dk, dv, dlb, *seg[:4], *strides,
                Tq, Tk, Hq, Hkv, G, scale * _LOG2E, scale, t_key, D=D, BLOCK_D=BD, PREC=prec,
            )
            _dq_kernel[lambda meta: (triton.cdiv(seg.max_q, meta["BLOCK_M"]), Hq, n_seg)](
                q, k, v, log_beta, do, lse, delta, dq, *seg[:4], *strides,
                Tq, Hq, G, scale * _LOG2E, scale, t_key, D=D, BLOCK_D=BD, PREC=prec,
            )
        else:
            dq.zero_(), dk.zero_(), dv.zero_()
        return dq, dk, dv, dlb.to(log_beta.dtype), None, None


def retention_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_beta: torch.Tensor,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton retention-gated attention, differentiable in q, k, v and log_beta.

    q (B, Tq, Hq, D); k, v (B, Tk, Hkv, D) fp16/bf16/fp32; log_beta (B, Hkv, Tk) (fp32 preferred);
    cu_seqlens int (n_docs + 1,) over B * Tk tokens (needs Tq == Tk). Returns ``out`` (B, Tq, Hq, D)
    in q's dtype and ``lse`` (B, Hq, Tq) fp32 (natural log, not differentiable).
    """
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return RetentionAttentionTriton.apply(q, k, v, log_beta, scale, cu_seqlens)
