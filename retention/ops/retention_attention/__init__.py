"""Retention-gated attention: one dispatch point over the reference and the Triton kernel.

CUDA tensors take the Triton kernel (when it is available); CPU tensors take SDPA's fused kernel with the
decay folded into two extra head dimensions (:mod:`.sdpa`), or the blocked PyTorch reference where a beta
near 0 would make that form inexact.
``RETENTION_FORCE_TRITON=1`` (with ``TRITON_INTERPRET=1``) forces Triton on CPU for tests.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from . import sdpa as sdpa_path
from .reference import retention_attention_naive, retention_attention_ref
from .sdpa import retention_attention_sdpa

__all__ = [
    "retention_attention", "retention_attention_ref", "retention_attention_naive", "retention_attention_sdpa",
    "triton_available", "default_backend",
]

BACKENDS = ("auto", "triton", "reference")
_DEFAULT = ["auto"]  # what backend="auto" means; set by default_backend


def _checked(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto', 'triton' or 'reference', got {backend!r}")
    return backend


@contextlib.contextmanager
def default_backend(backend: str) -> Iterator[None]:
    """Within the block, calls with ``backend="auto"`` (every model layer's) take ``backend`` instead: e.g.
    ``"reference"`` to check a run against the exact blocked path, or to time it against the default."""
    _DEFAULT.append(_checked(backend))
    try:
        yield
    finally:
        _DEFAULT.pop()


def triton_available() -> bool:
    """Whether the Triton kernel module imports (it is added by the kernels work)."""
    try:
        from . import triton_kernel  # noqa: F401
    except ImportError:
        return False
    return True


def _use_triton(q: torch.Tensor, backend: str) -> bool:
    import os

    if backend == "reference":
        return False
    if backend == "triton":
        return True
    return (q.is_cuda or os.environ.get("RETENTION_FORCE_TRITON") == "1") and triton_available()


def retention_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_beta: torch.Tensor,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Retention-gated attention ``(B, Tq, Hq, D)``; see :mod:`.reference` for the math and shapes.

    ``backend``: ``"auto"`` (Triton on CUDA; on CPU the folded SDPA path, or the blocked reference where
    :func:`.sdpa.chunk_length` refuses these decays; :func:`default_backend` overrides it), ``"triton"`` or
    ``"reference"``. Under autocast, ``q``, ``k`` and ``v`` are cast to the autocast dtype first, as SDPA's are.
    """
    if _checked(backend) == "auto":
        backend = _DEFAULT[-1]
    device = q.device.type
    if torch.is_autocast_enabled(device):
        # as SDPA under autocast: q, k, v in the autocast dtype (a model's RoPE multiplies q and k by float32 cos/sin
        # under bf16 autocast, so they arrive float32 beside a bf16 v); log_beta stays float32
        dt = torch.get_autocast_dtype(device)
        q, k, v = q.to(dt), k.to(dt), v.to(dt)
    if _use_triton(q, backend):
        from .triton_kernel import retention_attention_triton

        return retention_attention_triton(q, k, v, log_beta, scale=scale, cu_seqlens=cu_seqlens)[0]
    if backend == "auto":
        try:
            return retention_attention_sdpa(q, k, v, log_beta, scale=scale, cu_seqlens=cu_seqlens)
        except sdpa_path.TooSteepError:  # beta near 0: the folded form would be inexact
            pass
    return retention_attention_ref(q, k, v, log_beta, scale=scale, cu_seqlens=cu_seqlens)[0]
