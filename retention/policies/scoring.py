"""Scoring pieces shared by the policies: pooling, value norms through W_O (per entry, or as a (D, D)
metric per KV head), and the per-layer output projection read from the model."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def max_pool(scores: torch.Tensor, kernel: int, within: torch.Tensor | None = None) -> torch.Tensor:
    """Max-pool ``(..., L)`` along the entries (in position order within a stream), same length.

    ``within`` (bool, broadcastable to ``scores``, e.g. the ``(B, H, L)`` prefix of
    :func:`retention.policies.window.window_prefix` with ``[:, :, None, None]`` for ``(B, H, G, W, L)`` scores):
    the entries pooled, each over its neighbours in ``within`` only (the authors' codes pool the prefix's
    scores alone, so the observation window lends its attention to no entry before it); the others keep their
    own score. ``None``: every entry.
    """
    if kernel <= 1:
        return scores
    shape = scores.shape
    x = scores if within is None else scores.masked_fill(~within, float("-inf"))
    pooled = F.max_pool1d(x.reshape(-1, 1, shape[-1]), kernel, stride=1, padding=kernel // 2).reshape(shape)
    return pooled if within is None else torch.where(within, pooled, scores)


def output_projections(model: nn.Module) -> list[torch.Tensor]:
    """``W_O`` of every decoder layer as ``(Hq, D, hidden)``: head ``h`` maps ``v`` to ``v @ W[h]``."""
    from ..attach import attention_modules

    out = []
    for m in attention_modules(model):
        w = m.o_proj.weight  # (hidden, Hq * D)
        hidden, hd = w.shape
        D = m.head_dim
        out.append(w.detach().float().T.reshape(hd // D, D, hidden))
    return out


def projected_values(values: torch.Tensor, w_o: torch.Tensor) -> torch.Tensor:
    """``v_i W_O^h`` for every query head of each KV head: values ``(B, H, L, D)`` -> ``(B, H, G, L, hidden)``."""
    B, H, L, D = values.shape
    G = w_o.shape[0] // H
    return torch.einsum("bhld,hgde->bhgle", values.float(), w_o.reshape(H, G, D, -1))


def value_norms(values: torch.Tensor, w_o: torch.Tensor | None) -> torch.Tensor:
    """``||v_i W_O^h||_2``: values ``(B, H, L, D)`` -> ``(B, H, G, L)``; without ``W_O``, ``||v_i||_2`` as
    ``(B, H, 1, L)``, which broadcasts to every query head of the group."""
    if w_o is None:
        return values.float().norm(dim=-1)[:, :, None]
    return projected_values(values, w_o).norm(dim=-1)
