"""Capacity sum as Triton kernels, with the reduction over streams fused into the forward.

Same math as :mod:`.reference`: ``S[b, n, t] = sum_{i <= t, same document} exp((t - i) * log_beta[b, n, i])``.
Work is split by segments (documents of packed rows, or rows), so causal skipping is index arithmetic.
Forward: one program per (segment, block of positions t) loops over the streams and the key blocks at
or before its positions, so the global sum ``(B, T)`` is written once and the per-stream sums never
exist in memory (``reduce=True``). Backward without atomics: one program per (segment, stream, block of
keys i) owns ``d log_beta`` for its keys and loops over the positions at or after them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..retention_attention.triton_kernel import _INTERPRET, _segments


@triton.jit
def _cap_fwd(LB, S, seg_start, seg_len, N, T, REDUCE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_I: tl.constexpr):
    tblk = tl.program_id(0)
    seg = tl.program_id(1)
    n_prog = tl.program_id(2)  # the stream when not reducing
    s0 = tl.load(seg_start + seg)
    slen = tl.load(seg_len + seg)
    if tblk * BLOCK_T >= slen:
        return
    rt = tblk * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = rt < slen
    tok_t = s0 + rt
    acc = tl.zeros([BLOCK_T], tl.float32)
    n_lo = 0 if REDUCE else n_prog
    n_hi = N if REDUCE else n_prog + 1
    hi = tl.minimum(slen, (tblk + 1) * BLOCK_T)
    for n in range(n_lo, n_hi):
        for i0 in range(0, hi, BLOCK_I):
            ri = i0 + tl.arange(0, BLOCK_I)
            mask_i = ri < slen
            tok_i = s0 + ri
            lb = tl.load(LB + (tok_i // T) * N * T + n * T + tok_i % T, mask=mask_i, other=0.0)
            dist = rt[:, None].to(tl.float32) - ri[None, :].to(tl.float32)
            valid = (dist >= 0) & mask_i[None, :] & mask_t[:, None]
            acc += tl.sum(tl.where(valid, tl.exp(tl.maximum(dist, 0.0) * lb[None, :]), 0.0), 1)
    if REDUCE:
        tl.store(S + tok_t, acc, mask=mask_t)  # S is (B * T,)
    else:
        tl.store(S + (tok_t // T) * N * T + n_prog * T + tok_t % T, acc, mask=mask_t)


@triton.jit
def _cap_bwd(LB, DS, DLB, seg_start, seg_len, N, T, REDUCE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_I: tl.constexpr):
    iblk = tl.program_id(0)
    seg = tl.program_id(1)
    n = tl.program_id(2)
    s0 = tl.load(seg_start + seg)
    slen = tl.load(seg_len + seg)
    if iblk * BLOCK_I >= slen:
        return
    ri = iblk * BLOCK_I + tl.arange(0, BLOCK_I)
    mask_i = ri < slen
    tok_i = s0 + ri
    lb_off = (tok_i // T) * N * T + n * T + tok_i % T
    lb = tl.load(LB + lb_off, mask=mask_i, other=0.0)
    acc = tl.zeros([BLOCK_I], tl.float32)
    for t0 in range((iblk * BLOCK_I // BLOCK_T) * BLOCK_T, slen, BLOCK_T):
        rt = t0 + tl.arange(0, BLOCK_T)
        mask_t = rt < slen
        tok_t = s0 + rt
        if REDUCE:
            ds = tl.load(DS + tok_t, mask=mask_t, other=0.0)
        else:
            ds = tl.load(DS + (tok_t // T) * N * T + n * T + tok_t % T, mask=mask_t, other=0.0)
        dist = rt[:, None].to(tl.float32) - ri[None, :].to(tl.float32)
        valid = (dist >= 0) & mask_i[None, :] & mask_t[:, None]
        w = tl.where(valid, dist * tl.exp(tl.maximum(dist, 0.0) * lb[None, :]), 0.0)
        acc += tl.sum(w * ds[:, None], 0)
    tl.store(DLB + lb_off, acc, mask=mask_i)


def _blocks():
    return (16, 16) if _INTERPRET else (64, 64)


class CapacitySumTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, log_beta, cu_seqlens, reduce):
        B, N, T = log_beta.shape
        lb = log_beta.to(torch.float32).contiguous()
        start, _, length, _, longest = _segments(B, T, T, cu_seqlens, lb.device)
        BT, BI = _blocks()
        out = torch.empty((B, T) if reduce else (B, N, T), dtype=torch.float32, device=lb.device)
        grid = (triton.cdiv(longest, BT), start.numel(), 1 if reduce else N)
        _cap_fwd[grid](lb, out, start, length, N, T, REDUCE=reduce, BLOCK_T=BT, BLOCK_I=BI)
        ctx.save_for_backward(lb, start, length)
        ctx.meta = (reduce, longest, log_beta.dtype)
        return out

    @staticmethod
    def backward(ctx, dS):
        lb, start, length = ctx.saved_tensors
        reduce, longest, dtype = ctx.meta
        B, N, T = lb.shape
        BT, BI = _blocks()
        dlb = torch.empty_like(lb)
        grid = (triton.cdiv(longest, BI), start.numel(), N)
        _cap_bwd[grid](lb, dS.float().contiguous(), dlb, start, length, N, T, REDUCE=reduce, BLOCK_T=BT, BLOCK_I=BI)
        return dlb.to(dtype), None, None


def capacity_sum_triton(log_beta: torch.Tensor, cu_seqlens: torch.Tensor | None = None, reduce: bool = True) -> torch.Tensor:
    """``(B, T)`` (``reduce``) or ``(B, N, T)`` float32 capacity sums of ``log_beta`` ``(B, N, T)``."""
    if log_beta.ndim != 3:
        raise ValueError(f"log_beta must be (batch, streams, seq), got shape {tuple(log_beta.shape)}")
    return CapacitySumTriton.apply(log_beta, cu_seqlens, reduce)
