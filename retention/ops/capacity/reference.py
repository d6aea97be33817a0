"""Capacity sum in plain PyTorch: the soft cache size implied by retention gates (oracle and CPU path).

    S[b, n, t] = sum_{i <= t, same document} exp((t - i) * log_beta[b, n, i])

``log_beta`` ``(B, N, T)`` (N streams: one layer's KV heads, or all layers x heads stacked), computed
in float32 whatever its dtype; ``cu_seqlens`` marks documents over the flattened ``B * T`` tokens (as
in retention attention). With ``reduce=True`` the result is summed over the N streams: ``(B, T)``, the
global soft cache size; else ``(B, N, T)``. Results are always float32.

Backward: ``d log_beta_i = sum_{t >= i} dS_t * (t - i) * exp((t - i) * log_beta_i)``. Both passes run
over blocks of streams and positions, so one block holds at most about ``_BLOCK_ELEMENTS`` decays,
never ``T x T`` per stream.
"""

from __future__ import annotations

from typing import Any

import torch

from ..retention_attention.reference import document_ids, floored_log_beta

# One block of decays holds about this many fp32 elements (~64 MB).
_BLOCK_ELEMENTS = 1 << 24


def _check(log_beta: torch.Tensor) -> None:
    if log_beta.ndim != 3:
        raise ValueError(
            f"log_beta must be (batch, streams, seq), got shape {tuple(log_beta.shape)}; "
            "stack per-layer (B, H, T) gates with torch.cat(..., dim=1)"
        )
    if not log_beta.dtype.is_floating_point:
        raise ValueError(f"log_beta must be a floating tensor (float32 preferred), got {log_beta.dtype}")


def _blocks(B: int, N: int, T: int, doc: torch.Tensor):
    """Yield ``(n0, n1, t0, t1, k0)``: streams ``n0:n1``, positions ``t0:t1`` and the first key ``k0``
    that can share a document with them; a block is ``B * (n1 - n0) * (t1 - t0) * (t1 - k0)`` decays."""
    streams = max(1, min(N, _BLOCK_ELEMENTS // max(1, 16 * B * T)))
    rows = max(16, min(T, _BLOCK_ELEMENTS // max(1, B * streams * T)))
    for n0 in range(0, N, streams):
        for t0 in range(0, T, rows):
            k0 = int((doc < doc[:, t0 : t0 + 1]).sum(1).min()) if B else 0  # an empty batch has no minimum
            yield n0, min(N, n0 + streams), t0, min(T, t0 + rows), k0


def _decay(lb: torch.Tensor, doc: torch.Tensor, t0: int, t1: int, k0: int):
    """``exp((t - i) * log_beta_i)`` ``(B, n, C, K)`` (0 where invalid) and the distances ``(C, K)``."""
    dev = lb.device
    dist = (torch.arange(t0, t1, device=dev)[:, None] - torch.arange(k0, t1, device=dev)[None, :]).float()
    valid = (dist >= 0)[None] & (doc[:, t0:t1, None] == doc[:, None, k0:t1])  # (B, C, K)
    # clamp: future keys would give exp(+large) before masking
    e = torch.exp(dist.clamp_min(0) * lb[:, :, None, k0:t1])
    return e * valid[:, None], dist


class CapacitySumRef(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, log_beta: torch.Tensor, cu_seqlens: torch.Tensor | None, reduce: bool) -> torch.Tensor:
        B, N, T = log_beta.shape
        lb = floored_log_beta(log_beta)
        doc = document_ids(cu_seqlens, B, T, lb.device)
        out = torch.zeros((B, T) if reduce else (B, N, T), dtype=torch.float32, device=lb.device)
        for n0, n1, t0, t1, k0 in _blocks(B, N, T, doc):
            s = _decay(lb[:, n0:n1], doc, t0, t1, k0)[0].sum(-1)  # (B, n, C)
            if reduce:
                out[:, t0:t1] += s.sum(1)
            else:
                out[:, n0:n1, t0:t1] = s
        ctx.save_for_backward(log_beta, cu_seqlens)
        ctx.reduce = reduce
        return out

    @staticmethod
    def backward(ctx: Any, dS: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        log_beta, cu_seqlens = ctx.saved_tensors
        B, N, T = log_beta.shape
        lb = floored_log_beta(log_beta)
        doc = document_ids(cu_seqlens, B, T, lb.device)
        dS = dS.float()
        dS = dS[:, None].expand(B, N, T) if ctx.reduce else dS
        grad = torch.zeros(B, N, T, dtype=torch.float32, device=lb.device)
        for n0, n1, t0, t1, k0 in _blocks(B, N, T, doc):
            e, dist = _decay(lb[:, n0:n1], doc, t0, t1, k0)
            grad[:, n0:n1, k0:t1] += torch.einsum("bnck,bnc,ck->bnk", e, dS[:, n0:n1, t0:t1], dist)
        return grad.to(log_beta.dtype), None, None


def capacity_sum_ref(log_beta: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                     reduce: bool = True) -> torch.Tensor:
    """Blocked reference: ``(B, T)`` if ``reduce`` else ``(B, N, T)`` float32; differentiable in ``log_beta``."""
    _check(log_beta)
    return CapacitySumRef.apply(log_beta, cu_seqlens, reduce)


def capacity_sum_naive(log_beta: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                       reduce: bool = True) -> torch.Tensor:
    """Brute force with autograd, materialising every (t, i) pair in ``log_beta``'s dtype. For tests only."""
    _check(log_beta)
    B, N, T = log_beta.shape
    dev = log_beta.device
    doc = document_ids(cu_seqlens, B, T, dev)
    dist = (torch.arange(T, device=dev)[:, None] - torch.arange(T, device=dev)[None, :]).to(log_beta)
    valid = (dist >= 0)[None] & (doc[:, :, None] == doc[:, None, :])
    e = torch.exp(dist.clamp_min(0) * log_beta[:, :, None, :]) * valid[:, None]
    S = e.sum(-1)
    return S.sum(1) if reduce else S
