"""CPU path: PyTorch SDPA's fused causal kernel, with the decay folded into two extra head dimensions.

Same math and shapes as :mod:`.reference`. The decay bias is rank 2 in (query, key):

    (t - i) * log_beta_i = (t - c) * log_beta_i + 1 * (-(i - c) * log_beta_i)      for any centre c,

so appending ``[t - c, 1]`` to every scaled query and ``[log_beta_i, -(i - c) log_beta_i]`` to every key turns
retention-gated attention into plain causal attention over ``D + 2`` dimensions (values padded with two zeros).
SDPA's fused CPU kernel then runs the forward and the backward blockwise, no ``(T, T)`` tensor is materialised,
and autograd through the appended key columns gives ``d log_beta``: on SmolLM2's shapes a layer's forward and
backward take 0.10x the blocked reference's time at T = 1024 and 0.18-0.22x at 4096
(``python -m benchmarks.kernels --cpu``; ``benchmarks/results/kernels-cpu.txt``).

Rounding: the two appended products cancel where the true bias is small, so a score near the diagonal carries an
absolute error of about ``2**-24 * chunk * max|log_beta|``. Queries are taken in chunks of at most
:func:`chunk_length` positions, centred on ``c``, keeping that product under :data:`SPAN` (fp32's own error on
a score of ~30); far keys carry in addition the fp32 rounding of their own large bias, as the reference does.
When ``log_beta`` is so negative that a chunk would fall under :data:`MIN_CHUNK` (beta near 0, the floor at
``-1e30``), :func:`chunk_length` returns ``None`` and the dispatch takes the blocked reference, which is exact.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .reference import _check, document_ids, floored_log_beta

SPAN = 512.0  # chunk length x max|log_beta|: the rounding error of a score is about SPAN * 2**-24 = 3e-5
MIN_CHUNK = 64  # below this many queries a chunk, the blocked reference is as fast and exact


class TooSteepError(ValueError):
    """``log_beta`` is too negative for the folded form to be exact; the dispatch catches it and takes the
    blocked reference (one :func:`chunk_length` a call, not one to choose the path and one to run it)."""


def chunk_length(log_beta: torch.Tensor, seqlen: int) -> int | None:
    """Query positions per SDPA call for these decays, or ``None`` when the blocked reference should run.

    ``log_beta`` (B, Hkv, Tk), any float dtype; ``seqlen`` the longest span of queries (Tk, or a document's length).
    """
    if log_beta.numel() == 0:
        return max(1, seqlen)
    worst = float(floored_log_beta(log_beta.detach()).abs().amax())
    if worst != worst:  # NaN: the reference propagates it as it is
        return None
    if worst * seqlen <= SPAN:
        return max(1, seqlen)
    chunk = int(SPAN / worst)
    return chunk if chunk >= MIN_CHUNK else None


def _spans(B: int, Tk: int, cu_seqlens: torch.Tensor | None) -> list[tuple[slice, int, int]]:
    """(rows, key start, key end) of every document; rows share one span when nothing is packed."""
    if cu_seqlens is None:
        return [(slice(0, B), 0, Tk)]
    spans = []
    bounds = [int(x) for x in cu_seqlens.tolist()]
    for s, e in zip(bounds[:-1], bounds[1:]):
        while s < e:  # a row boundary is a document boundary too (as document_ids splits it)
            b, ls = divmod(s, Tk)
            le = min(e - b * Tk, Tk)
            spans.append((slice(b, b + 1), ls, le))
            s = b * Tk + le
    return spans


def retention_attention_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_beta: torch.Tensor,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Differentiable retention-gated attention ``(B, Tq, Hq, D)`` (dtype of ``q``), computed in fp32 through SDPA.

    Raises :class:`TooSteepError` (a ``ValueError``) when ``log_beta`` is too negative for the folded form to be
    exact (see :func:`chunk_length`); :func:`retention.ops.retention_attention.retention_attention` then takes the
    reference.
    """
    _check(q, k, v, log_beta)
    B, Tq, D, Tk = q.shape[0], q.shape[1], q.shape[3], k.shape[1]
    scale = D**-0.5 if scale is None else float(scale)
    if cu_seqlens is not None and Tq != Tk:  # as the blocked reference and the Triton kernel refuse it
        raise ValueError(f"cu_seqlens (packed documents) needs as many queries as keys; got {Tq} and {Tk}")
    if cu_seqlens is not None:
        document_ids(cu_seqlens, B, Tk, q.device)  # the reference's checks of cu_seqlens, with its messages
    spans = _spans(B, Tk, cu_seqlens)
    longest = max((e - max(s, Tk - Tq) for _, s, e in spans), default=0)
    chunk = chunk_length(log_beta, max(longest, 1))
    if chunk is None:
        raise TooSteepError("log_beta is too negative for the SDPA path to be exact (beta near 0); use the "
                            "blocked reference (retention_attention chooses it by itself)")
    # SDPA is on autocast's lower-precision list: in bf16 the appended positions (t - c up to thousands) lose the
    # decay, so the whole path stays fp32, as the blocked reference computes
    with torch.autocast(q.device.type, enabled=False):
        out = _folded(q, k, v, log_beta, scale, spans, chunk)
    return out[..., :D].transpose(1, 2).to(q.dtype)


def _folded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_beta: torch.Tensor, scale: float,
            spans: list[tuple[slice, int, int]], chunk: int) -> torch.Tensor:
    """The chunked SDPA calls; returns ``(B, Hq, Tq, D + 2)`` fp32 (the last two columns are padding)."""
    B, Tq, Hq, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    lb = floored_log_beta(log_beta)[..., None]  # (B, Hkv, Tk, 1)
    qh = q.float().transpose(1, 2) * scale  # (B, Hq, Tq, D)
    kh = k.float().transpose(1, 2)
    vh = F.pad(v.float().transpose(1, 2), (0, 2))  # (B, Hkv, Tk, D + 2): the fused kernel wants equal head dims
    pos = torch.arange(Tk, device=q.device, dtype=torch.float32)
    off = Tk - Tq  # queries are the last Tq key positions
    out = qh.new_zeros(B, Hq, Tq, D + 2)
    for rows, ks, ke in spans:
        for t0 in range(max(ks, off), ke, chunk):
            t1 = min(ke, t0 + chunk)
            c = (t0 + t1 - 1) / 2  # centred: |t - c| <= chunk / 2
            qc = qh[rows, :, t0 - off : t1 - off]
            n = qc.shape[0]
            qa = torch.cat([qc, (pos[t0:t1] - c)[:, None].expand(n, Hq, -1, 1), qc.new_ones(n, Hq, t1 - t0, 1)], -1)
            lbk = lb[rows, :, ks:t1]
            ka = torch.cat([kh[rows, :, ks:t1], lbk, -(pos[ks:t1] - c)[:, None] * lbk], -1)
            # queries t0..t1-1 see keys ks..t; a chunk that starts its document is a plain causal square
            square = t0 == ks
            mask = None if square else pos[t0:t1, None] >= pos[None, ks:t1]
            out[rows, :, t0 - off : t1 - off] = F.scaled_dot_product_attention(
                qa, ka, vh[rows, :, ks:t1], attn_mask=mask, is_causal=square, scale=1.0, enable_gqa=G > 1)
    return out
