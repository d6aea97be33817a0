"""Segments of the attention and capacity kernels' launch grid: the documents of packed rows (``cu_seqlens``), or one
per batch row, as int32 tensors built on the host once per input (no Triton here: plain torch, testable anywhere)."""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch

from .reference import checked_cu_seqlens


class Segments(NamedTuple):
    """Per-segment int32 tensors ``(S,)``: batch row, first position in the row, query and key counts; and the
    longest segment's query and key counts (host ints, for the launch grid)."""

    b: torch.Tensor
    t0: torch.Tensor
    qlen: torch.Tensor
    klen: torch.Tensor
    max_q: int = 0
    max_k: int = 0


# Segments of the last few inputs: every layer of a forward gets the same shapes (and the same cu_seqlens
# tensor), so only the first layer builds them; for packed documents that spares a host sync per layer.
_SEGMENT_CACHE: dict = {}
_SEGMENT_CACHE_SIZE = 8


def segments(B: int, Tq: int, Tk: int, cu_seqlens: torch.Tensor | None, device: torch.device) -> Segments:
    """Documents of ``cu_seqlens`` (over the flattened ``B * Tk`` tokens, cut at row ends as the
    reference does) or, without it, one segment per batch row with ``Tq`` queries over ``Tk`` keys.

    Built on the host (``cu_seqlens`` is read once) and cached for the same ``cu_seqlens`` tensor (unchanged
    since) or the same shapes, so the layers of one forward launch with no host sync."""
    if cu_seqlens is None:
        key = (B, Tq, Tk, str(device))
    else:
        if Tq != Tk:
            raise ValueError(f"cu_seqlens (packed documents) needs as many queries as keys; got {Tq} and {Tk}")
        key = (B, Tq, Tk, str(device), id(cu_seqlens), cu_seqlens.data_ptr(), cu_seqlens._version,
               str(cu_seqlens.device))
    hit = _SEGMENT_CACHE.get(key)
    if hit is not None and (cu_seqlens is None or hit[0]() is cu_seqlens):
        return hit[1]
    if cu_seqlens is None:
        b = torch.arange(B)
        t0 = torch.zeros_like(b)
        qlen, klen = torch.full_like(b, Tq), torch.full_like(b, Tk)
    else:
        cu = checked_cu_seqlens(cu_seqlens.detach().cpu(), B * Tk, torch.device("cpu"))
        # row ends are document ends too (step 1 for Tk = 0: an empty batch has no segments, not a zero step)
        bounds = torch.unique(torch.cat([cu, torch.arange(0, B * Tk + 1, max(Tk, 1))]))
        start = bounds[:-1]
        b, t0 = start // Tk, start % Tk
        qlen = klen = bounds[1:] - start
    host = torch.stack([b, t0, qlen, klen]).to(torch.int32)
    dev = host.to(device, non_blocking=True) if torch.device(device).type == "cuda" else host.to(device)
    seg = Segments(dev[0], dev[1], dev[2], dev[3], int(qlen.max()) if qlen.numel() else 0,
                   int(klen.max()) if klen.numel() else 0)
    ref = weakref.ref(cu_seqlens) if cu_seqlens is not None else (lambda: None)
    if len(_SEGMENT_CACHE) >= _SEGMENT_CACHE_SIZE:
        _SEGMENT_CACHE.pop(next(iter(_SEGMENT_CACHE)))
    _SEGMENT_CACHE[key] = (ref, seg)
    return seg
