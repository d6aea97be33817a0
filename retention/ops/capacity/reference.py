"""Capacity sum in plain PyTorch: the soft cache size implied by retention gates.

    S[b, n, t] = sum_{i <= t, same document} exp((t - i) * log_beta[b, n, i])

``log_beta`` ``(B, N, T)`` float32 (N streams: one layer's KV heads, or all layers x heads stacked);
``cu_seqlens`` marks documents over the flattened ``B * T`` tokens (as in retention attention).
With ``reduce=True`` the result is summed over the N streams: ``(B, T)``, the global soft cache size.

Backward: ``d log_beta_i = sum_{t >= i} dS_t * (t - i) * exp((t - i) * log_beta_i)``. Both passes run
over blocks of positions so memory is one block of ``B * N * C * T`` elements, never ``T x T`` per stream.
"""

from __future__ import annotations

import torch

from ..retention_attention.reference import document_ids

_BLOCK_ELEMENTS = 1 << 24


def _blocks(B: int, N: int, T: int, doc: torch.Tensor):
    block = max(16, min(T, _BLOCK_ELEMENTS // max(1, B * N * T)))
    for t0 in range(0, T, block):
        t1 = min(T, t0 + block)
        k0 = int((doc < doc[:, t0 : t0 + 1]).sum(1).min())  # first key that can share a document
        yield t0, t1, k0


def _decay(log_beta: torch.Tensor, doc: torch.Tensor, t0: int, t1: int, k0: int):
    """``exp((t - i) * log_beta_i)`` ``(B, N, C, K)`` (0 where invalid) and the distances ``(C, K)``."""
    dev = log_beta.device
    dist = (torch.arange(t0, t1, device=dev)[:, None] - torch.arange(k0, t1, device=dev)[None, :]).float()
    valid = (dist >= 0)[None] & (doc[:, t0:t1, None] == doc[:, None, k0:t1])  # (B, C, K)
    e = torch.exp(dist.clamp_min(0) * log_beta[:, :, None, k0:t1])
    return e * valid[:, None], dist


class CapacitySumRef(torch.autograd.Function):
    @staticmethod
    def forward(ctx, log_beta, cu_seqlens, reduce):
        B, N, T = log_beta.shape
        lb = log_beta.float()
        doc = document_ids(cu_seqlens, B, T, lb.device)
        out = torch.empty(B, N, T, dtype=torch.float32, device=lb.device)
        for t0, t1, k0 in _blocks(B, N, T, doc):
            out[:, :, t0:t1] = _decay(lb, doc, t0, t1, k0)[0].sum(-1)
        ctx.save_for_backward(log_beta, cu_seqlens)
        ctx.reduce = reduce
        return out.sum(1) if reduce else out

    @staticmethod
    def backward(ctx, dS):
        log_beta, cu_seqlens = ctx.saved_tensors
        B, N, T = log_beta.shape
        lb = log_beta.float()
        doc = document_ids(cu_seqlens, B, T, lb.device)
        dS = dS.float()
        dS = dS[:, None].expand(B, N, T) if ctx.reduce else dS
        grad = torch.zeros(B, N, T, dtype=torch.float32, device=lb.device)
        for t0, t1, k0 in _blocks(B, N, T, doc):
            e, dist = _decay(lb, doc, t0, t1, k0)
            grad[:, :, k0:t1] += torch.einsum("bnck,bnc,ck->bnk", e, dS[:, :, t0:t1], dist)
        return grad.to(log_beta.dtype), None, None


def capacity_sum_ref(log_beta: torch.Tensor, cu_seqlens: torch.Tensor | None = None, reduce: bool = True) -> torch.Tensor:
    """Blocked reference: ``(B, T)`` if ``reduce`` else ``(B, N, T)``; differentiable in ``log_beta``."""
    if log_beta.ndim != 3:
        raise ValueError(f"log_beta must be (batch, streams, seq), got shape {tuple(log_beta.shape)}")
    return CapacitySumRef.apply(log_beta, cu_seqlens, reduce)


def capacity_sum_naive(log_beta: torch.Tensor, cu_seqlens: torch.Tensor | None = None, reduce: bool = True) -> torch.Tensor:
    """Brute force with autograd, materialising every (t, i) pair. For tests only."""
    B, N, T = log_beta.shape
    doc = document_ids(cu_seqlens, B, T, log_beta.device)
    dist = (torch.arange(T)[:, None] - torch.arange(T)[None, :]).to(log_beta)
    valid = (dist >= 0)[None] & (doc[:, :, None] == doc[:, None, :])
    e = torch.exp(dist.clamp_min(0) * log_beta[:, :, None, :]) * valid[:, None]
    S = e.sum(-1)
    return S.sum(1) if reduce else S
