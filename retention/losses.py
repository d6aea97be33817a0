"""Training losses: chunked teacher-student KL distillation and the (global) capacity loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .ops.capacity import capacity_sum


def _chunk_kl(h_student, h_teacher, weight, bias, temperature, row_weight=None):
    """Sum over rows of KL(p_teacher || p_student) for one chunk of final hidden states ``(C, D)``,
    each row times ``row_weight`` ``(C,)`` when given."""
    # logits in float32 whatever the autocast: bf16 logits near 10 are rounded to steps of 1/16, a noise that swamps
    # the KL once the student is close to the teacher
    with torch.autocast(h_student.device.type, enabled=False):
        s = F.linear(h_student.float(), weight, bias) / temperature
        with torch.no_grad():
            t = F.log_softmax(F.linear(h_teacher.float(), weight, bias) / temperature, dim=-1)
    if row_weight is None:
        return F.kl_div(F.log_softmax(s, dim=-1), t, log_target=True, reduction="sum")
    kl = F.kl_div(F.log_softmax(s, dim=-1), t, log_target=True, reduction="none").sum(-1)
    return (kl * row_weight).sum()


def distillation_kl(
    h_student: torch.Tensor,
    h_teacher: torch.Tensor,
    lm_head: torch.nn.Module,
    mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = 256,
    reduction: str = "mean",
    weights: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, float]:
    """Mean over marked positions of ``KL(p_teacher || p_student)``, scaled by ``temperature**2``.

    ``h_student``, ``h_teacher``: final hidden states ``(B, T, D)`` (the teacher's without grad);
    ``mask`` ``(B, T)`` bool marks the positions whose next-token distribution is distilled;
    ``weights`` ``(B, T)`` float (optional) makes it a weighted mean (the count is the weights' sum).
    Logits exist for one chunk of ``chunk_size`` positions at a time, in the forward and (by
    recomputation) in the backward, so memory is bounded by the chunk, never ``T x vocab`` twice.
    ``reduction="sum"`` returns ``(sum, count)`` so data-parallel ranks can divide by a global count.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if h_student.shape != h_teacher.shape:
        raise ValueError(f"student {tuple(h_student.shape)} and teacher {tuple(h_teacher.shape)} hidden states differ")
    for what, t in (("mask", mask), ("weights", weights)):  # a flattened mismatch read other positions silently
        if t is not None and tuple(t.shape) != tuple(h_student.shape[:-1]):
            raise ValueError(f"{what} {tuple(t.shape)} does not match the hidden states' positions "
                             f"{tuple(h_student.shape[:-1])}")
    D = h_student.shape[-1]
    hs, ht = h_student.reshape(-1, D), h_teacher.detach().reshape(-1, D)
    w = None if weights is None else weights.reshape(-1).to(device=hs.device, dtype=torch.float32)
    if mask is not None:
        idx = mask.reshape(-1).nonzero().flatten()
        hs, ht = hs[idx], ht[idx]
        w = None if w is None else w[idx]
    n = hs.shape[0] if w is None else float(w.sum())
    if hs.shape[0] == 0:
        zero = h_student.sum() * 0.0
        return (zero, 0) if reduction == "sum" else zero
    bias = getattr(lm_head, "bias", None)  # in float32 for the logits (a copy only for a half-precision model)
    weight, bias = lm_head.weight.float(), None if bias is None else bias.float()
    total = h_student.new_zeros((), dtype=torch.float32)
    for c0 in range(0, hs.shape[0], chunk_size):
        args = (hs[c0 : c0 + chunk_size], ht[c0 : c0 + chunk_size], weight, bias, temperature,
                None if w is None else w[c0 : c0 + chunk_size])
        if torch.is_grad_enabled() and hs.requires_grad:
            total = total + checkpoint(_chunk_kl, *args, use_reentrant=False)
        else:
            total = total + _chunk_kl(*args)
    total = total * temperature**2
    if reduction == "sum":
        return total, n
    return total / n if n else total  # weights all 0: nothing counts, as with no marked position (was 0 / 0)


def positions_in_document(cu_seqlens: torch.Tensor | None, batch: int, seqlen: int,
                          device: torch.device) -> torch.Tensor:
    """0-based position of each token inside its document, ``(B, T)`` int64."""
    from .ops.retention_attention.reference import document_ids

    doc = document_ids(cu_seqlens, batch, seqlen, device)
    idx = torch.arange(seqlen, device=device).expand(batch, seqlen)
    start = torch.ones_like(doc, dtype=torch.bool)
    start[:, 1:] = doc[:, 1:] != doc[:, :-1]
    first = torch.cummax(torch.where(start, idx, torch.zeros_like(idx)), dim=1).values
    return idx - first


def capacity_terms(cu_seqlens: torch.Tensor | None, batch: int, streams: int, seqlen: int, budget: float,
                   form: str = "global", mask: torch.Tensor | None = None,
                   device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The entries a full cache holds at each position of its document and which positions the capacity hinge
    counts (full cache past the budget, inside ``mask``): ``(B, T)`` for ``form="global"``, ``(B, streams, T)`` per
    head. Known from a row's layout alone, so a step can count its terms before any forward."""
    if form not in ("global", "per_head"):
        raise ValueError(f"capacity form must be 'global' or 'per_head', got {form!r}")
    t = positions_in_document(cu_seqlens, batch, seqlen, device).float()
    full = (t + 1) * streams if form == "global" else (t + 1)[:, None].expand(batch, streams, seqlen)
    active = full > budget
    if mask is not None:
        active = active & (mask.to(active.device) if form == "global" else mask.to(active.device)[:, None])
    return full, active


def capacity_loss(
    log_betas: list[torch.Tensor],
    budget: float,
    form: str = "global",
    cu_seqlens: torch.Tensor | None = None,
    reduction: str = "mean",
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Hinge on the soft cache size, normalised by how far the full cache is past the budget.

    ``log_betas``: per layer ``(B, H, T)``. ``form="global"``: ``S_t = sum_{l,h} sum_{i<=t} beta_i^(t-i)``
    against ``budget`` entries for the whole model; ``form="per_head"`` (TRIM-KV): each head's sum
    against ``budget`` entries per head. With ``n`` the entries a full cache holds at position ``t`` of
    its document (``(t + 1) * L * H`` or ``t + 1``), each term is ``max(0, S_t - M) / (n - M)``: the
    fraction of the excess the soft cache still keeps, in [0, 1]. The mean runs over active terms
    (positions where the full cache is past the budget), so the term is right for any batch size and
    packing; ``reduction="sum"`` puts the sum in ``loss`` and the count in ``stats["capacity_terms"]``.
    ``mask`` ``(B, T)`` bool: positions to leave out (False), e.g. a packed row's padding.
    Returns ``(loss, stats)``.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    lb = torch.cat(log_betas, dim=1)  # (B, L*H, T)
    B, N, T = lb.shape
    full, active = capacity_terms(cu_seqlens, B, N, T, budget, form, mask, lb.device)
    S = capacity_sum(lb, cu_seqlens, reduce=form == "global")  # (B, T) global, (B, N, T) per head
    # a term counts only where the full cache is past the budget, by any distance (a fractional budget can leave
    # under one entry); elsewhere the divisor is 1 and the term unused
    terms = (S - budget).clamp_min(0) / torch.where(active, full - budget, torch.ones_like(full))
    count = int(active.sum())
    total = terms[active].sum() if count else lb.sum() * 0.0
    loss = total if reduction == "sum" else total / max(count, 1)
    # the implied cache size: the soft cache at its largest along each row (summed over heads), batch mean; the
    # share of terms past the budget; both over the positions ``mask`` keeps (S >= 0, so a masked 0 is no peak)
    row = (S.sum(1) if form == "per_head" else S).detach()
    if mask is not None:
        row = row.masked_fill(~mask.to(row.device), 0.0)
    soft_entries = row.amax(-1) if T else S.new_zeros(B)
    considered = active.numel() if mask is None else int(mask.sum()) * (N if form == "per_head" else 1)
    stats = {
        "capacity_active_frac": count / max(considered, 1),
        "soft_cache_entries": float(soft_entries.mean()),
        "capacity_terms": count,
    }
    return loss, stats


def beta_stats(log_betas: list[torch.Tensor]) -> dict[str, list[float]]:
    """Mean and standard deviation of beta per layer (for logging)."""
    with torch.no_grad():
        betas = [lb.exp() for lb in log_betas]
        return {"beta_mean": [float(b.mean()) for b in betas], "beta_std": [float(b.std()) for b in betas]}
