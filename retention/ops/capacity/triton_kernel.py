"""Capacity sum as Triton kernels, with the reduction over streams fused into the forward.

Same math as :mod:`.reference`: ``S[b, n, t] = sum_{i <= t, same document} exp((t - i) * log_beta[b, n, i])``.
Work is split by segments (documents of packed rows, or rows; see the attention kernel's ``segments``,
built on the host once per input and cached, so no launch waits for the GPU): the grid's last axis is the
segment, its first the block, and programs past their segment's end return at once; causal and document
skipping are index arithmetic.

Forward: one program per (segment, block of positions t, chunk of streams) loops over its streams and
the key blocks at or before its positions. With ``reduce=True`` the per-stream sums never reach
memory: each program writes one partial sum per chunk, ``(n_chunks, B, T)`` with a few chunks (enough
programs to fill the GPU), and the chunks are added at the end. Backward without atomics: one program
per (segment, stream, block of keys i) owns ``d log_beta`` of its keys and loops over the positions at
or after them; ``dS`` is read through its strides, so the broadcast over streams costs no memory.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from ..retention_attention.segments import segments
from ..retention_attention.triton_kernel import _INTERPRET, _log2_beta

BLOCK = 16 if _INTERPRET else 64  # positions (and keys) per tile
_TARGET_PROGRAMS = 1024  # enough forward programs to fill a large GPU several times


@triton.jit
def _item(SEG_B, SEG_T0, SEG_LEN, BLOCK: tl.constexpr, LATE_FIRST: tl.constexpr):
    """This program's (batch row, first position, segment length, block index, whether the block exists);
    ``LATE_FIRST``: block indices run backwards, so the most expensive (last) blocks start first."""
    seg = tl.program_id(2)
    b = tl.load(SEG_B + seg).to(tl.int64)
    t0 = tl.load(SEG_T0 + seg).to(tl.int64)
    slen = tl.load(SEG_LEN + seg)
    n_blocks = tl.cdiv(slen, BLOCK)
    blk = n_blocks - 1 - tl.program_id(0) if LATE_FIRST else tl.program_id(0)
    return b, t0, slen, blk, tl.program_id(0) < n_blocks


@triton.jit
def _cap_fwd(
    LB, OUT, SEG_B, SEG_T0, SEG_LEN, N, n_per, slbb, slbn, slbt, sob, son, sot,
    BLOCK_T: tl.constexpr, BLOCK_I: tl.constexpr,
):
    chunk = tl.program_id(1)  # streams chunk * n_per ... + n_per
    b, t0, slen, tblk, exists = _item(SEG_B, SEG_T0, SEG_LEN, BLOCK_T, True)
    if not exists:
        return
    rt = tblk * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = rt < slen
    acc = tl.zeros([BLOCK_T], tl.float32)
    hi = tl.minimum(slen, (tblk + 1) * BLOCK_T)  # causal: keys after the block's last position never count
    n_hi = tl.minimum(N, (chunk + 1) * n_per)
    for n in range(chunk * n_per, n_hi):
        LB_row = LB + b * slbb + n * slbn + t0 * slbt
        for i0 in range(0, hi, BLOCK_I):
            ri = i0 + tl.arange(0, BLOCK_I)
            mask_i = ri < slen
            lb = _log2_beta(tl.load(LB_row + ri.to(tl.int64) * slbt, mask=mask_i, other=0.0))
            dist = rt[:, None].to(tl.float32) - ri[None, :].to(tl.float32)
            valid = (dist >= 0) & mask_i[None, :]
            # clamp: future keys would give exp2(+large) before the mask drops them
            acc += tl.sum(tl.where(valid, tl.exp2(tl.maximum(dist, 0.0) * lb[None, :]), 0.0), 1)
    tl.store(OUT + b * sob + chunk * son + (t0 + rt) * sot, acc, mask=mask_t)


@triton.jit
def _cap_bwd(
    LB, DS, DLB, SEG_B, SEG_T0, SEG_LEN, T, slbb, slbn, slbt, sdb, sdn, sdt,
    BLOCK_T: tl.constexpr, BLOCK_I: tl.constexpr,
):
    n = tl.program_id(1)
    b, t0, slen, iblk, exists = _item(SEG_B, SEG_T0, SEG_LEN, BLOCK_I, False)
    if not exists:
        return
    ri = iblk * BLOCK_I + tl.arange(0, BLOCK_I)
    mask_i = ri < slen
    lb = _log2_beta(tl.load(LB + b * slbb + n * slbn + (t0 + ri) * slbt, mask=mask_i, other=0.0))
    DS_row = DS + b * sdb + n * sdn + t0 * sdt
    acc = tl.zeros([BLOCK_I], tl.float32)
    for s0 in range((iblk * BLOCK_I // BLOCK_T) * BLOCK_T, slen, BLOCK_T):
        rt = s0 + tl.arange(0, BLOCK_T)
        mask_t = rt < slen
        ds = tl.load(DS_row + rt.to(tl.int64) * sdt, mask=mask_t, other=0.0).to(tl.float32)
        dist = rt[:, None].to(tl.float32) - ri[None, :].to(tl.float32)
        w = tl.where((dist >= 0) & mask_t[:, None], dist * tl.exp2(tl.maximum(dist, 0.0) * lb[None, :]), 0.0)
        acc += tl.sum(w * ds[:, None], 0)
    tl.store(DLB + (b * tl.num_programs(1) + n) * T + t0 + ri, acc, mask=mask_i)


def _strides(x: torch.Tensor) -> tuple[int, int, int]:
    return x.stride(0), x.stride(1), x.stride(2)


class CapacitySumTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, log_beta: torch.Tensor, cu_seqlens: torch.Tensor | None, reduce: bool,
                streams_per_program: int | None) -> torch.Tensor:
        B, N, T = log_beta.shape
        seg = segments(B, T, T, cu_seqlens, log_beta.device)
        S, n_blocks = seg.b.numel(), triton.cdiv(seg.max_q, BLOCK)
        W = S * n_blocks  # programs per chunk (some return at once where segments are shorter)
        if reduce:
            chunks_wanted = max(1, min(N, triton.cdiv(_TARGET_PROGRAMS, max(1, W))))
            n_per = streams_per_program or triton.cdiv(max(1, N), chunks_wanted)
            chunks = triton.cdiv(N, n_per)
            out = torch.empty(B, chunks, T, dtype=torch.float32, device=log_beta.device)
        else:
            n_per, chunks = 1, N
            out = torch.empty(B, N, T, dtype=torch.float32, device=log_beta.device)
        if W and N:
            _cap_fwd[(n_blocks, chunks, S)](
                log_beta, out, seg.b, seg.t0, seg.qlen, N, n_per, *_strides(log_beta), *_strides(out),
                BLOCK_T=BLOCK, BLOCK_I=BLOCK, num_warps=1 if _INTERPRET else 4,
            )
        else:
            out.zero_()
        ctx.save_for_backward(log_beta)
        ctx.seg = seg
        ctx.reduce = reduce
        return out.sum(1) if reduce else out

    @staticmethod
    def backward(ctx: Any, dS: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (log_beta,) = ctx.saved_tensors
        seg = ctx.seg
        B, N, T = log_beta.shape
        dlb = torch.zeros(B, N, T, dtype=torch.float32, device=log_beta.device)
        S, n_blocks = seg.b.numel(), triton.cdiv(seg.max_q, BLOCK)
        if S * n_blocks and N:
            # reduce: the same dS_t for every stream, read with a zero stream stride
            dS3 = dS[:, None].expand(B, N, T) if ctx.reduce else dS
            _cap_bwd[(n_blocks, N, S)](
                log_beta, dS3, dlb, seg.b, seg.t0, seg.qlen, T, *_strides(log_beta), *_strides(dS3),
                BLOCK_T=BLOCK, BLOCK_I=BLOCK, num_warps=1 if _INTERPRET else 4,
            )
        return dlb.to(log_beta.dtype), None, None, None


def capacity_sum_triton(
    log_beta: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    reduce: bool = True,
    streams_per_program: int | None = None,
) -> torch.Tensor:
    """``(B, T)`` (``reduce``) or ``(B, N, T)`` float32 capacity sums of ``log_beta`` ``(B, N, T)``.

    ``streams_per_program`` (reduce only) overrides how many streams one forward program sums; by
    default it is chosen so the launch has about ``_TARGET_PROGRAMS`` programs.
    """
    from .reference import _check

    _check(log_beta)
    if log_beta.device.type != "cuda" and not _INTERPRET:
        raise ValueError("the Triton capacity kernel needs CUDA tensors (or TRITON_INTERPRET=1); "
                         "use backend='reference'")
    return CapacitySumTriton.apply(log_beta, cu_seqlens, reduce, streams_per_program)
