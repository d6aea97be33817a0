"""Retention-gated attention as FlashAttention-2-style Triton kernels (forward and backward).

Same math and shapes as :mod:`.reference` (the oracle the tests compare against):

    score[t, i] = q_t . k_i * scale + (t - i) * log_beta_i      (i <= t, same document)

Tokens are handled as *segments*: a segment is one document of a packed row (``cu_seqlens``) or one
batch row. Queries of a segment are the last ``q_len`` of its ``k_len`` keys (``q_len < k_len`` is a
decode step with a cache). Every program works inside one segment, so causal and document masking
are index arithmetic and key blocks outside the causal range are skipped entirely.

Forward: online softmax over key blocks; saves the log-sum-exp. Backward without atomics: one program
per (segment, KV head, key block) owns dK, dV and d log_beta of its keys and loops over the query heads
of its GQA group and the query blocks at or after its keys; a second kernel computes dQ per query block.
The decay bias is computed in fp32; matmuls accumulate in fp32.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _fwd_kernel(
    Q, K, V, LB, O, LSE,
    seg_q, seg_k, seg_qlen, seg_klen,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_lbb, stride_lbh, stride_ot, stride_oh,
    Tk, scale, G,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr,
):
    mblk = tl.program_id(0)
    seg = tl.program_id(1)
    h = tl.program_id(2)
    hk = h // G
    q0 = tl.load(seg_q + seg)
    k0 = tl.load(seg_k + seg)
    qlen = tl.load(seg_qlen + seg)
    klen = tl.load(seg_klen + seg)
    if mblk * BLOCK_M >= qlen:
        return
    off = klen - qlen  # query j sits at key position j + off
    rm = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    rd = tl.arange(0, BLOCK_D)
    mask_m = rm < qlen
    mask_d = rd < D
    q = tl.load(Q + (q0 + rm)[:, None] * stride_qt + h * stride_qh + rd[None, :], mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    tq = (rm + off).to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = tl.minimum(klen, (mblk + 1) * BLOCK_M + off)  # causal: later keys are never seen
    for n0 in range(0, hi, BLOCK_N):
        rn = n0 + tl.arange(0, BLOCK_N)
        mask_n = rn < klen
        tok = k0 + rn
        k = tl.load(K + tok[:, None] * stride_kt + hk * stride_kh + rd[None, :], mask=mask_n[:, None] & mask_d[None, :], other=0.0)
        v = tl.load(V + tok[:, None] * stride_kt + hk * stride_kh + rd[None, :], mask=mask_n[:, None] & mask_d[None, :], other=0.0)
        lb = tl.load(LB + (tok // Tk) * stride_lbb + hk * stride_lbh + tok % Tk, mask=mask_n, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale
        dist = tq[:, None] - rn[None, :].to(tl.float32)
        s += dist * lb[None, :]
        valid = (dist >= 0) & mask_n[None, :] & mask_m[:, None]
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    tl.store(O + (q0 + rm)[:, None] * stride_ot + h * stride_oh + rd[None, :], out.to(O.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])
    # LSE is (tokens, Hq) here; the wrapper returns it as (B, Hq, Tq)
    tl.store(LSE + (q0 + rm) * tl.num_programs(2) + h, m_i + tl.log(l_safe), mask=mask_m)


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, LB, DO, LSE, DELTA, DK, DV, DLB,
    seg_q, seg_k, seg_qlen, seg_klen,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_lbb, stride_lbh,
    Tk, scale, G, Hq,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr,
):
    nblk = tl.program_id(0)
    seg = tl.program_id(1)
    hk = tl.program_id(2)
    q0 = tl.load(seg_q + seg)
    k0 = tl.load(seg_k + seg)
    qlen = tl.load(seg_qlen + seg)
    klen = tl.load(seg_klen + seg)
    if nblk * BLOCK_N >= klen:
        return
    off = klen - qlen
    rn = nblk * BLOCK_N + tl.arange(0, BLOCK_N)
    rd = tl.arange(0, BLOCK_D)
    mask_n = rn < klen
    mask_d = rd < D
    tok = k0 + rn
    kv_mask = mask_n[:, None] & mask_d[None, :]
    k = tl.load(K + tok[:, None] * stride_kt + hk * stride_kh + rd[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + tok[:, None] * stride_kt + hk * stride_kh + rd[None, :], mask=kv_mask, other=0.0)
    lb_off = (tok // Tk) * stride_lbb + hk * stride_lbh + tok % Tk
    lb = tl.load(LB + lb_off, mask=mask_n, other=0.0).to(tl.float32)
    tk = rn.to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dlb = tl.zeros([BLOCK_N], tl.float32)
    # queries at or after the first key of this block (causal skip), in block-aligned steps
    m_start = tl.maximum(nblk * BLOCK_N - off, 0)
    m_start = (m_start // BLOCK_M) * BLOCK_M
    for g in range(0, G):
        h = hk * G + g
        for m0 in range(m_start, qlen, BLOCK_M):
            rm = m0 + tl.arange(0, BLOCK_M)
            mask_m = rm < qlen
            qm = mask_m[:, None] & mask_d[None, :]
            q = tl.load(Q + (q0 + rm)[:, None] * stride_qt + h * stride_qh + rd[None, :], mask=qm, other=0.0)
            do = tl.load(DO + (q0 + rm)[:, None] * stride_qt + h * stride_qh + rd[None, :], mask=qm, other=0.0)
            lse = tl.load(LSE + (q0 + rm) * Hq + h, mask=mask_m, other=0.0)
            delta = tl.load(DELTA + (q0 + rm) * Hq + h, mask=mask_m, other=0.0)
            dist = (rm + off).to(tl.float32)[:, None] - tk[None, :]
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale + dist * lb[None, :]
            valid = (dist >= 0) & mask_n[None, :] & mask_m[:, None]
            p = tl.where(valid, tl.exp(s - lse[:, None]), 0.0)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PREC)
            dp = tl.dot(do, tl.trans(v), input_precision=PREC)
            ds = p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PREC) * scale
            dlb += tl.sum(ds * dist, 0)
    tl.store(DK + tok[:, None] * stride_kt + hk * stride_kh + rd[None, :], dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + tok[:, None] * stride_kt + hk * stride_kh + rd[None, :], dv.to(DV.dtype.element_ty), mask=kv_mask)
    tl.store(DLB + lb_off, dlb, mask=mask_n)


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, LB, DO, LSE, DELTA, DQ,
    seg_q, seg_k, seg_qlen, seg_klen,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_lbb, stride_lbh,
    Tk, scale, G, Hq,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr,
):
    mblk = tl.program_id(0)
    seg = tl.program_id(1)
    h = tl.program_id(2)
    hk = h // G
    q0 = tl.load(seg_q + seg)
    k0 = tl.load(seg_k + seg)
    qlen = tl.load(seg_qlen + seg)
    klen = tl.load(seg_klen + seg)
    if mblk * BLOCK_M >= qlen:
        return
    off = klen - qlen
    rm = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    rd = tl.arange(0, BLOCK_D)
    mask_m = rm < qlen
    mask_d = rd < D
    qm = mask_m[:, None] & mask_d[None, :]
    q = tl.load(Q + (q0 + rm)[:, None] * stride_qt + h * stride_qh + rd[None, :], mask=qm, other=0.0)
    do = tl.load(DO + (q0 + rm)[:, None] * stride_qt + h * stride_qh + rd[None, :], mask=qm, other=0.0)
    lse = tl.load(LSE + (q0 + rm) * Hq + h, mask=mask_m, other=0.0)
    delta = tl.load(DELTA + (q0 + rm) * Hq + h, mask=mask_m, other=0.0)
    tq = (rm + off).to(tl.float32)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = tl.minimum(klen, (mblk + 1) * BLOCK_M + off)
    for n0 in range(0, hi, BLOCK_N):
        rn = n0 + tl.arange(0, BLOCK_N)
        mask_n = rn < klen
        tok = k0 + rn
        km = mask_n[:, None] & mask_d[None, :]
        k = tl.load(K + tok[:, None] * stride_kt + hk * stride_kh + rd[None, :], mask=km, other=0.0)
        v = tl.load(V + tok[:, None] * stride_kt + hk * stride_kh + rd[None, :], mask=km, other=0.0)
        lb = tl.load(LB + (tok // Tk) * stride_lbb + hk * stride_lbh + tok % Tk, mask=mask_n, other=0.0).to(tl.float32)
        dist = tq[:, None] - rn[None, :].to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale + dist * lb[None, :]
        valid = (dist >= 0) & mask_n[None, :] & mask_m[:, None]
        p = tl.where(valid, tl.exp(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC) * scale
    tl.store(DQ + (q0 + rm)[:, None] * stride_qt + h * stride_qh + rd[None, :], dq.to(DQ.dtype.element_ty), mask=qm)


def _segments(B: int, Tq: int, Tk: int, cu_seqlens: torch.Tensor | None, device) -> tuple[torch.Tensor, ...]:
    """Start of queries, start of keys, query and key counts of every segment ``(S,)`` int32, and the
    longest query count. Segments are documents (``cu_seqlens``, cut at row ends too) or batch rows."""
    if cu_seqlens is None:
        rows = torch.arange(B, device=device, dtype=torch.int64)
        starts_q, starts_k = rows * Tq, rows * Tk
        qlen = torch.full((B,), Tq, dtype=torch.int64, device=device)
        klen = torch.full((B,), Tk, dtype=torch.int64, device=device)
    else:
        if Tq != Tk:
            raise ValueError("cu_seqlens (packed documents) needs as many queries as keys")
        cu = cu_seqlens.to(device=device, dtype=torch.int64)
        if cu.ndim != 1 or cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != B * Tk:
            raise ValueError(f"cu_seqlens must be 1-D, start at 0 and end at batch * seqlen = {B * Tk}")
        bounds = torch.unique(torch.cat([cu, torch.arange(0, B * Tk + 1, Tk, device=device)]))
        starts_q = starts_k = bounds[:-1]
        qlen = klen = bounds[1:] - bounds[:-1]
    i32 = lambda x: x.to(torch.int32).contiguous()  # noqa: E731
    return i32(starts_q), i32(starts_k), i32(qlen), i32(klen), int(qlen.max())


def _config(dtype: torch.dtype, D: int):
    # one fixed config: the interpreter cannot autotune over several, and these sizes suit Hopper too
    if _INTERPRET:
        return dict(BLOCK_M=16, BLOCK_N=16, num_warps=1, num_stages=1)
    big = D > 64 or dtype == torch.float32
    return dict(BLOCK_M=64, BLOCK_N=64 if big else 128, num_warps=4 if big else 8, num_stages=2)


def _check_inputs(q, k, v, log_beta):
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q must be float16, bfloat16 or float32, got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    from .reference import _check

    _check(q, k, v, log_beta)
    if q.shape[-1] > 256:
        raise ValueError(f"head_dim {q.shape[-1]} > 256 is not supported by the Triton kernel")


class RetentionAttentionTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, log_beta, scale, cu_seqlens):
        _check_inputs(q, k, v, log_beta)
        B, Tq, Hq, D = q.shape
        Tk, Hkv = k.shape[1], k.shape[2]
        G = Hq // Hkv
        qf = q.reshape(B * Tq, Hq, D).contiguous()
        kf = k.reshape(B * Tk, Hkv, D).contiguous()
        vf = v.reshape(B * Tk, Hkv, D).contiguous()
        lb = log_beta.to(torch.float32).contiguous()
        sq, sk, ql, kl, qmax = _segments(B, Tq, Tk, cu_seqlens, q.device)
        out = torch.empty_like(qf)
        lse = torch.empty(B * Tq, Hq, dtype=torch.float32, device=q.device)
        cfg = _config(q.dtype, D)
        prec = "ieee" if q.dtype == torch.float32 else "tf32"
        BD = max(16, triton.next_power_of_2(D))
        grid = (triton.cdiv(qmax, cfg["BLOCK_M"]), sq.numel(), Hq)
        _fwd_kernel[grid](
            qf, kf, vf, lb, out, lse, sq, sk, ql, kl,
            qf.stride(0), qf.stride(1), kf.stride(0), kf.stride(1), lb.stride(0), lb.stride(1),
            out.stride(0), out.stride(1), Tk, scale, G,
            D=D, BLOCK_D=BD, PREC=prec, **cfg,
        )
        ctx.save_for_backward(qf, kf, vf, lb, out, lse, sq, sk, ql, kl)
        ctx.meta = (B, Tq, Tk, Hq, Hkv, D, G, scale, qmax, log_beta.dtype)
        ctx.mark_non_differentiable(lse)
        return out.view(B, Tq, Hq, D), lse.view(B, Tq, Hq).permute(0, 2, 1)

    @staticmethod
    def backward(ctx, dout, _dlse):
        qf, kf, vf, lb, out, lse, sq, sk, ql, kl = ctx.saved_tensors
        B, Tq, Tk, Hq, Hkv, D, G, scale, qmax, lb_dtype = ctx.meta
        do = dout.reshape(B * Tq, Hq, D).to(qf.dtype).contiguous()
        delta = (do.float() * out.float()).sum(-1).contiguous()  # (tokens, Hq)
        dq = torch.empty_like(qf)
        dk = torch.empty_like(kf)
        dv = torch.empty_like(vf)
        dlb = torch.zeros_like(lb)
        cfg = _config(qf.dtype, D)
        prec = "ieee" if qf.dtype == torch.float32 else "tf32"
        BD = max(16, triton.next_power_of_2(D))
        kmax = int(kl.max())
        common = (sq, sk, ql, kl, qf.stride(0), qf.stride(1), kf.stride(0), kf.stride(1), lb.stride(0), lb.stride(1),
                  Tk, scale, G, Hq)
        _bwd_dkdv_kernel[(triton.cdiv(kmax, cfg["BLOCK_N"]), sq.numel(), Hkv)](
            qf, kf, vf, lb, do, lse, delta, dk, dv, dlb, *common, D=D, BLOCK_D=BD, PREC=prec, **cfg
        )
        _bwd_dq_kernel[(triton.cdiv(qmax, cfg["BLOCK_M"]), sq.numel(), Hq)](
            qf, kf, vf, lb, do, lse, delta, dq, *common, D=D, BLOCK_D=BD, PREC=prec, **cfg
        )
        return (dq.view(B, Tq, Hq, D), dk.view(B, Tk, Hkv, D), dv.view(B, Tk, Hkv, D), dlb.to(lb_dtype), None, None)


def retention_attention_triton(q, k, v, log_beta, scale=None, cu_seqlens=None):
    """Triton retention-gated attention: returns ``(out (B, Tq, Hq, D), lse (B, Hq, Tq) fp32)``."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return RetentionAttentionTriton.apply(q, k, v, log_beta, scale, cu_seqlens)
