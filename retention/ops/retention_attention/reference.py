"""Retention-gated attention in plain PyTorch: the exact fp32 oracle and the CPU training path.

    score[t, i] = q_t . k_i * scale + (t - i) * log_beta_i     for i <= t in the same document
    out_t       = sum_i softmax_i(score[t, :]) v_i

Shapes (the layout transformers' flash path and our kernels use):
    q        (B, Tq, Hq, D)
    k, v     (B, Tk, Hkv, D)      Hq = G * Hkv (GQA: query head j reads KV head j // G)
    log_beta (B, Hkv, Tk)         float32, <= 0; beta belongs to the KV head
    out      (B, Tq, Hq, D)       dtype of q
    lse      (B, Hq, Tq)          float32 log-sum-exp of each score row (natural log)

Queries are the last ``Tq`` of the ``Tk`` key positions (``Tq < Tk`` is a decode step with a cache).
``cu_seqlens`` (int, ``(n_docs + 1,)``) marks document boundaries over the flattened ``B * Tk`` tokens,
as flash-attn's varlen API does; positions restart in each document and no token attends across one.

Memory: the forward and the backward run over blocks of queries, recomputing scores in the backward
from the saved log-sum-exp (FlashAttention's scheme), so peak memory is one block of scores, not T x T.
"""

from __future__ import annotations

from typing import Any

import torch

# One block of scores holds about this many fp32 elements (~64 MB).
_BLOCK_ELEMENTS = 1 << 24

# log_beta at or below this (-inf included) means beta = 0: the token counts for itself only (beta^0 = 1).
# Without the floor, 0 * -inf on the diagonal is NaN, and the Triton kernels' log2(e) scaling overflows to -inf
# below -2.4e38; above it nothing changes (the decay of a token 1 step back is exp(-1e30) = 0 already).
LOG_BETA_FLOOR = -1e30


def floored_log_beta(log_beta: torch.Tensor) -> torch.Tensor:
    """``log_beta`` in fp32, floored at :data:`LOG_BETA_FLOOR` (NaN stays NaN)."""
    return log_beta.to(torch.float32).clamp_min(LOG_BETA_FLOOR)


def checked_cu_seqlens(cu_seqlens: torch.Tensor, total: int, device: torch.device) -> torch.Tensor:
    """``cu_seqlens`` as int64 on ``device`` after checking it: 1-D, non-decreasing, from 0 to ``total`` tokens.

    Every path (reference, SDPA, Triton) checks through here, so they refuse the same inputs with the same words.
    """
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
        # a float would be truncated (2.5 -> 2) rather than refused
        raise ValueError(f"cu_seqlens must be an integer tensor, got {cu_seqlens.dtype}")
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    if cu.ndim != 1 or cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != total:
        raise ValueError(f"cu_seqlens must be 1-D, start at 0 and end at batch * seqlen = {total}; got {cu.tolist()}")
    if bool((cu[1:] < cu[:-1]).any()):
        raise ValueError("cu_seqlens must be non-decreasing")
    return cu


def document_ids(cu_seqlens: torch.Tensor | None, batch: int, seqlen: int, device: torch.device) -> torch.Tensor:
    """Document index of every token, ``(B, T)`` int64; each row is its own document without cu_seqlens."""
    if cu_seqlens is None:
        return torch.arange(batch, device=device)[:, None].expand(batch, seqlen)
    cu = checked_cu_seqlens(cu_seqlens, batch * seqlen, device)
    flat = torch.arange(batch * seqlen, device=device)
    doc = torch.searchsorted(cu, flat, right=True) - 1
    # a row boundary is always a document boundary too
    return (doc * batch + flat // seqlen).view(batch, seqlen)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_beta: torch.Tensor) -> None:
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError("q, k, v must be (batch, seq, heads, head_dim)")
    B, Tq, Hq, D = q.shape
    Bk, Tk, Hkv, Dk = k.shape
    if k.shape != v.shape or Bk != B or Dk != D:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must match q {tuple(q.shape)} in batch and "
                         "head_dim")
    if Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of KV heads ({Hkv})")
    if Tq > Tk:
        raise ValueError(f"more queries ({Tq}) than keys ({Tk})")
    if log_beta.shape != (B, Hkv, Tk):
        raise ValueError(f"log_beta must be (batch, kv_heads, seq_k) = {(B, Hkv, Tk)}, got {tuple(log_beta.shape)}")


