"""Capacity sum (the soft cache size implied by retention gates) with one dispatch point.

``S[b, n, t] = sum_{i <= t, same document} exp((t - i) * log_beta[b, n, i])``; see :mod:`.reference`.
CUDA tensors take the Triton kernel (:mod:`.triton_kernel`) when it imports; CPU tensors take the
blocked PyTorch reference. ``RETENTION_FORCE_TRITON=1`` (with ``TRITON_INTERPRET=1``) forces Triton on
CPU for tests.
"""

from __future__ import annotations

import os

import torch

from .reference import capacity_sum_naive, capacity_sum_ref

__all__ = ["capacity_sum", "capacity_sum_ref", "capacity_sum_naive"]


def _use_triton(log_beta: torch.Tensor, backend: str) -> bool:
    if backend == "reference":
        return False
    if backend == "triton":
        return True
    if not (log_beta.is_cuda or os.environ.get("RETENTION_FORCE_TRITON") == "1"):
        return False
    try:
        from . import triton_kernel  # noqa: F401
    except ImportError:  # no Triton build for this platform: the reference still works
        return False
    return True


def capacity_sum(
    log_beta: torch.Tensor, cu_seqlens: torch.Tensor | None = None, reduce: bool = True, backend: str = "auto"
) -> torch.Tensor:
    """Soft cache size of ``log_beta`` ``(B, N, T)``: ``(B, T)`` summed over the N streams if ``reduce``,
    else ``(B, N, T)``; float32, differentiable in ``log_beta``. ``cu_seqlens`` (int, ``(n_docs + 1,)``)
    marks documents over the flattened ``B * T`` tokens. ``backend``: ``"auto"`` (Triton on CUDA,
    reference on CPU), ``"triton"`` or ``"reference"``.
    """
    if backend not in ("auto", "triton", "reference"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'reference', got {backend!r}")
    if _use_triton(log_beta, backend):
        from .triton_kernel import capacity_sum_triton

        return capacity_sum_triton(log_beta, cu_seqlens, reduce)
    return capacity_sum_ref(log_beta, cu_seqlens, reduce)
