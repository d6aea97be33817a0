"""Capacity sum (the soft cache size implied by retention gates) with one dispatch point.

CUDA tensors take the Triton kernel when it is available; CPU tensors take the blocked reference.
"""

from __future__ import annotations

import torch

from .reference import capacity_sum_naive, capacity_sum_ref

__all__ = ["capacity_sum", "capacity_sum_ref", "capacity_sum_naive"]


def capacity_sum(
    log_beta: torch.Tensor, cu_seqlens: torch.Tensor | None = None, reduce: bool = True, backend: str = "auto"
) -> torch.Tensor:
    """``S_t = sum_{i<=t, same doc} beta_i^(t-i)`` for ``log_beta`` ``(B, N, T)``; ``(B, T)`` summed over N if ``reduce``."""
    if backend not in ("auto", "triton", "reference"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'reference', got {backend!r}")
    import os

    forced = os.environ.get("RETENTION_FORCE_TRITON") == "1"
    if backend == "triton" or (backend == "auto" and (log_beta.is_cuda or forced)):
        try:
            from .triton_kernel import capacity_sum_triton
        except ImportError:
            if backend == "triton":
                raise
        else:
            return capacity_sum_triton(log_beta, cu_seqlens, reduce)
    return capacity_sum_ref(log_beta, cu_seqlens, reduce)