class _Blocks:
    """Per-call geometry shared by the forward and the backward."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor | None) -> None:
        B, Tq, Hq, _ = q.shape
        Tk, Hkv = k.shape[1], k.shape[2]
        if cu_seqlens is not None and Tq != Tk:
            raise ValueError("cu_seqlens (packed documents) needs as many queries as keys")
        self.B, self.Tq, self.Tk, self.Hkv, self.G = B, Tq, Tk, Hkv, Hq // Hkv
        self.offset = Tk - Tq
        self.doc = document_ids(cu_seqlens, B, Tk, q.device)
        self.block = max(16, min(Tq, _BLOCK_ELEMENTS // max(1, B * Hq * Tk)))

    def ranges(self):
        for t0 in range(0, self.Tq, self.block):
            t1 = min(self.Tq, t0 + self.block)
            # keys before the earliest document start of this block cannot be attended to
            first_doc = self.doc[:, self.offset + t0]
            starts = (self.doc < first_doc[:, None]).sum(1)
            k0 = int(starts.min()) if self.B else 0  # an empty batch has no minimum
            yield t0, t1, k0, self.offset + t1

    def bias_and_mask(self, t0: int, t1: int, k0: int, k1: int, log_beta: torch.Tensor):
        """Decay bias ``(B, Hkv, 1, C, K)`` fp32 and validity mask ``(B, 1, 1, C, K)``."""
        dev = log_beta.device
        tq = torch.arange(self.offset + t0, self.offset + t1, device=dev)
        ik = torch.arange(k0, k1, device=dev)
        dist = (tq[:, None] - ik[None, :]).to(torch.float32)  # (C, K)
        valid = (dist >= 0)[None] & (self.doc[:, self.offset + t0 : self.offset + t1, None] == self.doc[:, None, k0:k1])
        bias = dist[None, None] * log_beta[:, :, None, k0:k1]  # (B, Hkv, C, K)
        return bias[:, :, None], valid[:, None, None], dist


def _heads_first(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """(B, T, H, D) -> (B, Hkv, G, T, D) fp32."""
    B, T, H, D = x.shape
    return x.to(torch.float32).permute(0, 2, 1, 3).reshape(B, hkv, H // hkv, T, D)


def retention_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_beta: torch.Tensor,
    scale: float,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward in fp32 blocks. Returns ``out`` (B, Tq, Hq, D) fp32 and ``lse`` (B, Hq, Tq) fp32."""
    _check(q, k, v, log_beta)
    g = _Blocks(q, k, cu_seqlens)
    qf = _heads_first(q, g.Hkv)
    kf = k.to(torch.float32).permute(0, 2, 1, 3)[:, :, None]  # (B, Hkv, 1, Tk, D)
    vf = v.to(torch.float32).permute(0, 2, 1, 3)[:, :, None]
    lb = floored_log_beta(log_beta)
    out = torch.empty_like(qf)
    lse = torch.empty(qf.shape[:-1], dtype=torch.float32, device=q.device)
    for t0, t1, k0, k1 in g.ranges():
        bias, valid, _ = g.bias_and_mask(t0, t1, k0, k1, lb)
        s = torch.matmul(qf[:, :, :, t0:t1], kf[..., k0:k1, :].transpose(-1, -2)) * scale + bias
        s = s.masked_fill(~valid, float("-inf"))
        m = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - m[..., None])
        out[:, :, :, t0:t1] = torch.matmul(p, vf[..., k0:k1, :])
        lse[:, :, :, t0:t1] = m
    B, Hkv, G, Tq, D = out.shape
    return out.reshape(B, Hkv * G, Tq, D).transpose(1, 2), lse.reshape(B, Hkv * G, Tq)


