"""Retention-gated attention as FlashAttention-2-style Triton kernels (forward and backward).

Same math and shapes as :mod:`.reference` (the oracle the tests compare against):

    score[t, i] = q_t . k_i * scale + (t - i) * log_beta_i      (i <= t, same document)

Tokens are handled as *segments*: a segment is one document of a packed row (``cu_seqlens``, cut at
row ends) or one batch row. Queries of a segment are the last ``q_len`` of its ``k_len`` keys
(``q_len < k_len`` is a decode step with a cache). Each program works on one block of one segment,
taken from a flat work list, so blocks outside the document are never visited and causal skipping is
index arithmetic. Key/query block pairs strictly below the diagonal run without masks; only the
diagonal pairs pay for them.

Kernels (all accumulate in fp32; the decay bias is computed in fp32, scores in the log2 domain):
  _fwd_kernel    online softmax over key blocks; writes ``out`` and the log-sum-exp (natural log).
  _delta_kernel  backward preprocess: ``delta_t = sum_d dout_t * out_t``.
  _dkdv_kernel   one program per (segment, KV head, key block) owns dK, dV and d log_beta of its keys
                 and loops over the query heads of its GQA group and the query blocks at or after its
                 keys: no atomics.
  _dq_kernel     one program per (segment, query head, query block) loops over its key blocks.

Inputs may be strided views (e.g. ``(B, H, T, D)`` tensors transposed to ``(B, T, H, D)``) as long
as the head dimension is contiguous; nothing is copied for them.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from .reference import _check, checked_cu_seqlens

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


# ----------------------------------------------------------------------------------------------
# launch configuration
# ----------------------------------------------------------------------------------------------

# The outer block of each kernel (queries for forward / dQ, keys for dK dV) is fixed because the
# host builds the work list with it; the inner block and the launch parameters are autotuned on GPU.
OUTER_BLOCK = 16 if _INTERPRET else 64


def _configs(inner: str, sizes: tuple[int, ...], stages: tuple[int, ...] = (2,)) -> list:
    if _INTERPRET:  # the interpreter cannot autotune over several configs
        return [triton.Config({inner: 16}, num_warps=1, num_stages=1)]
    return [
        triton.Config({inner: size}, num_warps=warps, num_stages=st)
        for size in sizes
        for warps in (4, 8)
        for st in stages
    ]


def _autotune(configs: list):
    """``triton.autotune`` keyed on head dim and GQA group (and, implicitly, the dtypes); results are
    kept on disk where this Triton supports it, so a restarted job does not tune again."""
    import inspect

    extra = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}
    return triton.autotune(configs=configs, key=["D", "G"], **extra)


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
def _segment(WORK, SEG_B, SEG_T0, SEG_QLEN, SEG_KLEN):
    """The work item of this program: (batch row, first row position, q_len, k_len, block index)."""
    pid = tl.program_id(0)
    seg = tl.load(WORK + 2 * pid)
    blk = tl.load(WORK + 2 * pid + 1)
    b = tl.load(SEG_B + seg).to(tl.int64)  # int64 offsets: B * T * H * D may pass 2**31
    t0 = tl.load(SEG_T0 + seg).to(tl.int64)
    qlen = tl.load(SEG_QLEN + seg)
    klen = tl.load(SEG_KLEN + seg)
    return b, t0, qlen, klen, blk


@triton.jit
def _key_block(q, rq, K_blk, V_blk, LB_blk, skt, svt, slbt, rd, mask_d, n0, klen, qk_scale,
               BLOCK_N: tl.constexpr, PREC: tl.constexpr):
    """Keys and values of the block at ``n0`` and its decayed scores in the log2 domain,
    ``s = q k^T * scale * log2(e) + (i - j) * log2(beta_j)``; ``dist = i - j``; ``mask_n``: keys in range."""
    rn = n0 + tl.arange(0, BLOCK_N)
    mask_n = rn < klen
    kv_mask = mask_n[:, None] & mask_d[None, :]
    rn64 = rn.to(tl.int64)  # row offsets inside one head may pass 2**31 for very long segments
    k = tl.load(K_blk + rn64[:, None] * skt + rd[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V_blk + rn64[:, None] * svt + rd[None, :], mask=kv_mask, other=0.0)
    lb = _log2_beta(tl.load(LB_blk + rn64 * slbt, mask=mask_n, other=0.0))
    dist = rq[:, None] - rn[None, :].to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale + dist * lb[None, :]
    return k, v, s, dist, mask_n


@triton.jit
def _fwd_inner(
    acc, l_i, m_i, q, rq, K_blk, V_blk, LB_blk, skt, svt, slbt, rd, mask_d, n_lo, n_hi, klen, qk_scale,
    BLOCK_N: tl.constexpr, MASK: tl.constexpr, PREC: tl.constexpr,
):
    """Online-softmax update over key blocks [n_lo, n_hi); ``MASK`` only for blocks on the diagonal."""
    for n0 in range(n_lo, n_hi, BLOCK_N):
        k, v, s, dist, mask_n = _key_block(q, rq, K_blk, V_blk, LB_blk, skt, svt, slbt, rd, mask_d, n0, klen, qk_scale,
                                           BLOCK_N, PREC)
        if MASK:
            s = tl.where((dist >= 0) & mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new
    return acc, l_i, m_i


@_autotune(_configs("BLOCK_N", (32, 64), stages=(2, 3)))
@triton.jit
def _fwd_kernel(
    Q, K, V, LB, O, LSE, WORK, SEG_B, SEG_T0, SEG_QLEN, SEG_KLEN,
    sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, slbb, slbh, slbt,
    Tq, Hq, G, qk_scale,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
):
    h = tl.program_id(1)
    hk = h // G
    b, t0, qlen, klen, mblk = _segment(WORK, SEG_B, SEG_T0, SEG_QLEN, SEG_KLEN)
    off = klen - qlen  # query j sits at key position j + off
    rm = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    rd = tl.arange(0, BLOCK_D)
    mask_m = rm < qlen
    mask_d = rd < D
    q_mask = mask_m[:, None] & mask_d[None, :]
    q = tl.load(Q + b * sqb + (t0 + rm)[:, None] * sqt + h * sqh + rd[None, :], mask=q_mask, other=0.0)
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
                               0, lo, klen, qk_scale, BLOCK_N, False, PREC)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, rq, K_blk, V_blk, LB_blk, skt, svt, slbt, rd, mask_d,
                               lo, hi, klen, qk_scale, BLOCK_N, True, PREC)
    # every real query sees at least its own key, so l_i >= 1 there; rows past q_len are not stored
    out = acc / l_i[:, None]
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
    BLOCK_M: tl.constexpr, MASK: tl.constexpr, PREC: tl.constexpr,
):
    """Accumulate dK, dV, d log_beta of one key block over query blocks [m_lo, m_hi) of one head."""
    for m0 in range(m_lo, m_hi, BLOCK_M):
        rm = m0 + tl.arange(0, BLOCK_M)
        mask_m = rm < qlen
        q_mask = mask_m[:, None] & mask_d[None, :]
        rm64 = rm.to(tl.int64)
        q = tl.load(Q_blk + rm64[:, None] * sqt + rd[None, :], mask=q_mask, other=0.0)
        do = tl.load(DO_blk + rm64[:, None] * sdt + rd[None, :], mask=q_mask, other=0.0)
        # LSE +inf on rows past q_len makes their probabilities exactly 0
        lse = tl.load(LSE_blk + rm, mask=mask_m, other=float("inf")) * 1.4426950408889634
        delta = tl.load(DELTA_blk + rm, mask=mask_m, other=0.0)
        dist = (rm + off).to(tl.float32)[:, None] - rk[None, :]
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale + dist * lb[None, :]
        p = tl.exp2(s - lse[:, None])
        if MASK:
            p = tl.where(dist >= 0, p, 0.0)
        dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PREC)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        ds = p * (dp - delta[:, None])  # d loss / d score (natural units)
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PREC)
        dlb += tl.sum(ds * dist, 0)
    return dk, dv, dlb


@_autotune(_configs("BLOCK_M", (16, 32, 64)))
@triton.jit
def _dkdv_kernel(
    Q, K, V, LB, DO, LSE, DELTA, DK, DV, DLB, WORK, SEG_B, SEG_T0, SEG_QLEN, SEG_KLEN,
    sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, slbb, slbh, slbt, sdb, sdt, sdh,
    Tq, Tk, Hq, Hkv, G, qk_scale, scale,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
):
    hk = tl.program_id(1)
    b, t0, qlen, klen, nblk = _segment(WORK, SEG_B, SEG_T0, SEG_QLEN, SEG_KLEN)
    off = klen - qlen
    rn = nblk * BLOCK_N + tl.arange(0, BLOCK_N)
    rd = tl.arange(0, BLOCK_D)
    mask_n = rn < klen
    mask_d = rd < D
    kv_mask = mask_n[:, None] & mask_d[None, :]
    k = tl.load(K + b * skb + (t0 + rn)[:, None] * skt + hk * skh + rd[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + b * svb + (t0 + rn)[:, None] * svt + hk * svh + rd[None, :], mask=kv_mask, other=0.0)
    lb = _log2_beta(tl.load(LB + b * slbb + hk * slbh + (t0 + rn) * slbt, mask=mask_n, other=0.0))
    rk = rn.to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dlb = tl.zeros([BLOCK_N], tl.float32)
    # query blocks before m_lo only see earlier keys; from m_full on, every query sees every key here
    m_lo = (tl.maximum(nblk * BLOCK_N - off, 0) // BLOCK_M) * BLOCK_M
    m_full = tl.maximum(tl.cdiv(tl.maximum(nblk * BLOCK_N + BLOCK_N - 1 - off, 0), BLOCK_M) * BLOCK_M, m_lo)
    m_mid = tl.minimum(m_full, qlen)
    for g in range(0, G):
        h = hk * G + g
        Q_blk = Q + b * sqb + t0 * sqt + h * sqh
        DO_blk = DO + b * sdb + t0 * sdt + h * sdh
        LSE_blk = LSE + (b * Hq + h) * Tq + t0
        DELTA_blk = DELTA + (b * Hq + h) * Tq + t0
        dk, dv, dlb = _dkdv_inner(dk, dv, dlb, k, v, lb, rk, Q_blk, DO_blk, LSE_blk, DELTA_blk, sqt, sdt, rd, mask_d,
                                  m_lo, m_mid, qlen, off, qk_scale, BLOCK_M, True, PREC)
        dk, dv, dlb = _dkdv_inner(dk, dv, dlb, k, v, lb, rk, Q_blk, DO_blk, LSE_blk, DELTA_blk, sqt, sdt, rd, mask_d,
                                  m_full, qlen, qlen, off, qk_scale, BLOCK_M, False, PREC)
    row = (b * Tk + t0 + rn)[:, None] * (Hkv * D) + hk * D + rd[None, :]
    tl.store(DK + row, (dk * scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + row, dv.to(DV.dtype.element_ty), mask=kv_mask)
    tl.store(DLB + (b * Hkv + hk) * Tk + t0 + rn, dlb, mask=mask_n)


@triton.jit
def _dq_inner(
    dq, q, do, lse, delta, rq, K_blk, V_blk, LB_blk, skt, svt, slbt, rd, mask_d, n_lo, n_hi, klen, qk_scale,
    BLOCK_N: tl.constexpr, MASK: tl.constexpr, PREC: tl.constexpr,
):
    for n0 in range(n_lo, n_hi, BLOCK_N):
        k, v, s, dist, mask_n = _key_block(q, rq, K_blk, V_blk, LB_blk, skt, svt, slbt, rd, mask_d, n0, klen, qk_scale,
                                           BLOCK_N, PREC)
        p = tl.exp2(s - lse[:, None])
        if MASK:
            p = tl.where((dist >= 0) & mask_n[None, :], p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
    return dq


@_autotune(_configs("BLOCK_N", (16, 32, 64)))
@triton.jit
def _dq_kernel(
    Q, K, V, LB, DO, LSE, DELTA, DQ, WORK, SEG_B, SEG_T0, SEG_QLEN, SEG_KLEN,
    sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, slbb, slbh, slbt, sdb, sdt, sdh,
    Tq, Hq, G, qk_scale, scale,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
):
    h = tl.program_id(1)
    hk = h // G
    b, t0, qlen, klen, mblk = _segment(WORK, SEG_B, SEG_T0, SEG_QLEN, SEG_KLEN)
    off = klen - qlen
    rm = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    rd = tl.arange(0, BLOCK_D)
    mask_m = rm < qlen
    mask_d = rd < D
    q_mask = mask_m[:, None] & mask_d[None, :]
    q = tl.load(Q + b * sqb + (t0 + rm)[:, None] * sqt + h * sqh + rd[None, :], mask=q_mask, other=0.0)
    do = tl.load(DO + b * sdb + (t0 + rm)[:, None] * sdt + h * sdh + rd[None, :], mask=q_mask, other=0.0)
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
                   0, lo, klen, qk_scale, BLOCK_N, False, PREC)
    dq = _dq_inner(dq, q, do, lse, delta, rq, K_blk, V_blk, LB_blk, skt, svt, slbt, rd, mask_d,
                   lo, hi, klen, qk_scale, BLOCK_N, True, PREC)
    tl.store(DQ + (b * Tq + t0 + rm)[:, None] * (Hq * D) + h * D + rd[None, :], (dq * scale).to(DQ.dtype.element_ty),
             mask=q_mask)


# ----------------------------------------------------------------------------------------------
# host side
# ----------------------------------------------------------------------------------------------


class Segments(NamedTuple):
    """Per-segment int32 tensors ``(S,)``: batch row, first position in the row, query and key counts."""

    b: torch.Tensor
    t0: torch.Tensor
    qlen: torch.Tensor
    klen: torch.Tensor


def segments(B: int, Tq: int, Tk: int, cu_seqlens: torch.Tensor | None, device: torch.device) -> Segments:
    """Documents of ``cu_seqlens`` (over the flattened ``B * Tk`` tokens, cut at row ends as the
    reference does) or, without it, one segment per batch row with ``Tq`` queries over ``Tk`` keys."""
    if cu_seqlens is None:
        b = torch.arange(B, device=device)
        t0 = torch.zeros_like(b)
        qlen, klen = torch.full_like(b, Tq), torch.full_like(b, Tk)
    else:
        if Tq != Tk:
            raise ValueError(f"cu_seqlens (packed documents) needs as many queries as keys; got {Tq} and {Tk}")
        cu = checked_cu_seqlens(cu_seqlens, B * Tk, device)
        # row ends are document ends too (step 1 for Tk = 0: an empty batch has no segments, not a zero step)
        bounds = torch.unique(torch.cat([cu, torch.arange(0, B * Tk + 1, max(Tk, 1), device=device)]))
        start = bounds[:-1]
        b, t0 = start // Tk, start % Tk
        qlen = klen = bounds[1:] - start
    i32 = lambda x: x.to(torch.int32).contiguous()  # noqa: E731
    return Segments(i32(b), i32(t0), i32(qlen), i32(klen))


def work_list(lengths: torch.Tensor, block: int, longest_first: str) -> torch.Tensor:
    """``(W, 2)`` int32 (segment, block index) pairs covering every segment's ``lengths`` in ``block``
    steps, ordered so the most expensive programs start first: ``longest_first="late"`` when a block's
    cost grows with its index (queries: more keys before them), ``"early"`` when it shrinks (keys)."""
    lengths = lengths.to(torch.int64)
    nb = (lengths + block - 1) // block
    seg = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), nb)
    blk = torch.arange(seg.numel(), device=lengths.device) - (torch.cumsum(nb, 0) - nb)[seg]
    cost = blk if longest_first == "late" else nb[seg] - blk
    order = torch.argsort(-cost, stable=True)
    return torch.stack([seg[order], blk[order]], 1).to(torch.int32).contiguous()


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
            work = work_list(seg.qlen, OUTER_BLOCK, "late")
            _fwd_kernel[(work.shape[0], Hq)](
                q, k, v, log_beta, out, lse, work, *seg,
                *_strides3(q), *_strides3(k), *_strides3(v), *_strides3(log_beta),
                Tq, Hq, Hq // Hkv, scale * _LOG2E,
                D=D, BLOCK_D=max(16, triton.next_power_of_2(D)), BLOCK_M=OUTER_BLOCK, PREC=_precision(q.dtype),
            )
        ctx.save_for_backward(q, k, v, log_beta, out, lse, *seg)
        ctx.scale = scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(
        ctx: Any, dout: torch.Tensor, _dlse: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, None, None]:
        q, k, v, log_beta, out, lse, *seg = ctx.saved_tensors
        seg = Segments(*seg)
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
            work_k = work_list(seg.klen, OUTER_BLOCK, "early")
            _dkdv_kernel[(work_k.shape[0], Hkv)](
                q, k, v, log_beta, do, lse, delta, dk, dv, dlb, work_k, *seg, *strides,
                Tq, Tk, Hq, Hkv, G, scale * _LOG2E, scale,
                D=D, BLOCK_D=BD, BLOCK_N=OUTER_BLOCK, PREC=prec,
            )
            work_q = work_list(seg.qlen, OUTER_BLOCK, "late")
            _dq_kernel[(work_q.shape[0], Hq)](
                q, k, v, log_beta, do, lse, delta, dq, work_q, *seg, *strides,
                Tq, Hq, G, scale * _LOG2E, scale,
                D=D, BLOCK_D=BD, BLOCK_M=OUTER_BLOCK, PREC=prec,
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