def retention_attention_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_beta: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    scale: float,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``dq, dk, dv`` (fp32, input layouts) and ``dlog_beta`` (B, Hkv, Tk) fp32.

    ``dS = P * (dP - delta)`` with ``delta_t = sum_d dout_t * out_t``; ``dlog_beta_i = sum_t dS[t, i] (t - i)``
    summed over the query heads of the group.
    """
    g = _Blocks(q, k, cu_seqlens)
    qf, of, dof = (_heads_first(x, g.Hkv) for x in (q, out, dout))
    kf = k.to(torch.float32).permute(0, 2, 1, 3)[:, :, None]
    vf = v.to(torch.float32).permute(0, 2, 1, 3)[:, :, None]
    lb = floored_log_beta(log_beta)
    B, Hkv, G, Tq, D = qf.shape
    lse = lse.reshape(B, Hkv, G, Tq)
    delta = (dof * of).sum(-1)  # (B, Hkv, G, Tq)
    dq = torch.zeros_like(qf)
    dk = torch.zeros(B, Hkv, g.Tk, D, dtype=torch.float32, device=q.device)
    dv = torch.zeros_like(dk)
    dlb = torch.zeros(B, Hkv, g.Tk, dtype=torch.float32, device=q.device)
    for t0, t1, k0, k1 in g.ranges():
        bias, valid, dist = g.bias_and_mask(t0, t1, k0, k1, lb)
        qc, doc_ = qf[:, :, :, t0:t1], dof[:, :, :, t0:t1]
        kc, vc = kf[..., k0:k1, :], vf[..., k0:k1, :]
        s = torch.matmul(qc, kc.transpose(-1, -2)) * scale + bias
        p = torch.exp(s - lse[:, :, :, t0:t1, None]).masked_fill(~valid, 0.0)  # (B, Hkv, G, C, K)
        dp = torch.matmul(doc_, vc.transpose(-1, -2))
        ds = p * (dp - delta[:, :, :, t0:t1, None])
        dq[:, :, :, t0:t1] = torch.matmul(ds, kc) * scale
        dk[:, :, k0:k1] += torch.einsum("bhgck,bhgcd->bhkd", ds, qc) * scale
        dv[:, :, k0:k1] += torch.einsum("bhgck,bhgcd->bhkd", p, doc_)
        dlb[:, :, k0:k1] += torch.einsum("bhgck,ck->bhk", ds, dist)
    dq = dq.reshape(B, Hkv * G, Tq, D).transpose(1, 2)
    return dq, dk.transpose(1, 2), dv.transpose(1, 2), dlb


class RetentionAttentionRef(torch.autograd.Function):
    """Autograd wrapper of the blocked reference (exact fp32, memory bounded by one block)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_beta: torch.Tensor, scale: float,
                cu_seqlens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = retention_attention_forward(q, k, v, log_beta, scale, cu_seqlens)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, log_beta, out, lse, cu_seqlens)
        ctx.scale = scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(
        ctx: Any, dout: torch.Tensor, _dlse: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, None, None]:
        q, k, v, log_beta, out, lse, cu_seqlens = ctx.saved_tensors
        dq, dk, dv, dlb = retention_attention_backward(q, k, v, log_beta, out, lse, dout, ctx.scale, cu_seqlens)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dlb.to(log_beta.dtype), None, None


def retention_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_beta: torch.Tensor,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable reference: returns ``(out, lse)``; see the module docstring for shapes."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return RetentionAttentionRef.apply(q, k, v, log_beta, scale, cu_seqlens)


def retention_attention_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_beta: torch.Tensor,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Brute force: materialises every score and relies on autograd. For tests only."""
    _check(q, k, v, log_beta)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    B, Tq, Hq, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    kk = k.repeat_interleave(G, dim=2).permute(0, 2, 1, 3)
    vv = v.repeat_interleave(G, dim=2).permute(0, 2, 1, 3)
    lb = log_beta.repeat_interleave(G, dim=1)  # (B, Hq, Tk)
    t = torch.arange(Tk - Tq, Tk, device=q.device)[:, None]
    i = torch.arange(Tk, device=q.device)[None, :]
    dist = (t - i).to(lb.dtype)
    doc = document_ids(cu_seqlens, B, Tk, q.device)
    valid = (dist >= 0)[None] & (doc[:, Tk - Tq :, None] == doc[:, None, :])
    s = torch.matmul(q.permute(0, 2, 1, 3), kk.transpose(-1, -2)) * scale + dist * lb[:, :, None, :]
    s = s.masked_fill(~valid[:, None], float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.matmul(torch.softmax(s, -1), vv)
    return out.transpose(1, 2), lse
